"""`HTTPEngine`: the api.InferenceEngine shared by every adapter to an engine server over HTTP.

One adapter serves one policy from one server (one model). A subclass says how
to ask the server for one continuation (`_segment_request`) and how to read
its answer (`_parse_segment`); swappable engines also say how to pause, load a
checkpoint directory and resume (`_pause`, `_load_from_disk`, `_resume`).

Weight versions per token. The adapter keeps the version label itself and
runs a swap as: stage the checkpoint where the server can (`_stage`, while
generation goes on) -> close the admission gate (new requests wait) -> pause the
server, which aborts the requests it is running (partial output comes back)
-> wait for in-flight requests to return (bounded by `drain_timeout_s`) ->
load the new checkpoint -> relabel -> resume -> open the gate. A request the
swap aborted is resubmitted as prompt + tokens so far, with the remaining
budget, and continues on the new weights; each segment's tokens carry the
version they were produced by. With `on_swap="finish_old"` in-flight requests
are first allowed to finish (bounded by `drain_timeout_s`) before the pause.
A request still in flight after the drain reached the server after the pause,
so it runs after the load and is labelled with the new version. Not exact
only if an aborted answer takes longer than `drain_timeout_s` to come back.
Resubmission draws fresh randomness: a seeded request that straddles a swap
is not reproducible (nor is it in the built-in engine).

A live swap (`_live` says when; VLLMEngine with Astra's worker extension) does
not pause: stage as above -> close the admission gate (new requests wait; the
ones running go on) -> one call (`_commit_live`) that copies the new weights in
place between two engine steps and says, for each request in flight, how many
tokens it had sampled at that instant -> relabel -> open the gate. A running
request keeps its KV and continues on the new weights (the built-in engine's
`continue`): its tokens up to the split carry the old version, the rest the new
one, with no resubmission; one the server had not started is all new, one it
had finished is all old. `swap_pause_s` counts the gate-closed span.

Weights for a swap arrive as a `WeightsDir` (a verified local Hugging Face
directory, readable by the server's host) in `state[policy]`; a plain tensor
mapping is refused (FailedPrecondition NEEDS_WEIGHTS_DIR). A policy in
`versions` but not in `state` is relabelled only, as in the built-in engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from astra.engine.api import FinishReason, Generation, Sampling, Tokenizer
from astra.engine.http.client import engine_client
from astra.engine.http.launch import ServerProcess
from astra.engine.http.weights_dir import SwapClock, WeightsDir
from astra.engine.validate import check_request
from astra.errors import AstraError, FailedPrecondition, Unavailable, invalid_field

log = logging.getLogger(__name__)

OnSwap = Literal["continue", "finish_old"]
NO_LIMIT = 2**31 - 1


@dataclass(slots=True)
class Segment:
    """One server answer: new tokens, their log-probs, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish: str  # "stop", "length", "abort", or the server's own word
    stop: str | int | None = None  # the matched stop string or token id (None: unknown/eos)
    meta: dict[str, Any] = field(default_factory=dict)


class HTTPEngine:
    """Base of the HTTP adapters (see the module docstring); one policy per instance."""

    name = "http"
    swappable = False
    # What `Generation.logprobs` means for this server; subclasses state it exactly.
    logprob_convention = "as reported by the server"

    def __init__(
        self,
        base_url: str,
        policy_id: str,
        tokenizer: Tokenizer,
        *,
        version: int = 0,
        api_key: str | None = None,
        max_seq_len: int | None = None,
        max_running: int = 256,
        request_timeout_s: float = 600.0,
        on_swap: OnSwap = "continue",
        drain_timeout_s: float = 10.0,
        process: ServerProcess | None = None,
    ) -> None:
        if on_swap not in ("continue", "finish_old"):
            raise ValueError(f"on_swap must be 'continue' or 'finish_old', not {on_swap!r}")
        self.client = engine_client(
            base_url, api_key=api_key, request_timeout_s=request_timeout_s, max_running=max_running
        )
        self.policy_ids = (policy_id,)
        self._policy_id = policy_id
        self._tok = tokenizer
        self._version = int(version)
        self._max_seq_len = max_seq_len
        self._max_running = max_running
        self.on_swap: OnSwap = on_swap
        self.drain_timeout_s = drain_timeout_s
        self.process = process
        self._running = 0  # generate calls in progress
        self._waiting = 0  # segments held at the gate during a swap
        self._in_flight: set[asyncio.Future[None]] = set()  # segments sent, not answered
        # Per segment in flight: (first token index, version) from each swap it straddled.
        self._flights: dict[str, list[tuple[int, int]]] = {}
        self._committed = asyncio.Event()  # clear while a live commit's split is unknown
        self._committed.set()
        self._gate = asyncio.Event()
        self._gate.set()
        self._swap_lock = asyncio.Lock()
        self._swap_seq = 0  # swaps begun
        self._load_seq = 0  # loads begun (after the drain)
        self._failed: str | None = None
        self._closed = False
        # Generation stood still for swaps (admission gate closed to gate open), in all;
        # the phases of the latest swap, seconds each (see SwapClock).
        self.swap_pause_s = 0.0
        self.last_swap: dict[str, float] = {}

    # -- api.InferenceEngine ---------------------------------------------------------

    def _policy(self, policy_id: str, field_name: str = "policy_id") -> str:
        if policy_id != self._policy_id:
            raise invalid_field(
                field_name, f"unknown policy {policy_id!r}", reason="UNKNOWN_POLICY"
            )
        return policy_id

    def tokenizer(self, policy_id: str) -> Tokenizer:
        self._policy(policy_id)
        return self._tok

    def version(self, policy_id: str) -> int:
        self._policy(policy_id)
        return self._version

    def max_seq_len(self, policy_id: str) -> int:
        self._policy(policy_id)
        return self._max_seq_len or NO_LIMIT

    def stats(self) -> dict[str, int]:
        """running, waiting, max_batch, free_slots, as the built-in engine reports them."""
        return {
            "running": self._running,
            "waiting": self._waiting,
            "max_batch": self._max_running,
            "free_slots": max(0, self._max_running - self._running),
        }

    @property
    def failure(self) -> str | None:
        """Why this engine stopped serving (a failed resume or reload), or None."""
        return self._failed

    @property
    def healthy(self) -> bool:
        if self._failed is not None or self._closed:
            return False
        return self.process is None or self.process.alive

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Waits for a launched server to answer (an attached one is checked once), then
        takes the context length from `GET /v1/models` (`max_model_len`) unless one was given."""
        if self.process is not None:
            await self.process.wait_ready(timeout_s)
        else:
            await self._probe()
        if self._max_seq_len is None:
            try:
                models = await self.client.request("GET", "/v1/models", timeout_s=10.0)
                found = models["data"][0]["max_model_len"]
                self._max_seq_len = int(found)
            except (AstraError, KeyError, IndexError, TypeError, ValueError):
                log.info(
                    "%s: no max_model_len from /v1/models; the server checks lengths", self.name
                )

    async def _probe(self) -> None:
        await self.client.request("GET", "/health", expect_json=False, timeout_s=10.0)

    async def generate(
        self, policy_id: str, prompt_ids: list[int], sampling: Sampling
    ) -> Generation:
        """Samples one continuation through the server; bad input -> InvalidArgument naming
        the field; an unreachable or failing server -> Unavailable."""
        self._policy(policy_id)
        check_request(
            prompt_ids,
            sampling,
            vocab_size=self._tok.vocab_size,
            max_seq_len=self._max_seq_len or NO_LIMIT,
        )
        self._check_sampling(sampling)
        if self._closed:
            raise Unavailable(f"{self.name} engine is closed", reason="ENGINE_CLOSED")
        prompt = [int(t) for t in prompt_ids]
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        meta: dict[str, Any] = {
            "policy_id": policy_id,
            "engine": self.name,
            "prompt_tokens": len(prompt),
            "logprob_convention": self.logprob_convention,
            "segments": 0,
        }
        if sampling.seed is not None:
            meta["seed"] = sampling.seed
        self._running += 1
        try:
            while True:
                remaining = sampling.max_new_tokens - len(tokens)
                seg, labels, preempted = await self._run_segment(
                    prompt + tokens, sampling, remaining
                )
                tokens += seg.token_ids
                logprobs += seg.logprobs
                versions += labels
                meta["segments"] += 1
                meta.update(seg.meta)
                if seg.finish == "abort" and preempted and len(tokens) < sampling.max_new_tokens:
                    continue  # our own swap cut it short: carry on with the new weights
                break
        finally:
            self._running -= 1
        return self._result(tokens, logprobs, versions, seg, sampling, meta)

    async def swap_weights(
        self, versions: Mapping[str, int], state: Mapping[str, Mapping[str, object]]
    ) -> None:
        """Installs `state[policy]` (a WeightsDir) as `versions[policy]`; see the module docstring."""
        for policy in (*versions, *state):
            self._policy(policy, "versions")
        if any(not isinstance(v, int) or isinstance(v, bool) for v in versions.values()):
            raise invalid_field("versions", "versions must be integers")
        if set(state) - set(versions):
            raise invalid_field("state", "names a policy without a version", reason="NO_VERSION")
        if self._policy_id not in versions:
            return
        new_version = int(versions[self._policy_id])
        weights = state.get(self._policy_id)
        if weights is None:
            self._version = new_version  # relabel only
            return
        await self._install(new_version, weights)

    async def _install(self, version: int, weights: Mapping[str, object]) -> None:
        """Swaps to `weights` as `version`; an engine that takes other kinds overrides it."""
        if not isinstance(weights, WeightsDir):
            raise FailedPrecondition(
                f"{self.name} engine for policy {self._policy_id!r} loads weights from a local "
                "checkpoint directory: pass astra.engine.http.WeightsDir(path) as state[policy]",
                reason="NEEDS_WEIGHTS_DIR",
            )
        await self._swap_from_disk(version, weights.path)

    async def close(self) -> None:
        """Stops a launched server (requests in flight fail Unavailable); releases threads."""
        self._closed = True
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
        await self.client.close()

    # -- segments and swaps ------------------------------------------------------------

    async def _run_segment(
        self, context: list[int], sampling: Sampling, max_new: int
    ) -> tuple[Segment, list[int], bool]:
        """One request to the server; returns (segment, each token's version, aborted by
        our swap)."""
        if not self._gate.is_set():
            self._waiting += 1
            try:
                await self._gate.wait()
            finally:
                self._waiting -= 1
        swap_seq, load_seq, version = self._swap_seq, self._load_seq, self._version
        marker: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._in_flight.add(marker)
        rid = f"astra-{uuid.uuid4().hex}"
        starts = self._flights[rid] = [(0, version)]
        try:
            path, body = self._segment_request(context, sampling, max_new, rid)
            try:
                answer = await self.client.request("POST", path, body)
            except asyncio.CancelledError:
                await self._cancel_request(rid)
                raise
            except AstraError:
                if self._swap_seq != swap_seq:  # cut off by our own pause: retry after it
                    return Segment([], [], "abort"), [], True
                raise
            seg = self._parse_segment(answer, sampling)
            await self._committed.wait()  # a live commit under way says where we split
        finally:
            self._flights.pop(rid, None)
            self._in_flight.discard(marker)
            if not marker.done():
                marker.set_result(None)
        if self._load_seq != load_seq:  # still running when the load began: new weights
            starts = [(0, self._version)]
        return seg, token_versions(starts, len(seg.token_ids)), self._swap_seq != swap_seq

    async def _drain(self, timeout_s: float) -> int:
        """Waits for the segments in flight now; returns how many are still out after timeout."""
        pending = set(self._in_flight)
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s)
            return len(still)
        return 0

    async def _swap_from_disk(self, version: int, path: Path) -> None:
        if not self.swappable:
            raise FailedPrecondition(
                f"{self.name} engine cannot load weights for policy {self._policy_id!r}",
                reason="SWAP_UNSUPPORTED",
            )
        if self._failed is not None:
            raise Unavailable(f"{self.name} engine failed: {self._failed}", reason="ENGINE_FAILED")
        if not path.is_dir():
            raise FailedPrecondition(
                f"weights directory {path} does not exist", reason="NO_WEIGHTS"
            )
        async with self._swap_lock:
            if self.on_swap == "continue" and self._live(path):
                await self._swap_live(path, version)
                return
            clock = SwapClock()
            await self._stage(path, version)  # generation goes on meanwhile
            clock.mark("stage")
            self._gate.clear()
            closed = time.perf_counter()
            try:
                if self.on_swap == "finish_old":
                    await self._drain(self.drain_timeout_s)
                    clock.mark("finish_old")
                self._swap_seq += 1
                await self._pause()
                clock.mark("pause")
                try:
                    late = await self._drain(self.drain_timeout_s)
                    if late:
                        log.info("%d requests still in flight after the pause", late)
                    clock.mark("drain")
                    self._load_seq += 1
                    await self._load_from_disk(path, version)
                    clock.mark("load")
                    self._version = version
                finally:
                    await self._resume_or_fail()
                    clock.mark("resume")
            finally:
                self._gate.set()
                self.swap_pause_s += time.perf_counter() - closed
                self.last_swap = clock.phases
                log.debug("swap to version %d: %s", version, clock.phases)

    async def _swap_live(self, path: Path, version: int) -> None:
        """The live swap (module docstring): generation stops only for `_commit_live`."""
        clock = SwapClock()
        await self._stage(path, version)  # generation goes on meanwhile
        clock.mark("stage")
        self._gate.clear()
        self._committed.clear()
        closed = time.perf_counter()
        try:
            flights = dict(self._flights)
            splits = await self._commit_live(path, version, list(flights))
            for rid, starts in flights.items():
                starts.append((splits.get(rid, 0), version))
            self._version = version
            clock.mark("commit")
        finally:
            self._committed.set()
            self._gate.set()
            self.swap_pause_s += time.perf_counter() - closed
            self.last_swap = clock.phases
            log.debug("live swap to version %d: %s", version, clock.phases)

    async def _resume_or_fail(self) -> None:
        try:
            await self._resume()
        except AstraError as exc:
            self._failed = f"could not resume generation after a swap: {exc}"
            raise

    async def _cancel_request(self, rid: str) -> None:
        """Best effort: tells the server to drop request `rid` (the socket is closed anyway)."""

    # -- what a subclass provides --------------------------------------------------------

    def _check_sampling(self, sampling: Sampling) -> None:
        """Raises InvalidArgument for settings this server cannot honour."""

    def _segment_request(
        self, context: list[int], sampling: Sampling, max_new: int, rid: str
    ) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _parse_segment(self, answer: Any, sampling: Sampling) -> Segment:
        raise NotImplementedError

    async def _stage(self, path: Path, version: int) -> None:
        """Prepares loading `path` while generation goes on (before the gate closes); a
        failure here leaves the version and the server as they were. Default: nothing."""

    def _live(self, path: Path) -> bool:
        """Whether loading `path` takes the live swap (no pause). Default: never."""
        return False

    async def _commit_live(self, path: Path, version: int, rids: list[str]) -> dict[str, int]:
        """Loads `path` in place between two engine steps; returns, for each of the segments
        `rids` the server had seen, how many tokens it had sampled then (absent: none)."""
        raise NotImplementedError

    async def _pause(self) -> None:
        raise NotImplementedError

    async def _load_from_disk(self, path: Path, version: int) -> None:
        raise NotImplementedError

    async def _resume(self) -> None:
        raise NotImplementedError

    # -- results ---------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        try:
            return self._tok.decode(ids)
        except (ValueError, IndexError, KeyError, TypeError, OverflowError):
            return self._tok.decode([t for t in ids if 0 <= t < self._tok.vocab_size])

    def _result(
        self,
        tokens: list[int],
        logprobs: list[float],
        versions: list[int],
        last: Segment,
        sampling: Sampling,
        meta: dict[str, Any],
    ) -> Generation:
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
        cut = self._client_stop(tokens, sampling, meta["segments"] > 1 or finish != "stop")
        if cut is not None:
            end, stop = cut
            tokens, logprobs, versions = tokens[:end], logprobs[:end], versions[:end]
            finish = "stop"
        text = self._decode(tokens)
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

    def _client_stop(
        self, tokens: list[int], sampling: Sampling, search_strings: bool
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
            text = self._decode(tokens[:limit])
            hits = [(text.find(s), s) for s in sampling.stop_strings if s in text]
            if hits:
                # smallest prefix whose text holds a stop string (text grows with the prefix)
                lo, hi = 1, limit
                while lo < hi:
                    mid = (lo + hi) // 2
                    sub = self._decode(tokens[:mid])
                    if any(s in sub for s in sampling.stop_strings):
                        hi = mid
                    else:
                        lo = mid + 1
                sub = self._decode(tokens[:lo])
                matched = min((sub.find(s), s) for s in sampling.stop_strings if s in sub)[1]
                best = (lo, matched)
        return best


def token_versions(starts: list[tuple[int, int]], n: int) -> list[int]:
    """The version of each of `n` tokens from (first token index, version) marks in order:
    a token takes the version of the last mark at or before it."""
    out = [starts[0][1]] * n
    for first, version in starts[1:]:
        out[min(first, n) :] = [version] * (n - min(first, n))
    return out
