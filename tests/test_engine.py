"""The built-in torch engine: log-probs vs a full forward, continuous batching, seeds, stops,
cancellation, weight swaps, and the tiny model's files.

Tolerance: fp32 on CPU; cached decoding and the no-cache forward differ by ~1e-5 in logits,
so log-probs are compared at 1e-4 (absolute).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from astra.engine.api import Generation, Sampling  # noqa: E402
from astra.engine.batch import Sequence  # noqa: E402
from astra.engine.model import CausalLM  # noqa: E402
from astra.engine.tiny import TINY_CONFIG, load_model, random_model, tiny_model  # noqa: E402
from astra.engine.tokenizer import CharTokenizer  # noqa: E402
from astra.engine.torch_engine import TorchEngine  # noqa: E402
from astra.errors import InvalidArgument, Unavailable  # noqa: E402

TOL = 1e-4
PROMPTS = ["Hello", "2+3=", "The cat sat on", "x", "Once upon a time, there", "abc abc"]
TOK = CharTokenizer()


def run(fn: Callable[[TorchEngine], Awaitable[Any]], timeout: float = 30.0, **kw: Any) -> Any:
    """Runs fn(engine) on a fresh tiny engine inside asyncio.run, bounded, closing the engine."""

    async def main() -> Any:
        model, tok = load_model("tiny")
        engine = TorchEngine({"p": (model, tok)}, **kw)
        try:
            return await asyncio.wait_for(fn(engine), timeout)
        finally:
            await engine.close()

    return asyncio.run(main())


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.001)


def reference_logits(model: CausalLM, prompt: list[int], gen: Generation) -> torch.Tensor:
    """No-cache logits [n, V] that predicted each generated token."""
    ids = torch.tensor([prompt + gen.token_ids[:-1]])
    with torch.no_grad():
        return model.forward_full(ids)[0, len(prompt) - 1 :]


def test_logprobs_match_full_forward_greedy_and_sampled() -> None:
    settings = [
        Sampling(max_new_tokens=40, temperature=0.0),
        Sampling(max_new_tokens=40, temperature=0.7, seed=1),
        Sampling(max_new_tokens=40, temperature=1.3, top_k=5, top_p=0.9, seed=2),
    ]
    jobs = [(p, s) for p in PROMPTS for s in settings]

    async def go(engine: TorchEngine) -> list[Generation]:
        return await asyncio.gather(
            *(engine.generate("p", TOK.encode(p), s) for p, s in jobs)  # batched together
        )

    gens = run(go, max_batch=8)
    model = tiny_model()
    for (prompt, s), gen in zip(jobs, gens, strict=True):
        logits = reference_logits(model, TOK.encode(prompt), gen)
        tokens = torch.tensor(gen.token_ids)
        ref_lp = torch.log_softmax(logits / (s.temperature or 1.0), -1)
        got = torch.tensor(gen.logprobs)
        assert torch.allclose(got, ref_lp.gather(1, tokens[:, None])[:, 0], atol=TOL)
        assert gen.versions == [0] * len(gen.token_ids)
        assert "before top-k/top-p" in gen.meta["logprob_convention"]
        cut_lp = torch.tensor(gen.meta["sampling_logprobs"])
        if s.temperature == 0:  # KV-cache decoding equals no-cache decoding
            assert tokens.tolist() == logits.argmax(-1).tolist()
            assert cut_lp.abs().max() == 0
        elif s.top_k:  # the cut distribution: top-k of the tempered logits, then top-p
            kth = ref_lp.topk(s.top_k, -1).values[:, -1:]
            assert (ref_lp.gather(1, tokens[:, None]) >= kth).all()
            assert (cut_lp >= got - 1e-6).all() and (cut_lp <= 0).all()
        else:
            assert torch.allclose(cut_lp, got, atol=TOL)


def test_continuous_batching_matches_one_at_a_time() -> None:
    settings = [Sampling(max_new_tokens=10 + 7 * i, temperature=0.0) for i in range(3)] + [
        Sampling(max_new_tokens=12 + 5 * i, temperature=1.0, top_p=0.95, seed=i) for i in range(3)
    ]
    jobs = list(zip(PROMPTS, settings, strict=True))

    async def alone(engine: TorchEngine) -> list[Generation]:
        return [await engine.generate("p", TOK.encode(p), s) for p, s in jobs]

    async def together(engine: TorchEngine) -> list[Generation]:
        return await asyncio.gather(*(engine.generate("p", TOK.encode(p), s) for p, s in jobs))

    solo = run(alone)
    batched = run(together, max_batch=3)  # requests join as others finish
    for a, b in zip(solo, batched, strict=True):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason == "length"
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOL)


def test_seeds_reproduce() -> None:
    async def go(engine: TorchEngine) -> list[Generation]:
        prompt = TOK.encode("Seeds: ")
        same = [Sampling(max_new_tokens=32, temperature=1.0, seed=7) for _ in range(2)]
        other = Sampling(max_new_tokens=32, temperature=1.0, seed=8)
        unseeded = Sampling(max_new_tokens=32, temperature=1.0)
        gens = [await engine.generate("p", prompt, s) for s in (*same, other, unseeded)]
        replay = Sampling(max_new_tokens=32, temperature=1.0, seed=gens[-1].meta["seed"])
        return [*gens, await engine.generate("p", prompt, replay)]

    a, b, c, unseeded, replay = run(go)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids
    assert unseeded.token_ids == replay.token_ids


def test_stop_strings_ids_eos_and_length() -> None:
    prompt = TOK.encode("Stop here: ")
    base = Sampling(max_new_tokens=40, temperature=1.0, seed=3)

    async def go(engine: TorchEngine) -> dict[str, Generation]:
        full = await engine.generate("p", prompt, base)
        stop_id = full.token_ids[6]
        stop_str = full.text[8:10]
        out = {"full": full}
        out["id"] = await engine.generate(
            "p", prompt, Sampling(**{**_kw(base), "stop_token_ids": (stop_id,)})
        )
        out["str"] = await engine.generate(
            "p", prompt, Sampling(**{**_kw(base), "stop_strings": ("\x7f", stop_str)})
        )
        out["short"] = await engine.generate(
            "p", prompt, Sampling(**{**_kw(base), "max_new_tokens": 5})
        )
        return out

    out = run(go)
    full = out["full"]
    assert full.finish_reason == "length" and len(full.token_ids) == 40
    stop_id = full.token_ids[6]
    cut = full.token_ids.index(stop_id) + 1
    assert out["id"].finish_reason == "stop" and out["id"].token_ids == full.token_ids[:cut]
    assert out["id"].meta["stop"] == stop_id
    stop_str = full.text[8:10]
    end = full.text.index(stop_str) + len(stop_str)
    assert out["str"].finish_reason == "stop" and out["str"].text == full.text[:end]
    assert out["str"].meta["stop"] == stop_str
    assert out["str"].token_ids == full.token_ids[: len(out["str"].token_ids)]
    assert out["short"].finish_reason == "length" and out["short"].token_ids == full.token_ids[:5]

    class EosTokenizer(CharTokenizer):
        eos_id = stop_id  # the engine stops on the tokenizer's eos

    async def with_eos() -> Generation:
        engine = TorchEngine({"p": (tiny_model(), EosTokenizer())})
        try:
            return await asyncio.wait_for(engine.generate("p", prompt, base), 30)
        finally:
            await engine.close()

    eos = asyncio.run(with_eos())
    assert eos.finish_reason == "stop" and eos.token_ids == full.token_ids[:cut]


class ByteTokenizer:
    """GPT-2-style byte tokens over the tiny model's 100 ids: id i decodes to the byte
    `table[i]`; 2 is eos; an incomplete UTF-8 character decodes as U+FFFD."""

    eos_id = 2
    vocab_size = 100

    def __init__(self, table: dict[int, int]) -> None:
        self.table = table

    def encode(self, text: str) -> list[int]:
        return [4 + (ord(c) % 90) for c in text]

    def decode(self, ids: list[int]) -> str:
        return bytes(self.table[i] for i in ids if i != self.eos_id).decode(errors="replace")


def test_stop_string_ending_in_a_multibyte_character_split_across_tokens() -> None:
    """The completing byte turns a trailing U+FFFD into the character without growing the
    text; the stop string must still be found (it was missed: generation ran to "length")."""
    seq = Sequence(
        policy="p",
        prompt=[1],
        sampling=Sampling(max_new_tokens=10, stop_strings=("é",)),
        seed=0,
        tokenizer=ByteTokenizer({4: ord("a"), 5: 0xC3, 6: 0xA9}),
        stop_ids=frozenset({2}),
        deliver=lambda _: None,
    )
    assert [seq.add(t, -1.0, -1.0, 0) for t in (4, 5, 6)] == [None, None, "stop"]  # a, C3, A9
    assert seq.result("stop").text == "aé"

    prompt = [10, 11, 12, 13]
    base = Sampling(max_new_tokens=40, temperature=1.0, seed=3)

    def sampled(tok: ByteTokenizer, stops: tuple[str, ...] = ()) -> Generation:
        async def go() -> Generation:
            engine = TorchEngine({"p": (tiny_model(), tok)})
            try:
                s = Sampling(**{**_kw(base), "stop_strings": stops})
                return await asyncio.wait_for(engine.generate("p", prompt, s), 30)
            finally:
                await engine.close()

        return asyncio.run(go())

    plain = {i: ord("a") + i % 26 for i in range(100)}
    ids = sampled(ByteTokenizer(plain)).token_ids
    # two consecutive distinct ids new to the text; mapped to C3 A9 they decode to "é"
    k = next(
        k
        for k in range(3, len(ids) - 1)
        if ids[k] != ids[k + 1] and ids[k] not in ids[:k] and ids[k + 1] not in ids[: k + 1]
    )
    table = dict(plain) | {ids[k]: 0xC3, ids[k + 1]: 0xA9}
    tok = ByteTokenizer(table)
    assert "é" in tok.decode(ids)
    gen = sampled(tok, ("é",))
    assert gen.finish_reason == "stop" and gen.meta["stop"] == "é"
    assert gen.token_ids == ids[: k + 2] and gen.text.endswith("é")


def test_a_tiny_positive_temperature_is_refused() -> None:
    """logits / 1e-40 overflow float32: NaN log-probs and an arbitrary token were returned."""

    async def go(engine: TorchEngine) -> Generation:
        for t in (1e-40, 1e-5):
            with pytest.raises(InvalidArgument) as info:
                await engine.generate("p", TOK.encode("hello"), Sampling(5, temperature=t))
            assert info.value.field_violations[0][0] == "sampling.temperature"
        return await engine.generate("p", TOK.encode("hello"), Sampling(5, 1e-4, seed=1))

    gen = run(go)
    assert len(gen.token_ids) == 5 and all(math.isfinite(lp) for lp in gen.logprobs)


def _kw(s: Sampling) -> dict[str, Any]:
    return {k: getattr(s, k) for k in Sampling.__slots__}


SHORT = Sampling(max_new_tokens=20, temperature=1.0, seed=5)


def test_requests_join_while_others_run() -> None:
    async def go(engine: TorchEngine) -> tuple[Generation, Generation, bool]:
        long = asyncio.create_task(
            engine.generate("p", TOK.encode("long"), Sampling(max_new_tokens=1500, temperature=0))
        )
        await until(lambda: engine.stats()["running"] == 1)
        short = await engine.generate("p", TOK.encode("short"), SHORT)
        long_still_running = not long.done()
        return await long, short, long_still_running

    long, short, overlapped = run(go, max_batch=8)
    alone = run(lambda engine: engine.generate("p", TOK.encode("short"), SHORT))
    assert overlapped
    assert len(long.token_ids) == 1500 and short.token_ids == alone.token_ids


def test_cancel_frees_the_slot() -> None:
    async def go(engine: TorchEngine) -> Generation:
        slow = Sampling(max_new_tokens=2000, temperature=0)
        first = asyncio.create_task(engine.generate("p", TOK.encode("a"), slow))
        await until(lambda: engine.stats()["running"] == 1)
        queued = asyncio.create_task(engine.generate("p", TOK.encode("b"), slow))
        await until(lambda: engine.stats()["waiting"] == 1)
        assert engine.stats()["free_slots"] == 0
        queued.cancel()
        first.cancel()
        await asyncio.gather(first, queued, return_exceptions=True)
        assert engine.stats()["free_slots"] == 1  # at once, before the worker's next step
        quick = await engine.generate("p", TOK.encode("c"), Sampling(max_new_tokens=5))
        await until(lambda: engine.stats()["running"] == 0)
        return quick

    quick = run(go, max_batch=1, timeout=20)
    assert len(quick.token_ids) == 5


def _other_weights(seed: int = 1) -> dict[str, torch.Tensor]:
    return random_model(TINY_CONFIG, seed).hf_state_dict()


def test_swap_continue_switches_versions_mid_sequence_and_keeps_the_cache() -> None:
    prompt = TOK.encode("swap me")

    async def go(engine: TorchEngine) -> tuple[Generation, Generation]:
        task = asyncio.create_task(
            engine.generate("p", prompt, Sampling(max_new_tokens=1200, temperature=0))
        )
        await until(lambda: engine.stats()["running"] == 1)
        assert engine.swap_pause_s == 0.0
        await engine.swap_weights({"p": 1}, {"p": _other_weights()})
        assert engine.version("p") == 1
        # decoding stood still while the swap was installed: counted, and well under a second
        assert 0.0 < engine.swap_pause_s < 1.0
        after = await engine.generate("p", prompt, Sampling(max_new_tokens=30, temperature=0))
        return await task, after

    gen, after = run(go, on_swap="continue")
    k = gen.versions.index(1)
    assert 1 <= k < len(gen.versions) and gen.versions == [0] * k + [1] * (len(gen.versions) - k)
    old, new = tiny_model(), random_model(TINY_CONFIG, 1)
    with torch.no_grad():  # the old weights' cache up to the swap, then the new weights decode
        cache = old.new_cache()
        before = prompt + gen.token_ids[: k - 1]
        old.prefill(torch.tensor([before]), torch.tensor([len(before) - 1]), cache, 0)
        for i in range(k - 1, k + 20):
            pos = torch.tensor([len(prompt) + i])
            logits = new.decode(torch.tensor([gen.token_ids[i]]), pos, cache)
            assert int(logits.argmax()) == gen.token_ids[i + 1]
        ref = reference_logits(new, prompt, after).argmax(-1).tolist()
    assert after.versions == [1] * 30 and after.token_ids == ref


def test_swap_finish_old_keeps_running_sequences_on_old_weights() -> None:
    prompt = TOK.encode("old or new")
    greedy = Sampling(max_new_tokens=400, temperature=0)

    async def go(engine: TorchEngine) -> tuple[Generation, Generation]:
        task = asyncio.create_task(engine.generate("p", prompt, greedy))
        await until(lambda: engine.stats()["running"] == 1)
        await engine.swap_weights({"p": 1}, {"p": _other_weights()})
        after = await engine.generate("p", prompt, Sampling(max_new_tokens=30, temperature=0))
        assert not task.done()  # the old sequence ran alongside the new one
        return await task, after

    gen, after = run(go, on_swap="finish_old")
    assert gen.versions == [0] * 400
    with torch.no_grad():
        assert gen.token_ids == reference_logits(tiny_model(), prompt, gen).argmax(-1).tolist()
        new = random_model(TINY_CONFIG, 1)
        assert after.token_ids == reference_logits(new, prompt, after).argmax(-1).tolist()
    assert after.versions == [1] * 30


def test_swap_is_all_or_nothing_across_policies() -> None:
    async def go() -> tuple[list[int], list[int], Generation]:
        engine = TorchEngine({"a": load_model("tiny"), "b": load_model("tiny")})
        try:
            bad = _other_weights()
            bad["model.norm.weight"] = torch.ones(3)
            with pytest.raises(InvalidArgument):
                await engine.swap_weights({"a": 1, "b": 1}, {"a": _other_weights(), "b": bad})
            unchanged = [engine.version("a"), engine.version("b")]
            await engine.swap_weights({"a": 2, "b": 2}, {"a": _other_weights(), "b": {}})
            # seeded: an unseeded draw may sample eos before 5 tokens (seen once in CI)
            gen = await engine.generate("b", TOK.encode("b"), Sampling(max_new_tokens=5, seed=1))
            return unchanged, [engine.version("a"), engine.version("b")], gen
        finally:
            await engine.close()

    unchanged, swapped, gen = asyncio.run(asyncio.wait_for(go(), 30))
    assert unchanged == [0, 0] and swapped == [2, 2] and gen.versions == [2] * 5


def test_bad_requests_name_the_field() -> None:
    cases = [
        ("q", [5], Sampling(max_new_tokens=1), "policy_id"),
        ("p", [], Sampling(max_new_tokens=1), "prompt_ids"),
        ("p", [100], Sampling(max_new_tokens=1), "prompt_ids"),
        ("p", [5] * 2000, Sampling(max_new_tokens=100), "prompt_ids"),
        ("p", [5], Sampling(max_new_tokens=0), "sampling.max_new_tokens"),
        ("p", [5], Sampling(max_new_tokens=1, temperature=-1), "sampling.temperature"),
        ("p", [5], Sampling(max_new_tokens=1, top_p=0), "sampling.top_p"),
        ("p", [5], Sampling(max_new_tokens=1, top_k=-1), "sampling.top_k"),
        ("p", [5], Sampling(max_new_tokens=1, stop_token_ids=(999,)), "sampling.stop_token_ids"),
    ]

    async def go(engine: TorchEngine) -> list[str]:
        fields = []
        for policy, prompt, s, _ in cases:
            with pytest.raises(InvalidArgument) as info:
                await engine.generate(policy, prompt, s)
            fields.append(info.value.field_violations[0][0])
        return fields

    assert run(go) == [c[-1] for c in cases]


def test_close_aborts_running_requests_and_refuses_new_ones() -> None:
    async def go() -> tuple[Generation, type]:
        engine = TorchEngine({"p": load_model("tiny")})
        task = asyncio.create_task(
            engine.generate("p", TOK.encode("x"), Sampling(max_new_tokens=2000))
        )
        await until(lambda: engine.stats()["running"] == 1)
        await engine.close()
        gen = await task
        with pytest.raises(Unavailable) as info:
            await engine.generate("p", [5], Sampling(max_new_tokens=1))
        return gen, type(info.value)

    gen, _ = asyncio.run(asyncio.wait_for(go(), 30))
    assert gen.finish_reason == "aborted" and 0 < len(gen.token_ids) < 2000


DIGEST = """
import hashlib, torch
from astra.engine.tiny import tiny_model
h = hashlib.sha256()
for name, t in sorted(tiny_model().state_dict().items()):
    h.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
print(h.hexdigest())
"""


@pytest.mark.slow
def test_tiny_model_is_identical_across_builds_and_processes() -> None:
    a, b = tiny_model(), tiny_model()
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    digests = [
        subprocess.run([sys.executable, "-c", DIGEST], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    assert digests[0].stdout == digests[1].stdout and len(digests[0].stdout.strip()) == 64
    h = hashlib.sha256()
    for name, t in sorted(a.state_dict().items()):
        h.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    assert digests[0].stdout.strip() == h.hexdigest()
    assert TINY_CONFIG["vocab_size"] == CharTokenizer.vocab_size == 100


def test_a_failing_forward_fails_requests_and_marks_the_engine_unhealthy() -> None:
    async def go() -> None:
        model, tok = load_model("tiny")

        def lost(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("device lost")

        model.decode = lost  # type: ignore[method-assign]
        engine = TorchEngine({"p": (model, tok)})
        try:
            # Greedy on the seeded tiny model: the first token is not end-of-sequence, so the
            # request reaches a decode step (sampled, 1 run in ~100 ended after prefill).
            with pytest.raises(Unavailable) as info:
                await engine.generate("p", [5], Sampling(max_new_tokens=3, temperature=0.0))
            assert info.value.reason == "ENGINE_FAILED" and not engine.healthy
            with pytest.raises(Unavailable):
                await engine.generate("p", [5], Sampling(max_new_tokens=3))
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_a_failing_prefill_fails_the_requests_it_was_admitting() -> None:
    """Requests taken off the queue for a prefill that raises still get the engine's failure
    (they were once in neither the queue nor a batch, and their callers waited for ever)."""

    async def go() -> None:
        model, tok = load_model("tiny")

        def lost(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("device lost")

        model.prefill = lost  # type: ignore[method-assign]
        engine = TorchEngine({"p": (model, tok)})
        try:
            calls = [
                engine.generate("p", [5, i], Sampling(max_new_tokens=3, temperature=0.0))
                for i in range(3)
            ]
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
            assert all(isinstance(r, Unavailable) for r in results), results
            assert {r.reason for r in results} == {"ENGINE_FAILED"} and not engine.healthy
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(go(), 30))
