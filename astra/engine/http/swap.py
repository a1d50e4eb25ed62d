"""`WeightSwaps`: how an HTTP engine (astra.engine.http.base) swaps its server's weights.

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

A live swap (`_live` says when; VLLMEngine with Astra's worker extension,
astra.engine.http.vllm_live) does not pause: stage as above -> close the
admission gate (new requests wait; the ones running go on) -> one call
(`_commit_live`) that copies the new weights in place between two engine steps
and says, for each request in flight, how many tokens it had sampled at that
instant -> relabel -> open the gate. A running request keeps its KV and
continues on the new weights (the built-in engine's `continue`): its tokens up
to the split carry the old version, the rest the new one, with no
resubmission; one the server had not started is all new, one it had finished
is all old (`token_versions`). `swap_pause_s` counts the gate-closed span.

This mixin holds the swap's state (the gate, the segments in flight and their
version marks, the swap and load counters) and its two sequences; the engine
sends the segments through that state (`HTTPEngine._run_segment`) and a
subclass provides the server's steps (`_stage`, `_pause`, `_load_from_disk`,
`_resume`, `_live`, `_commit_live`). No HTTP here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Literal

from astra.engine.http.weights_dir import SwapClock
from astra.errors import AstraError, FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

OnSwap = Literal["continue", "finish_old"]


class WeightSwaps:
    """The swap half of HTTPEngine (see the module docstring)."""

    # the engine's: its name, whether it can load weights, its policy, label and failure
    name: str
    swappable: bool
    _policy_id: str
    _version: int
    _failed: str | None

    def _init_swaps(self, on_swap: OnSwap, drain_timeout_s: float) -> None:
        if on_swap not in ("continue", "finish_old"):
            raise ValueError(f"on_swap must be 'continue' or 'finish_old', not {on_swap!r}")
        self.on_swap: OnSwap = on_swap
        self.drain_timeout_s = drain_timeout_s
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
        # Generation stood still for swaps (admission gate closed to gate open), in all;
        # the phases of the latest swap, seconds each (see SwapClock).
        self.swap_pause_s = 0.0
        self.last_swap: dict[str, float] = {}

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

    # -- what a swappable subclass provides ------------------------------------------------

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


def token_versions(starts: list[tuple[int, int]], n: int) -> list[int]:
    """The version of each of `n` tokens from (first token index, version) marks in order:
    a token takes the version of the last mark at or before it."""
    out = [starts[0][1]] * n
    for first, version in starts[1:]:
        out[min(first, n) :] = [version] * (n - min(first, n))
    return out
