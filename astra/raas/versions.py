"""The policy versions one RaaS serves, and LoadWeights' rules over them.

`WeightVersions` holds the versions in service, runs one load at a time
through the backend, and answers retries by request id. Rules:
- A version is in service by counter AND identity; (0, "") is the weights the
  instance started with, none of the trainer's versions.
- A version older than the one in service is refused (VERSION_REGRESSION),
  before any fetch; asking for what is in service answers at once, without
  waiting behind a running load.
- Idempotent by request id: a retry gets the first answer (a failed load runs
  again); the same id for other versions is refused (REQUEST_ID_REUSED).
- A load ends within `timeout_s` (DEADLINE_EXCEEDED, versions unchanged); the
  whole set switches in one assignment, so a group sees all of it or none.
Plain Python: no gRPC, no protobuf; the servicer converts requests and answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from astra.errors import FailedPrecondition, Unavailable, invalid_field
from astra.raas.backend import RolloutBackend, VersionSpec
from astra.weights.deadline import DeadlineExceeded

log = logging.getLogger(__name__)

MAX_LOAD_REQUESTS = 256  # LoadWeights request ids remembered for retries


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A LoadWeights answer: the versions in service after it, and the bytes fetched."""

    versions: dict[str, VersionSpec]
    fetched_bytes: int


def differs(wanted: VersionSpec, held: VersionSpec) -> bool:
    """True unless `wanted` is in service: the same counter and the same identity."""
    return (wanted.version, wanted.version_id) != (held.version, held.version_id)


class WeightVersions:
    """The versions in service of `backend.policy_ids`; loads go through `backend`."""

    def __init__(
        self,
        backend: RolloutBackend,
        *,
        initial_versions: dict[str, int] | None,
        timeout_s: float,
        counters: Counter[str],
    ) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.counters = counters
        self.metrics: Any = None  # astra.raas.metrics.RaasMetrics when /metrics is served
        start = initial_versions if initial_versions is not None else {}
        self.held = {
            p: VersionSpec(start[p], str(start[p])) if p in start else VersionSpec(0, "")
            for p in backend.policy_ids
        }
        self.requests: dict[str, tuple[tuple, LoadResult]] = {}
        self._lock = asyncio.Lock()

    @property
    def numbers(self) -> dict[str, int]:
        return {p: v.version for p, v in self.held.items()}

    async def load(
        self, wanted: dict[str, VersionSpec], address: str, request_id: str
    ) -> LoadResult:
        """Brings `wanted` into service (see the module's rules)."""
        # What is loaded, not where from: a retry may name another address for the same set.
        asked = tuple(sorted((p, s.version, s.version_id) for p, s in wanted.items()))
        known = self.requests.get(request_id)
        if known is not None and known[0] != asked:
            raise invalid_field(
                "request_id",
                f"{request_id!r} was used for another load",
                reason="REQUEST_ID_REUSED",
            )
        if known is not None:
            return known[1]
        if any(s.version < self.held[p].version for p, s in wanted.items()):
            await self._load(wanted, address)  # raises the regression error
        if not any(differs(s, self.held[p]) for p, s in wanted.items()):
            return self._remember(request_id, asked, 0)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s) as limit:
                fetched = await self._load(wanted, address)
            if self.metrics is not None:
                self.metrics.observe_load(time.perf_counter() - started, fetched)
        except TimeoutError:
            if not limit.expired():
                raise
            self.counters["weight_load_timeouts"] += 1
            wanted_txt = {p: s.version for p, s in wanted.items()}
            log.warning(
                "load %s from %s timed out after %gs; serving %s",
                wanted_txt,
                address,
                self.timeout_s,
                self.numbers,
            )
            raise DeadlineExceeded(
                f"loading {wanted_txt} from {address} did not finish within "
                f"{self.timeout_s:g}s; serving {self.numbers} (a swap the engine "
                "had already begun still completes, and GetStatus then shows it)",
                reason="LOAD_DEADLINE_EXCEEDED",
                metadata={"weights_address": address},
            ) from None
        return self._remember(request_id, asked, fetched)

    def swapped(self, versions: dict[str, VersionSpec]) -> None:
        """The engine serves `versions` now (even when the load call that asked timed out)."""
        newer = {
            p: s
            for p, s in versions.items()
            if s.version >= self.held[p].version and differs(s, self.held[p])
        }
        if newer:
            self.held = {**self.held, **newer}

    def _remember(self, request_id: str, asked: tuple, fetched: int) -> LoadResult:
        result = LoadResult(self.held, fetched)
        self.requests[request_id] = (asked, result)
        while len(self.requests) > MAX_LOAD_REQUESTS:
            self.requests.pop(next(iter(self.requests)))
        return result

    async def _load(self, wanted: dict[str, VersionSpec], address: str) -> int:
        async with self._lock:
            for p, spec in wanted.items():
                held = self.held[p].version
                if spec.version < held:
                    raise FailedPrecondition(
                        f"{p}: version {spec.version} is older than the {held} in service",
                        reason="VERSION_REGRESSION",
                        metadata={"policy_id": p, "held_version": str(held)},
                    )
            todo = {p: s for p, s in wanted.items() if differs(s, self.held[p])}
            if not todo:
                return 0
            try:
                fetched = await self.backend.load_weights(todo, address)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # the call was cancelled, or its deadline passed
                # A cancellation from inside the load must still answer the call: a handler
                # that ends in CancelledError sends no status and the caller waits it out.
                self.counters["weight_loads_failed"] += 1
                raise Unavailable(
                    f"loading {sorted(todo)} from {address} was cancelled inside the RaaS",
                    reason="LOAD_CANCELLED",
                ) from None
            # One assignment: a group submitted from now on sees the whole new set.
            self.held = {**self.held, **todo}
            self.counters["weight_loads"] += 1
            return fetched
