"""The groups one RaaS runs: admission through a `ResultStore`, one task per group.

`GroupRunner` admits validated `GroupSpec`s (all or none, idempotent per id,
see astra.raas.results), runs each new one as a task on the backend with the
versions in service when it was accepted, and stores its outcome, which is
always a result: the trajectories, or the group's failure (the backend
raised: INTERNAL; the result is larger than one message can carry:
RESOURCE_EXHAUSTED), so a failure is counted, never dropped. Cancelled groups
produce nothing. Results are stored already encoded, by the `encode` and
`encode_failure` callables the servicer gives, so every collect sends the same
bytes. Plain Python: no gRPC, no protobuf.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from astra.errors import Unavailable
from astra.raas.backend import GroupSpec, RolloutBackend, TrajectorySpec
from astra.raas.results import ResultStore

log = logging.getLogger(__name__)

# (group, trajectories) -> a stored result's bytes; (group, status code name, message) -> those
# of the group's failure.
Encode = Callable[[GroupSpec, list[TrajectorySpec]], bytes]
EncodeFailure = Callable[[GroupSpec, str, str], bytes]


class GroupRunner:
    """Runs accepted groups on `backend`; results wait in `store` until acknowledged."""

    def __init__(
        self,
        backend: RolloutBackend,
        store: ResultStore,
        *,
        encode: Encode,
        encode_failure: EncodeFailure,
        max_result_bytes: int,
        counters: Counter[str],
        instance: Callable[[], str] = lambda: "",
    ) -> None:
        self.backend = backend
        self.store = store
        self.encode, self.encode_failure = encode, encode_failure
        self.max_result_bytes = max_result_bytes
        self.counters = counters
        self.instance = instance  # this instance's id, for messages
        self.metrics: Any = None  # astra.raas.metrics.RaasMetrics when /metrics is served
        # Why groups cannot run here (the engine failed), or "": submit() raises UNAVAILABLE.
        self.unavailable = ""
        self.tasks: dict[str, asyncio.Task] = {}

    def submit(
        self, specs: Sequence[GroupSpec], regenerate: Sequence[str], versions: dict[str, int]
    ) -> list[str]:
        """Admits `specs` and starts the new ones with `versions`; returns every id accepted."""
        admission = self.store.try_accept(
            [(s.group_id, s.num_samples) for s in specs], regenerate=regenerate
        )
        by_id = {s.group_id: s for s in specs}
        for gid in admission.new:
            self.tasks[gid] = asyncio.create_task(self._run(by_id[gid], versions))
        return admission.accepted

    def check_available(self) -> None:
        if self.unavailable:
            raise Unavailable(
                f"instance {self.instance()} cannot generate: {self.unavailable}",
                reason="ENGINE_UNAVAILABLE",
                retry_after_s=5.0,
            )

    async def _run(self, spec: GroupSpec, versions: dict[str, int]) -> None:
        started, failed = time.perf_counter(), True
        try:
            trajectories = await self.backend.generate(spec, versions)
            payload = self.encode(spec, trajectories)
            failed = False
        except Exception as exc:
            log.warning("group %s failed: %s: %s", spec.group_id, type(exc).__name__, exc)
            self.counters["groups_failed"] += 1
            payload = self.encode_failure(spec, "INTERNAL", f"{type(exc).__name__}: {exc}")
        finally:
            if self.tasks.get(spec.group_id) is asyncio.current_task():
                del self.tasks[spec.group_id]
        if len(payload) > self.max_result_bytes:
            # Never deliverable (one group per collected message): it would block every
            # result after it. Delivered as the group's failure instead, and counted.
            log.error("group %s: result of %d bytes exceeds the %d-byte message limit",
                      spec.group_id, len(payload), self.max_result_bytes)  # fmt: skip
            self.counters["results_too_large"] += 1
            size, failed = len(payload), True
            payload = self.encode_failure(
                spec,
                "RESOURCE_EXHAUSTED",
                f"result of {size} bytes exceeds the {self.max_result_bytes}-byte "
                "message limit: fewer samples or tokens per group",
            )
        if self.metrics is not None:
            self.metrics.observe_group(spec.workflow, time.perf_counter() - started, failed)
        self.store.finish(spec.group_id, payload)

    def cancel(self, group_ids: Sequence[str]) -> int:
        """Cancels the running groups among `group_ids`; returns how many were running."""
        cancelled = self.store.cancel(group_ids)
        for gid in cancelled:
            task = self.tasks.pop(gid, None)
            if task is not None:
                task.cancel()
        return len(cancelled)

    async def close(self) -> None:
        """Cancels every running group (their results are not produced)."""
        tasks = list(self.tasks.values())
        self.store.cancel(list(self.tasks))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
