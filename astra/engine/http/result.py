"""`Segment`, one server answer, and the `Generation` a request's segments make.

An HTTP engine (astra.engine.http.base) asks the server for a continuation in
one or more segments (a swap that aborts a request resubmits it); this module
turns what came back into the built-in engine's result: the finish reason, the
stops the server was not told about or could not see (stop token ids with
extensions off, stop strings that straddle a resubmission), the stopping token
kept, and the text. Plain functions of the tokens and the policy's tokenizer:
no HTTP, no swap state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from astra.engine.api import FinishReason, Generation, Sampling, Tokenizer


@dataclass(slots=True)
class Segment:
    """One server answer: new tokens, their log-probs, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish: str  # "stop", "length", "abort", or the server's own word
    stop: str | int | None = None  # the matched stop string or token id (None: unknown/eos)
    meta: dict[str, Any] = field(default_factory=dict)


def decode(tok: Tokenizer, ids: list[int]) -> str:
    """`ids` as text; ids outside the vocabulary are left out rather than fail."""
    try:
        return tok.decode(ids)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError):
        return tok.decode([t for t in ids if 0 <= t < tok.vocab_size])


def assemble(
    tok: Tokenizer,
    tokens: list[int],
    logprobs: list[float],
    versions: list[int],
    last: Segment,
    sampling: Sampling,
    meta: dict[str, Any],
) -> Generation:
    """The Generation of a request whose segments gave `tokens` (`last` ended it)."""
    finish: FinishReason
    stop = last.stop
    if last.finish == "stop":
        finish = "stop"
        if stop is None and tokens:
            stop = tokens[-1]  # an eos the server did not name
    elif last.finish == "length" or len(tokens) >= sampling.max_new_tokens:
        finish = "length"
    elif last.finish == "abort":
        finish = "aborted"
    else:
        finish = "error"
        meta["error"] = f"server finish reason {last.finish!r}"
    # Client-side stops: ids the server was not told about, and strings that straddle
    # a resubmission boundary. The stopping token is kept, as in the built-in engine.
    cut = client_stop(tok, tokens, sampling, meta["segments"] > 1 or finish != "stop")
    if cut is not None:
        end, stop = cut
        tokens, logprobs, versions = tokens[:end], logprobs[:end], versions[:end]
        finish = "stop"
    text = decode(tok, tokens)
    if isinstance(stop, str) and finish == "stop":
        at = text.find(stop)
        if at >= 0:
            text = text[: at + len(stop)]
    if stop is not None and finish == "stop":
        meta["stop"] = stop
    return Generation(
        token_ids=tokens,
        logprobs=logprobs,
        versions=versions,
        finish_reason=finish,
        text=text,
        meta=meta,
    )


def client_stop(
    tok: Tokenizer, tokens: list[int], sampling: Sampling, search_strings: bool
) -> tuple[int, str | int] | None:
    """(tokens to keep, what matched) for the earliest stop id or stop string, if any."""
    best: tuple[int, str | int] | None = None
    ids = set(sampling.stop_token_ids)
    for i, t in enumerate(tokens):
        if t in ids:
            best = (i + 1, t)
            break
    if search_strings and sampling.stop_strings:
        limit = best[0] if best else len(tokens)
        text = decode(tok, tokens[:limit])
        hits = [(text.find(s), s) for s in sampling.stop_strings if s in text]
        if hits:
            # smallest prefix whose text holds a stop string (text grows with the prefix)
            lo, hi = 1, limit
            while lo < hi:
                mid = (lo + hi) // 2
                sub = decode(tok, tokens[:mid])
                if any(s in sub for s in sampling.stop_strings):
                    hi = mid
                else:
                    lo = mid + 1
            sub = decode(tok, tokens[:lo])
            matched = min((sub.find(s), s) for s in sampling.stop_strings if s in sub)[1]
            best = (lo, matched)
    return best
