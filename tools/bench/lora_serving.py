"""LoRA serving in the built-in engine, in one process: memory per additional policy, and the
time from a trainer's publish to a RaaS engine having swapped the version, adapter against full.

    python tools/bench/lora_serving.py        # prints both as JSON; tools/bench/lora.py
                                              # puts them in its BENCHMARKS.md section

Memory: a TorchEngine serving 1, 2 and 4 policies of the embedded `tiny` model, either as
full-weight policies (each its own model) or as LoRA policies (rank 8 on every projection) on
one shared base (astra/lora/multi.py); `TorchEngine.held_bytes()` counts the distinct tensor
storages the served models hold.

Publish-to-swapped: a real WeightService (in this process, not durable); a version published
by the trainer's client (`publish_version`, an xor+zstd delta against the one before), fetched
by the RaaS's loader in memory (`ReceiverWeightLoader`) and swapped into a TorchEngine. Each
version changes every element (as a training step does): all weights for full versions, A and
B for adapter versions. Median over `reps` versions after the first.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from astra.clients.raas_weights import ReceiverWeightLoader
from astra.clients.weights_publish import publish_version
from astra.engine.tiny import load_model
from astra.engine.torch_engine import TorchEngine
from astra.engine.torch_weights import to_raw
from astra.lora.format import ADAPTER_FILE, AdapterConfig, base_digest, tensor_names
from astra.lora.serving import AdapterVersion
from astra.raas.backend import VersionSpec
from astra.servers.weights_serve import start_weights
from astra.weights.store import StoreConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 8


def adapter_tensors(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in sorted(base.items()):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in TARGETS:
            a, b = tensor_names(module)
            out[a] = torch.randn(RANK, w.shape[1], generator=gen) * 0.1
            out[b] = torch.randn(w.shape[0], RANK, generator=gen) * 0.1
    return out


def config_for(base: dict[str, torch.Tensor]) -> AdapterConfig:
    return AdapterConfig(rank=RANK, alpha=16.0, targets=TARGETS, base_digest=base_digest(base))


async def memory(counts: tuple[int, ...] = (1, 2, 4)) -> dict[str, dict[int, int]]:
    """Bytes the engine holds with n full-weight policies, and with n LoRA policies."""
    out: dict[str, dict[int, int]] = {"full": {}, "lora": {}}
    for n in counts:
        for kind in out:
            models = {f"p{i}": load_model("tiny") for i in range(n)}
            base = {k: v.clone() for k, v in models["p0"][0].hf_state_dict().items()}
            engine = TorchEngine(models)
            try:
                if kind == "lora":
                    config = config_for(base)
                    state = {
                        p: AdapterVersion(config, adapter_tensors(base, i))
                        for i, p in enumerate(models)
                    }
                    await engine.swap_weights(dict.fromkeys(models, 1), state)
                out[kind][n] = engine.held_bytes()
            finally:
                await engine.close()
    return out


async def publish_to_swapped(kind: str, reps: int, root: Path) -> dict[str, float]:
    """Median seconds of publish, fetch + swap, and both, over `reps` versions."""
    model, tok = load_model("tiny")
    base = {k: v.clone() for k, v in model.hf_state_dict().items()}
    engine = TorchEngine({"p": (model, tok)})
    server = await start_weights(root / kind / "store", config=StoreConfig(durable=False))
    loader = ReceiverWeightLoader(root / kind / "receiver", in_memory=True)
    files = {ADAPTER_FILE: config_for(base).to_json().encode()} if kind == "adapter" else None
    rows: list[tuple[float, float]] = []
    prev: tuple[str, Any] | None = None
    gen = torch.Generator().manual_seed(0)
    try:
        for v in range(1, reps + 2):
            if kind == "adapter":
                tensors = adapter_tensors(base, v)
            else:
                tensors = {
                    n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in base.items()
                }
            raw = {n: to_raw(t) for n, t in tensors.items()}
            started = time.perf_counter()
            await publish_version(server.address, "p", str(v), v, raw, files, base=prev)
            published = time.perf_counter()
            state, _ = await loader.fetch("p", VersionSpec(v, str(v)), server.address)
            await engine.swap_weights({"p": v}, {"p": state})
            if v > 1:  # the first version is a full copy either way
                rows.append((published - started, time.perf_counter() - published))
            prev = (str(v), raw)
    finally:
        await loader.close()
        await server.stop(0)
        await engine.close()
    pub = statistics.median(r[0] for r in rows)
    swap = statistics.median(r[1] for r in rows)
    return {"publish_s": pub, "fetch_swap_s": swap, "total_s": pub + swap}


async def measure(reps: int = 10) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="astra-bench-") as tmp:
        timing = {k: await publish_to_swapped(k, reps, Path(tmp)) for k in ("full", "adapter")}
    return {"memory": await memory(), "publish_to_swapped": timing}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(measure()), indent=2))
    sys.exit(0)
