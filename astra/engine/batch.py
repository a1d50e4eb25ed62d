"""`Sequence` (one generate call's state) and `Batch` (sequences sharing one model and KV cache).

A `Batch` is one policy at one model object: its sequences occupy KV-cache
rows 0..n-1 in list order; `prefill` appends new ones, `decode` moves every
row one token forward, `remove` refills a freed row with the last one.
Every token a batch samples is stamped with `Batch.version` at that step.
Used only from the engine's worker thread; knows nothing of asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from astra.engine.api import FinishReason, Generation, Sampling, Tokenizer
from astra.engine.model import CausalLM
from astra.engine.sampler import sample

LOGPROB_CONVENTION = (
    "logprobs: log_softmax(logits / temperature) over the full vocabulary at the sampled "
    "token, before top-k/top-p (temperature 0 counts as 1); meta.sampling_logprobs: "
    "under the top-k/top-p-cut distribution actually sampled from (0.0 for greedy)"
)


@dataclass(eq=False)
class Sequence:
    """One request: its settings, what it has produced, and how to hand back the result."""

    policy: str
    prompt: list[int]
    sampling: Sampling
    seed: int
    tokenizer: Tokenizer
    stop_ids: frozenset[int]
    deliver: Callable[[Generation | BaseException], None]
    generator: torch.Generator | None = None
    on_token: Callable[[int], None] | None = None  # told each token as it is sampled
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    pos: int = 0  # cache positions filled; the last token is not in the cache yet
    cancelled: bool = False  # set by the caller's thread, read by the worker
    done: bool = False
    stop: str | int | None = None
    text_end: int | None = None  # end of a matched stop string in the decoded text
    _searched: int = 0  # decoded characters already searched for stop strings

    def add(
        self, token: int, logprob: float, sampling_logprob: float, version: int
    ) -> FinishReason | None:
        """Records one sampled token; returns a finish reason once the sequence is complete."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.sampling_logprobs.append(sampling_logprob)
        self.versions.append(version)
        if self.on_token is not None:
            self.on_token(token)
        if token in self.stop_ids:
            self.stop = token
            return "stop"
        if self.sampling.stop_strings and self._stop_string_hit():
            return "stop"
        return "length" if len(self.tokens) >= self.sampling.max_new_tokens else None

    def text(self) -> str:
        """The generated text; ids the tokenizer cannot decode (a model vocabulary padded past
        the tokenizer's) are left out rather than failing the request."""
        try:
            return self.tokenizer.decode(self.tokens)
        except (ValueError, IndexError, KeyError, TypeError, OverflowError):
            return self.tokenizer.decode([t for t in self.tokens if t < self.tokenizer.vocab_size])

    def _stop_string_hit(self) -> bool:
        text = self.text()
        longest = max(len(s) for s in self.sampling.stop_strings)
        start = max(0, self._searched - longest + 1)
        # Not past a trailing U+FFFD: a multi-byte character split across tokens decodes as
        # U+FFFD until its last byte arrives, which completes it without growing the text.
        self._searched = len(text.rstrip("\ufffd"))
        hits = [(text.find(s, start), s) for s in self.sampling.stop_strings]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, self.stop = min(hits)
        self.text_end = index + len(self.stop)
        return True

    def result(self, reason: FinishReason) -> Generation:
        text = self.text()
        meta = {
            "policy_id": self.policy,
            "seed": self.seed,
            "prompt_tokens": len(self.prompt),
            "logprob_convention": LOGPROB_CONVENTION,
            "sampling_logprobs": list(self.sampling_logprobs),
        }
        if self.stop is not None:
            meta["stop"] = self.stop
        return Generation(
            token_ids=list(self.tokens),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=reason,
            text=text if self.text_end is None else text[: self.text_end],
            meta=meta,
        )


class Batch:
    """Running sequences of one policy on one model object, with their KV cache."""

    def __init__(self, policy: str, model: CausalLM, version: int, max_prefill_tokens: int):
        self.policy, self.model, self.version = policy, model, version
        self.max_prefill_tokens = max_prefill_tokens
        self.cache = model.new_cache()
        self.seqs: list[Sequence] = []
        self.retired = False  # finish_old: no new sequences join

    def _sample(
        self, seqs: list[Sequence], logits_BV: torch.Tensor
    ) -> list[tuple[Sequence, FinishReason]]:
        draws = sample(logits_BV, [s.sampling for s in seqs], [s.generator for s in seqs])
        finished = []
        for i, seq in enumerate(seqs):
            lp, cut_lp = draws.logprobs[i], draws.sampling_logprobs[i]
            reason = seq.add(draws.tokens[i], lp, cut_lp, self.version)
            if reason is not None:
                finished.append((seq, reason))
        return finished

    def _chunks(self, new: list[Sequence]) -> Iterable[list[Sequence]]:
        """Groups prompts of similar length so padding stays within max_prefill_tokens."""
        chunk: list[Sequence] = []
        for seq in sorted(new, key=lambda s: len(s.prompt)):
            if chunk and (len(chunk) + 1) * len(seq.prompt) > self.max_prefill_tokens:
                yield chunk
                chunk = []
            chunk.append(seq)
        if chunk:
            yield chunk

    def prefill(self, new: list[Sequence]) -> list[tuple[Sequence, FinishReason]]:
        """Adds sequences: writes their prompts into the cache and samples their first tokens."""
        finished = []
        dev = self.model.device
        for chunk in self._chunks(new):
            lengths = [len(s.prompt) for s in chunk]
            ids_BT = torch.zeros((len(chunk), max(lengths)), dtype=torch.long)
            for row, seq in enumerate(chunk):
                ids_BT[row, : lengths[row]] = torch.tensor(seq.prompt)
            last_B = torch.tensor(lengths, device=dev) - 1
            logits_BV = self.model.prefill(ids_BT.to(dev), last_B, self.cache, len(self.seqs))
            self.seqs.extend(chunk)
            for seq in chunk:
                seq.pos = len(seq.prompt)
            finished += self._sample(chunk, logits_BV)
        return finished

    def decode(self) -> list[tuple[Sequence, FinishReason]]:
        """One token for every running sequence."""
        dev = self.model.device
        ids_B = torch.tensor([s.tokens[-1] for s in self.seqs], device=dev)
        pos_B = torch.tensor([s.pos for s in self.seqs], device=dev)
        logits_BV = self.model.decode(ids_B, pos_B, self.cache)
        for seq in self.seqs:
            seq.pos += 1
        return self._sample(self.seqs, logits_BV)

    def remove(self, doomed: set[Sequence]) -> None:
        """Drops sequences, moving the last row into each freed one to keep rows compact."""
        i = 0
        while i < len(self.seqs):
            if self.seqs[i] not in doomed:
                i += 1
                continue
            last = self.seqs.pop()
            if i < len(self.seqs):
                self.cache.move(len(self.seqs), i, last.pos)
                self.seqs[i] = last
