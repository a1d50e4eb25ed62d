"""Admission and result holding of one RaaS: which groups run, which results wait for an ack.

`ResultStore` is the RaaS half of at-least-once delivery: a finished result
stays until AckResults names it and is returned by every collect until then.
It also accounts for slots (samples that may run at once). It never runs
anything and never touches the wire; astra.raas.groups drives it.

Rules:
- Admission is idempotent per group id: a group running, or finished and not
  yet acknowledged, counts as accepted and is not run again. So does a group
  acknowledged recently (the last `remember_acked` ids, LRU): Dataflow only
  acknowledges what it holds durably, so a re-submission of such an id is a
  delayed retry, and running it again would only produce a duplicate. The
  cost: a Dataflow that lost its state and re-submits the same id gets no
  result from this instance (its lease expires and it dispatches elsewhere).
  Pass remember_acked=0 to run such ids again instead.
- Admission is all-or-nothing: if the new groups need more samples than are
  free, none is accepted (RESOURCE_EXHAUSTED, reason NO_FREE_SLOTS).
- Slots are freed when a group finishes or is cancelled, not when its result
  is acknowledged: results waiting for an ack hold memory, not engine slots.
- A cancelled group produces no result; a finish() arriving after the cancel
  is dropped and counted.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from astra.errors import ResourceExhausted
from astra.waits import wait_set

RETRY_AFTER_S = 0.5


@dataclass(frozen=True, slots=True)
class Admission:
    """Result of `try_accept`: every submitted id (`accepted`) and those to run now (`new`)."""

    accepted: list[str]
    new: list[str]


class ResultStore:
    def __init__(self, capacity_samples: int, *, remember_acked: int = 100_000) -> None:
        if capacity_samples < 1:
            raise ValueError("capacity_samples must be >= 1")
        self.capacity = capacity_samples
        self.remember_acked = remember_acked
        self._running: dict[str, int] = {}  # group id -> samples it holds
        self._finished: OrderedDict[str, object] = OrderedDict()  # finish order, oldest first
        self._acked: OrderedDict[str, None] = OrderedDict()  # LRU of acknowledged ids
        self._used = 0
        self._ready = asyncio.Event()  # set while a finished result waits
        self.counters: Counter[str] = Counter()

    @property
    def free_slots(self) -> int:
        return self.capacity - self._used

    @property
    def running(self) -> int:
        """Groups accepted and not yet finished or cancelled."""
        return len(self._running)

    @property
    def pending(self) -> int:
        """Finished results waiting for an acknowledgement."""
        return len(self._finished)

    def is_running(self, group_id: str) -> bool:
        return group_id in self._running

    def holds(self, group_id: str) -> bool:
        """True for a group running, finished and unacknowledged, or recently acknowledged."""
        return group_id in self._running or group_id in self._finished or group_id in self._acked

    def try_accept(
        self, groups: Sequence[tuple[str, int]], regenerate: Iterable[str] = ()
    ) -> Admission:
        """Admits (group id, samples) pairs all together, or raises ResourceExhausted.
        Ids in `regenerate` (their stored result was lost) run even if acknowledged before."""
        again = set(regenerate)
        new: dict[str, int] = {}
        for group_id, samples in groups:
            if group_id in again and group_id in self._acked:
                del self._acked[group_id]
                self.counters["groups_regenerated"] += 1
            if samples < 1:
                raise ValueError(f"group {group_id!r}: samples must be >= 1")
            if not self.holds(group_id) and group_id not in new:
                new[group_id] = samples
        need = sum(new.values())
        if need > self.free_slots:
            self.counters["submits_refused"] += 1
            raise ResourceExhausted(
                f"{len(new)} new groups need {need} slots, {self.free_slots} free",
                reason="NO_FREE_SLOTS",
                metadata={"needed_slots": str(need), "free_slots": str(self.free_slots)},
                retry_after_s=RETRY_AFTER_S,
            )
        self._running.update(new)
        self._used += need
        self.counters["groups_accepted"] += len(new)
        self.counters["groups_resubmitted"] += len(groups) - len(new)
        return Admission([g for g, _ in groups], list(new))

    def finish(self, group_id: str, result: object) -> bool:
        """Stores the result of a running group; False (and counted) if it is not running."""
        samples = self._running.pop(group_id, None)
        if samples is None:
            self.counters["results_dropped_not_running"] += 1
            return False
        self._used -= samples
        self._finished[group_id] = result
        self.counters["groups_finished"] += 1
        self._ready.set()
        return True

    def cancel(self, group_ids: Iterable[str]) -> list[str]:
        """Stops accounting for running groups; returns the ids that were running."""
        cancelled = []
        for group_id in group_ids:
            samples = self._running.pop(group_id, None)
            if samples is not None:
                self._used -= samples
                cancelled.append(group_id)
        self.counters["groups_cancelled"] += len(cancelled)
        return cancelled

    async def collect(self, max_groups: int, max_wait_s: float) -> list[object]:
        """Up to `max_groups` unacknowledged results, oldest first; not removed.

        Waits up to `max_wait_s` when none is ready, then returns what there
        is (possibly nothing).
        """
        if not self._finished and max_wait_s > 0:
            await wait_set(self._ready, max_wait_s)
        out: list[object] = []
        for result in self._finished.values():
            if len(out) >= max_groups:
                break
            out.append(result)
        return out

    def ack(self, group_ids: Iterable[str]) -> tuple[int, int]:
        """Drops acknowledged results; returns (acknowledged, ignored)."""
        acknowledged = ignored = 0
        for group_id in group_ids:
            if group_id not in self._finished:
                ignored += 1
                continue
            del self._finished[group_id]
            acknowledged += 1
            if self.remember_acked > 0:
                self._acked[group_id] = None
                self._acked.move_to_end(group_id)
                while len(self._acked) > self.remember_acked:
                    self._acked.popitem(last=False)
        if not self._finished:
            self._ready.clear()
        self.counters["results_acknowledged"] += acknowledged
        self.counters["acks_ignored"] += ignored
        return acknowledged, ignored
