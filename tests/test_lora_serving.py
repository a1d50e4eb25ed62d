"""The built-in engine serving LoRA adapters unmerged (astra.lora.serving): outputs equal the
merged model's, several policies each with their own adapter, and refusals that change nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from astra.clients.raas_weights import ReceiverWeightLoader
from astra.clients.weights_publish import publish_version
from astra.engine.api import Sampling
from astra.engine.tiny import load_model
from astra.engine.torch_engine import TorchEngine
from astra.errors import FailedPrecondition, InvalidArgument
from astra.lora.format import ADAPTER_FILE, AdapterConfig, base_digest, tensor_names
from astra.lora.layer import merge
from astra.lora.serving import AdapterVersion
from astra.raas.backend import VersionSpec
from astra.servers.weights_serve import start_weights
from astra.weights.store import StoreConfig

PROMPT = [5, 9, 12, 7]
TARGETS = ("q_proj", "v_proj", "down_proj")


def adapter(base: dict[str, torch.Tensor], seed: int, rank: int = 4) -> AdapterVersion:
    """A trained-looking adapter (B not zero) on `base`, at every TARGETS layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, w in sorted(base.items()):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in TARGETS:
            a, b = tensor_names(module)
            tensors[a] = torch.randn(rank, w.shape[1], generator=gen) * 0.3
            tensors[b] = torch.randn(w.shape[0], rank, generator=gen) * 0.3
    config = AdapterConfig(rank=rank, alpha=8.0, targets=TARGETS, base_digest=base_digest(base))
    return AdapterVersion(config, tensors)


def merged_model(base: dict[str, torch.Tensor], version: AdapterVersion) -> Any:
    model, tok = load_model("tiny")
    model.load_weights(merge({**base, **version.tensors}, version.config))
    return model, tok


async def greedy(engine: TorchEngine, policy: str) -> tuple[list[int], list[float], list[int]]:
    g = await engine.generate(policy, PROMPT, Sampling(max_new_tokens=12, temperature=0))
    return list(g.token_ids), list(g.logprobs), list(g.versions)


def run(body: Any) -> Any:
    return asyncio.run(asyncio.wait_for(body(), 120))


def test_an_adapter_served_unmerged_matches_the_merged_model():
    async def body():
        model, tok = load_model("tiny")
        base = {k: v.clone() for k, v in model.hf_state_dict().items()}
        version = adapter(base, seed=1)
        engine = TorchEngine({"p": (model, tok)})
        reference = TorchEngine({"p": merged_model(base, version)})
        try:
            before = await greedy(engine, "p")
            await engine.swap_weights({"p": 1}, {"p": version})
            got, want = await greedy(engine, "p"), await greedy(reference, "p")
            served = dict(model.hf_state_dict())
        finally:
            await engine.close()
            await reference.close()
        return before, got, want, base, served

    before, got, want, base, served = run(body)
    assert got[0] == want[0] and got[0] != before[0]  # the adapter changes what is generated
    np.testing.assert_allclose(got[1], want[1], atol=1e-4)
    assert set(got[2]) == {1}  # every token stamped with the adapter's version
    for name, w in base.items():  # the base is untouched: the adapter is not merged in
        assert torch.equal(served[name], w), name


def test_two_policies_on_one_engine_each_serve_their_own_adapter():
    async def body():
        (ma, tok), (mb, _) = load_model("tiny"), load_model("tiny")
        base = {k: v.clone() for k, v in ma.hf_state_dict().items()}
        va, vb = adapter(base, seed=1), adapter(base, seed=2)
        engine = TorchEngine({"a": (ma, tok), "b": (mb, tok)})
        refs = {"a": TorchEngine({"a": merged_model(base, va)})}
        refs["b"] = TorchEngine({"b": merged_model(base, vb)})
        try:
            await engine.swap_weights({"a": 3, "b": 7}, {"a": va, "b": vb})
            got = await asyncio.gather(greedy(engine, "a"), greedy(engine, "b"))
            want = [await greedy(refs["a"], "a"), await greedy(refs["b"], "b")]
        finally:
            await engine.close()
            for r in refs.values():
                await r.close()
        return got, want

    got, want = run(body)
    for (tokens, logprobs, versions), (wt, wl, _), v in zip(got, want, (3, 7), strict=True):
        assert tokens == wt and set(versions) == {v}
        np.testing.assert_allclose(logprobs, wl, atol=1e-4)
    assert got[0][0] != got[1][0]


def test_refusals_name_the_field_and_keep_the_version_in_service():
    async def body():
        model, tok = load_model("tiny")
        base = {k: v.clone() for k, v in model.hf_state_dict().items()}
        good = adapter(base, seed=1)
        engine = TorchEngine({"p": (model, tok)})
        errors: dict[str, Any] = {}
        try:
            other = dict(base)
            other["model.norm.weight"] = other["model.norm.weight"] + 1.0
            wrong_base = adapter(other, seed=1)
            with pytest.raises(FailedPrecondition) as e:
                await engine.swap_weights({"p": 1}, {"p": wrong_base})
            errors["base"] = e.value
            await engine.swap_weights({"p": 2}, {"p": good})
            served = await greedy(engine, "p")
            bigger = adapter(base, seed=3, rank=8)
            with pytest.raises(InvalidArgument) as e:
                await engine.swap_weights({"p": 3}, {"p": bigger})
            errors["rank"] = e.value
            bad_shape = AdapterVersion(
                good.config,
                {
                    k: (v[:, :-1] if k.endswith("lora_A.weight") else v)
                    for k, v in good.tensors.items()
                },
            )
            with pytest.raises(InvalidArgument) as e:
                await engine.swap_weights({"p": 3}, {"p": bad_shape})
            errors["shape"] = e.value
            with pytest.raises(FailedPrecondition) as e:  # a full version for an adapter policy
                await engine.swap_weights({"p": 3}, {"p": base})
            errors["full"] = e.value
            after = await greedy(engine, "p")
        finally:
            await engine.close()
        return errors, served, after

    errors, served, after = run(body)
    assert errors["base"].reason == "ADAPTER_BASE_MISMATCH"
    assert errors["base"].metadata["field"] == "base_digest"
    assert errors["rank"].reason == "ADAPTER_INVALID" and errors["rank"].metadata["field"] == "rank"
    assert errors["shape"].metadata["field"] == "tensors" and "lora_A is" in str(errors["shape"])
    assert errors["full"].reason == "ADAPTER_POLICY"
    assert after == served and set(after[2]) == {2}  # still version 2, the same outputs


def test_the_weight_loader_hands_an_adapter_version_from_a_weight_service(tmp_path):
    """Published with adapter_config.json to a real WeightService, fetched by the RaaS's
    loader (in memory and on disk): an AdapterVersion with the config, every tensor intact."""

    async def body():
        model, _ = load_model("tiny")
        base = model.hf_state_dict()
        version = adapter(base, seed=1)
        raw = {n: ("F32", list(t.shape), t.numpy().tobytes()) for n, t in version.tensors.items()}
        server = await start_weights(tmp_path / "store", config=StoreConfig(durable=False))
        out = []
        try:
            files = {ADAPTER_FILE: version.config.to_json().encode()}
            await publish_version(server.address, "p", "1", 1, raw, files)
            for in_memory in (True, False):
                loader = ReceiverWeightLoader(tmp_path / f"r{in_memory}", in_memory=in_memory)
                try:
                    got, nbytes = await loader.fetch("p", VersionSpec(1, "1"), server.address)
                    out.append((got, nbytes))
                finally:
                    await loader.close()
        finally:
            await server.stop(0)
        return version, out

    version, out = run(body)
    for got, nbytes in out:
        assert isinstance(got, AdapterVersion) and got.config == version.config
        assert nbytes > 0 and set(got) == set(version.tensors)
