"""HTTP engine adapters (OpenAI, vLLM, SGLang) against FAKE local servers that speak their APIs.

The FAKE servers (astra.testing.fake_engines) run the tiny torch model, so log-probs are
checked against a full forward pass of the same weights (fp32 CPU, 1e-4 absolute).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

torch = pytest.importorskip("torch")

from astra.engine.api import Generation, Sampling  # noqa: E402
from astra.engine.http import OpenAIEngine, SGLangEngine, VLLMEngine, WeightsDir  # noqa: E402
from astra.engine.http.base import HTTPEngine  # noqa: E402
from astra.engine.http.launch import ServerProcess, free_port  # noqa: E402
from astra.engine.http.vllm_launch import logprobs_mode_of  # noqa: E402
from astra.engine.tiny import TINY_CONFIG, random_model, save_model, tiny_model  # noqa: E402
from astra.engine.tokenizer import CharTokenizer  # noqa: E402
from astra.errors import FailedPrecondition, InvalidArgument, Unavailable  # noqa: E402
from astra.testing.fake_engines import FakeEngineServer, Flavor  # noqa: E402

pytestmark = pytest.mark.timeout(60)

TOL = 1e-4
TOK = CharTokenizer()
PROMPT = TOK.encode("Once upon a time")
FLAVORS = ("openai", "vllm", "sglang")


def make_engine(flavor: str, url: str, **kw: Any) -> HTTPEngine:
    if flavor == "sglang":
        return SGLangEngine(url, "p", TOK, **kw)
    if flavor == "vllm":
        return VLLMEngine(url, "FAKE-tiny", "p", TOK, **kw)
    return OpenAIEngine(url, "FAKE-tiny", "p", TOK, **kw)


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> Iterator[FakeEngineServer]:
    flavor, delay = getattr(request, "param", ("sglang", 0.0))
    with FakeEngineServer(cast(Flavor, flavor), step_delay_s=delay) as server:
        yield server


def run(fn: Callable[[], Awaitable[Any]], timeout: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), timeout))


async def with_engine(
    fake: FakeEngineServer, fn: Callable[[HTTPEngine], Awaitable[Any]], **kw: Any
) -> Any:
    engine = make_engine(fake.flavor, fake.url, **kw)
    try:
        await engine.wait_ready(10)
        return await fn(engine)
    finally:
        await engine.close()


def reference_logprobs(model: Any, prompt: list[int], gen: Generation, temperature: float) -> list:
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = model.forward_full(ids)[0].float()
    n = len(prompt)
    lp = torch.log_softmax(logits[n - 1 : n - 1 + len(gen.token_ids)] / temperature, -1)
    return [float(lp[i, t]) for i, t in enumerate(gen.token_ids)]


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A different seeded model saved as a full HF directory (the version-1 checkpoint)."""
    model = random_model(TINY_CONFIG, 7)
    path = tmp_path_factory.mktemp("w") / "v1"
    save_model(path, model, TINY_CONFIG, version="1")
    return path, model


# -- generation ----------------------------------------------------------------------------


@pytest.mark.parametrize("fake", [(f, 0.0) for f in FLAVORS], indirect=True, ids=FLAVORS)
def test_generate_aligned_and_logprobs_match_forward(fake: FakeEngineServer) -> None:
    async def body(engine: HTTPEngine) -> Generation:
        assert engine.max_seq_len("p") == 2048  # from /v1/models max_model_len
        return await engine.generate("p", PROMPT, Sampling(max_new_tokens=12, seed=3))

    gen = run(lambda: with_engine(fake, body))
    assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) == 12
    assert gen.finish_reason == "length" and gen.versions == [0] * 12
    assert gen.text == TOK.decode(gen.token_ids)
    ref = reference_logprobs(tiny_model(), PROMPT, gen, 1.0)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True)) < TOL
    assert gen.meta["engine"] == fake.flavor and gen.meta["logprob_convention"]


def test_sglang_logprobs_are_tempered(fake: FakeEngineServer) -> None:
    sampling = Sampling(max_new_tokens=8, temperature=0.7, top_k=20, seed=1)
    gen = run(lambda: with_engine(fake, lambda e: e.generate("p", PROMPT, sampling)))
    ref = reference_logprobs(tiny_model(), PROMPT, gen, 0.7)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True)) < TOL
    body = next(c.body for c in fake.calls if c.path == "/generate")
    assert body["input_ids"] == PROMPT and body["return_logprob"] is True
    assert body["sampling_params"]["top_k"] == 20 and body["sampling_params"]["min_p"] == 0.0


@pytest.mark.parametrize("flavor", ["vllm", "openai"])
def test_raw_logprobs_servers_refuse_temperatures_the_trainer_would_score_otherwise(
    flavor: str,
) -> None:
    # vLLM's default raw_logprobs are log_softmax(logits) before temperature; the trainer's
    # ratios take log_softmax(logits / T): at T = 0.7 every token's ratio would be off.
    tempered = Sampling(max_new_tokens=4, temperature=0.7, seed=1)
    with FakeEngineServer(cast(Flavor, flavor)) as fake:

        async def body(engine: HTTPEngine) -> None:
            with pytest.raises(InvalidArgument, match=r"sampling\.temperature") as info:
                await engine.generate("p", PROMPT, tempered)
            assert info.value.reason == "LOGPROBS_BEFORE_TEMPERATURE"
            for t in (1.0, 0.0):  # the two temperatures where raw and tempered agree
                await engine.generate("p", PROMPT, Sampling(max_new_tokens=2, temperature=t))

        run(lambda: with_engine(fake, body))
        assert sum(c.path == "/v1/completions" for c in fake.calls) == 2


def test_processed_logprobs_serve_any_temperature_as_the_trainer_scores_it() -> None:
    sampling = Sampling(max_new_tokens=8, temperature=0.7, seed=1)
    with FakeEngineServer("vllm", logprobs_mode="processed_logprobs") as fake:
        gen = run(
            lambda: with_engine(
                fake,
                lambda e: e.generate("p", PROMPT, sampling),
                logprobs_mode="processed_logprobs",
            )
        )
    ref = reference_logprobs(tiny_model(), PROMPT, gen, 0.7)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, ref, strict=True)) < TOL
    assert "processed_logprobs" in gen.meta["logprob_convention"]


def test_a_launched_vllm_reports_processed_logprobs_unless_told_otherwise() -> None:
    assert logprobs_mode_of(["--max-model-len", "4096"]) is None  # launch adds processed
    assert logprobs_mode_of(["--logprobs-mode", "raw_logprobs"]) == "raw_logprobs"
    assert logprobs_mode_of(["--logprobs-mode=processed_logprobs"]) == "processed_logprobs"
    with pytest.raises(InvalidArgument, match="raw_logits"):
        VLLMEngine.launch("/nonexistent", "p", TOK, extra_args=["--logprobs-mode", "raw_logits"])


@pytest.mark.parametrize("fake", [(f, 0.0) for f in FLAVORS], indirect=True, ids=FLAVORS)
def test_stop_string_stop_id_and_length(fake: FakeEngineServer) -> None:
    async def body(engine: HTTPEngine) -> tuple[Any, ...]:
        greedy = await engine.generate("p", PROMPT, Sampling(max_new_tokens=30, temperature=0))
        text = greedy.text
        stop_str = text[3:5]  # greedy is deterministic: this string will appear again
        by_str = await engine.generate(
            "p", PROMPT, Sampling(max_new_tokens=30, temperature=0, stop_strings=(stop_str,))
        )
        stop_id = greedy.token_ids[2]
        by_id = await engine.generate(
            "p", PROMPT, Sampling(max_new_tokens=30, temperature=0, stop_token_ids=(stop_id,))
        )
        short = await engine.generate("p", PROMPT, Sampling(max_new_tokens=4, temperature=0))
        return greedy, by_str, by_id, short, stop_str, stop_id

    greedy, by_str, by_id, short, stop_str, stop_id = run(lambda: with_engine(fake, body))
    assert by_str.finish_reason == "stop" and by_str.meta["stop"] == stop_str
    assert by_str.text.endswith(stop_str) and stop_str not in by_str.text[:-1]
    assert by_str.token_ids == greedy.token_ids[: len(by_str.token_ids)]
    assert by_id.finish_reason == "stop" and by_id.meta["stop"] == stop_id
    assert by_id.token_ids[-1] == stop_id and stop_id not in by_id.token_ids[:-1]
    assert short.finish_reason == "length" and short.token_ids == greedy.token_ids[:4]


def test_openai_without_extensions_needs_token_ids() -> None:
    with FakeEngineServer("openai") as fake:

        async def body(engine: HTTPEngine) -> None:
            with pytest.raises(InvalidArgument, match=r"sampling\.top_k"):
                await engine.generate("p", PROMPT, Sampling(max_new_tokens=4, top_k=5))
            # Without return_tokens_as_token_ids the FAKE (like OpenAI) answers text tokens.
            with pytest.raises(Unavailable, match="token ids") as err:
                await engine.generate("p", PROMPT, Sampling(max_new_tokens=4, temperature=0))
            assert err.value.reason == "ENGINE_BAD_RESPONSE"

        run(lambda: with_engine(fake, body, extensions=False))
        sent = next(c.body for c in fake.calls if c.path == "/v1/completions")
        assert "top_k" not in sent and "return_tokens_as_token_ids" not in sent


def test_openai_without_extensions_enforces_stop_ids_on_the_client() -> None:
    with FakeEngineServer("openai", token_ids_field=True) as fake:

        async def body(engine: HTTPEngine) -> tuple[Generation, Generation]:
            greedy = await engine.generate("p", PROMPT, Sampling(max_new_tokens=20, temperature=0))
            stop_id = greedy.token_ids[5]
            s = Sampling(max_new_tokens=20, temperature=0, stop_token_ids=(stop_id,))
            return greedy, await engine.generate("p", PROMPT, s)

        greedy, gen = run(lambda: with_engine(fake, body, extensions=False))
        sent = [c.body for c in fake.calls if c.path == "/v1/completions"][-1]
        assert "stop_token_ids" not in sent and sent["max_tokens"] == 20
        end = greedy.token_ids.index(greedy.token_ids[5]) + 1
        assert gen.finish_reason == "stop" and gen.token_ids == greedy.token_ids[:end]
        assert len(gen.logprobs) == len(gen.versions) == end
        assert gen.meta["stop"] == greedy.token_ids[5]


# -- weight swaps --------------------------------------------------------------------------


async def until_running(fake: FakeEngineServer, extra_s: float = 0.0) -> None:
    for _ in range(500):
        if fake.running:
            await asyncio.sleep(extra_s)
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the FAKE server never started the request")


async def swap_mid_generation(
    engine: HTTPEngine, fake: FakeEngineServer, weights: Path, prompt: list[int]
) -> Generation:
    task = asyncio.create_task(
        engine.generate("p", prompt, Sampling(max_new_tokens=60, temperature=0))
    )
    await until_running(fake, 0.08)  # a few tokens in, far from the end (10 ms a token)
    await engine.swap_weights({"p": 1}, {"p": WeightsDir(weights)})
    return await task


@pytest.mark.parametrize(
    ("fake", "order"),
    [
        (
            ("sglang", 0.01),
            ["/pause_generation", "/update_weights_from_disk", "/continue_generation"],
        ),
        (("vllm", 0.01), ["/pause", "/collective_rpc", "/resume"]),
    ],
    indirect=["fake"],
    ids=["sglang", "vllm"],
)
def test_swap_pauses_updates_resumes_and_relabels(
    fake: FakeEngineServer, order: list[str], new_weights: tuple[Path, Any]
) -> None:
    path, model = new_weights

    async def body(engine: HTTPEngine) -> tuple[Generation, Generation]:
        gen = await swap_mid_generation(engine, fake, path, PROMPT)
        after = await engine.generate("p", PROMPT, Sampling(max_new_tokens=5, temperature=0))
        assert engine.version("p") == 1
        return gen, after

    gen, after = run(lambda: with_engine(fake, body))
    control = [p for p in fake.paths("POST") if p in order]
    assert control == order
    update = next(c.body for c in fake.calls if c.path == order[1])
    if fake.flavor == "sglang":
        assert update["model_path"] == str(path) and update["weight_version"] == "1"
        assert fake.calls[[c.path for c in fake.calls].index("/pause_generation")].body == {
            "mode": "abort"
        }
        assert fake.weight_version == "1"
    else:
        assert update == {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        pause = next(c for c in fake.calls if c.path == "/pause")
        assert pause.query == {"mode": "abort"}  # vLLM 0.32: abort clears the caches itself
    # The in-flight generation was cut by the pause and carried on with the new weights.
    k = gen.versions.count(0)
    assert 0 < k < len(gen.token_ids) and gen.versions == [0] * k + [1] * (len(gen.versions) - k)
    assert gen.meta["segments"] == 2 and len(gen.token_ids) == len(gen.logprobs)
    # Tokens after the swap carry log-probs of the new weights on the full context.
    ids = torch.tensor([PROMPT + gen.token_ids])
    with torch.no_grad():
        logits = model.forward_full(ids)[0].float()
    n = len(PROMPT)
    lp = torch.log_softmax(logits, -1)
    for i in range(k, len(gen.token_ids)):
        assert abs(gen.logprobs[i] - float(lp[n - 1 + i, gen.token_ids[i]])) < TOL
    assert after.versions == [1] * 5


@pytest.mark.parametrize("fake", [("sglang", 0.01)], indirect=True)
def test_finish_old_lets_inflight_finish_on_old_weights(
    fake: FakeEngineServer, new_weights: tuple[Path, Any]
) -> None:
    async def body(engine: HTTPEngine) -> Generation:
        task = asyncio.create_task(
            engine.generate("p", PROMPT, Sampling(max_new_tokens=20, temperature=0))
        )
        await until_running(fake, 0.03)
        await engine.swap_weights({"p": 1}, {"p": WeightsDir(new_weights[0])})
        assert task.done()  # the swap waited for it
        return task.result()

    gen = run(lambda: with_engine(fake, body, on_swap="finish_old"))
    assert gen.versions == [0] * 20 and gen.meta["segments"] == 1


def test_failed_update_keeps_version_and_resumes(fake: FakeEngineServer, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()

    async def body(engine: HTTPEngine) -> Generation:
        with pytest.raises(FailedPrecondition, match="could not load") as err:
            await engine.swap_weights({"p": 1}, {"p": WeightsDir(empty)})
        assert err.value.reason == "WEIGHT_UPDATE_FAILED"
        assert engine.version("p") == 0 and engine.healthy
        return await engine.generate("p", PROMPT, Sampling(max_new_tokens=3))

    gen = run(lambda: with_engine(fake, body))
    assert gen.versions == [0, 0, 0]
    assert fake.paths("POST")[-2:] == ["/continue_generation", "/generate"]


def test_swap_refuses_tensors_and_relabels_without_state(fake: FakeEngineServer) -> None:
    async def body(engine: HTTPEngine) -> None:
        with pytest.raises(FailedPrecondition) as err:
            await engine.swap_weights({"p": 1}, {"p": {"w": torch.zeros(1)}})
        assert err.value.reason == "NEEDS_WEIGHTS_DIR"
        with pytest.raises(InvalidArgument, match="unknown policy"):
            await engine.swap_weights({"q": 1}, {})
        await engine.swap_weights({"p": 4}, {})
        assert engine.version("p") == 4

    run(lambda: with_engine(fake, body))
    assert "/pause_generation" not in fake.paths()


@pytest.mark.parametrize("fake", [("openai", 0.0)], indirect=True)
def test_openai_frozen_endpoint_refuses_swap(
    fake: FakeEngineServer, new_weights: tuple[Path, Any]
) -> None:
    async def body(engine: HTTPEngine) -> None:
        with pytest.raises(FailedPrecondition, match=r"'p'.*frozen") as err:
            await engine.swap_weights({"p": 1}, {"p": WeightsDir(new_weights[0])})
        assert err.value.reason == "FROZEN_ENDPOINT" and engine.version("p") == 0

    run(lambda: with_engine(fake, body))

    async def hot(engine: HTTPEngine) -> Generation:
        await engine.swap_weights({"p": 3}, {})
        return await engine.generate("p", PROMPT, Sampling(max_new_tokens=2))

    gen = run(lambda: with_engine(fake, hot, hot_loaded=True))
    assert gen.versions == [3, 3]


def test_weights_dir_reads_as_tensors(new_weights: tuple[Path, Any]) -> None:
    wd = WeightsDir(new_weights[0])
    state = dict(wd)
    assert "model.embed_tokens.weight" in state and len(wd) == len(state)
    expected = new_weights[1].model.embed_tokens.weight
    assert torch.equal(wd["model.embed_tokens.weight"], expected)


# -- errors and cancellation ----------------------------------------------------------------


@pytest.mark.parametrize("fake", [(f, 0.0) for f in FLAVORS], indirect=True, ids=FLAVORS)
def test_http_errors_map_to_astra_errors(fake: FakeEngineServer) -> None:
    path = "/generate" if fake.flavor == "sglang" else "/v1/completions"

    async def body(engine: HTTPEngine) -> None:
        s = Sampling(max_new_tokens=3)
        fake.fail(path, 503, "FAKE overloaded")
        with pytest.raises(Unavailable, match=r"HTTP 503.*FAKE overloaded") as err:
            await engine.generate("p", PROMPT, s)
        assert err.value.reason == "ENGINE_ERROR"
        fake.fail(path, 400, "FAKE bad field")
        with pytest.raises(InvalidArgument, match=r"HTTP 400.*FAKE bad field") as err2:
            await engine.generate("p", PROMPT, s)
        assert err2.value.metadata["http_status"] == "400"
        with pytest.raises(InvalidArgument, match="prompt_ids") as err3:  # checked locally
            await engine.generate("p", PROMPT, Sampling(max_new_tokens=4000))
        assert err3.value.reason == "PROMPT_TOO_LONG"
        assert (await engine.generate("p", PROMPT, s)).finish_reason == "length"

    run(lambda: with_engine(fake, body))


def test_connection_refused_is_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def body() -> None:
        for flavor in FLAVORS:
            engine = make_engine(flavor, url, max_seq_len=100)
            try:
                with pytest.raises(Unavailable, match="unreachable") as err:
                    await engine.generate("p", PROMPT, Sampling(max_new_tokens=2))
                assert err.value.reason == "ENGINE_UNREACHABLE"
            finally:
                await engine.close()

    run(body)


@pytest.mark.parametrize("fake", [("openai", 0.0)], indirect=True)
def test_unknown_model_is_invalid_argument(fake: FakeEngineServer) -> None:
    async def body() -> None:
        engine = OpenAIEngine(fake.url, "no-such-model", "p", TOK, max_seq_len=100)
        try:
            with pytest.raises(InvalidArgument, match=r"HTTP 404.*no-such-model"):
                await engine.generate("p", PROMPT, Sampling(max_new_tokens=2))
        finally:
            await engine.close()

    run(body)


@pytest.mark.parametrize("fake", [("sglang", 0.02)], indirect=True)
def test_cancel_aborts_the_server_request(fake: FakeEngineServer) -> None:
    async def body(engine: HTTPEngine) -> None:
        # Greedy: 500 tokens without an end-of-sequence on this prompt (a sampled run could
        # end at once, before the loop below ever sees it running).
        sampling = Sampling(max_new_tokens=500, temperature=0.0)
        task = asyncio.create_task(engine.generate("p", PROMPT, sampling))
        while fake.running == 0:
            assert not task.done(), task.result()
            await asyncio.sleep(0.01)
        assert engine.stats()["running"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if fake.running == 0:
                break
            await asyncio.sleep(0.01)
        assert fake.running == 0 and engine.stats()["running"] == 0

    run(lambda: with_engine(fake, body))
    assert "/abort_request" in fake.paths()


def test_unknown_policy_and_bad_sampling_are_refused(fake: FakeEngineServer) -> None:
    async def body(engine: HTTPEngine) -> None:
        with pytest.raises(InvalidArgument, match="policy_id"):
            await engine.generate("q", PROMPT, Sampling(max_new_tokens=2))
        with pytest.raises(InvalidArgument, match=r"sampling\.top_p"):
            await engine.generate("p", PROMPT, Sampling(max_new_tokens=2, top_p=0))

    run(lambda: with_engine(fake, body))
    assert "/generate" not in fake.paths()


@pytest.mark.parametrize("engine", ["vllm", "openai"])
def test_serve_raas_options_reach_an_attached_engine(engine: str, tmp_path: Path) -> None:
    from astra.servers.raas_engines import build_engine
    from astra.servers.raas_serve import RaasOptions

    with FakeEngineServer(cast(Flavor, engine)) as fake:
        opts = RaasOptions(dataflow="", policies=["p"], engine=engine, engine_url=fake.url,
                           served_model_name="FAKE-tiny", on_swap="finish_old",
                           engine_logprobs_mode="processed_logprobs",
                           state_dir=str(tmp_path))  # fmt: skip

        async def body() -> tuple[str, str]:
            built = await build_engine(opts)
            try:
                return built.on_swap, built.logprobs_mode
            finally:
                await built.close()

        on_swap, mode = run(body)
        assert mode == "processed_logprobs"
        assert on_swap == ("finish_old" if engine == "vllm" else "continue")  # openai: relabels


def test_serverprocess_reports_the_error_line(tmp_path: Path) -> None:
    """The launcher's message is the server's last error line and the log's path."""
    proc = ServerProcess(
        [sys.executable, "-c", "raise SystemExit('ValueError: the model is broken')"],
        "http://127.0.0.1:9",
        log_path=tmp_path / "x.log",
    )
    with pytest.raises(Unavailable, match=r"ValueError: the model is broken \(its log: "):
        run(lambda: proc.wait_ready(30))
    proc.stop()


def test_a_vllm_reload_that_fails_on_the_server_takes_the_engine_out_of_service(
    new_weights: tuple[Path, Any],
) -> None:
    """Real vLLM 0.32's engine dies when an in-place reload fails (tests/test_vllm_real.py):
    the adapter reports WEIGHT_UPDATE_FAILED and stops serving from that server."""
    path, _ = new_weights
    with FakeEngineServer("vllm") as fake:

        async def body(engine: HTTPEngine) -> None:
            fake.fail("/collective_rpc", 500, "FAKE worker failed")
            with pytest.raises(FailedPrecondition) as err:
                await engine.swap_weights({"p": 1}, {"p": WeightsDir(path)})
            assert err.value.reason == "WEIGHT_UPDATE_FAILED"
            assert not engine.healthy and "FAKE worker failed" in str(engine.failure)
            with pytest.raises(Unavailable) as gone:
                await engine.swap_weights({"p": 1}, {"p": WeightsDir(path)})
            assert gone.value.reason == "ENGINE_FAILED"

        run(lambda: with_engine(fake, body))
