"""The work table: prompt groups not done yet, each waiting or leased to a rollout service.

`WorkTable` keeps the groups pulled from the datasets until they have an outcome: the waiting
queue, the leases (which instance, until when, how many attempts) and the count in flight per
stream, and writes every change in the state store before anything is sent. A group leased
`leases.max_dispatch_attempts` times without a result ends as a counted failure. It never
decides what to dispatch (astra.dataflow.dispatch) and never talks to a rollout service.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from astra.dataflow.config import LeaseSettings, StreamSettings
from astra.dataflow.dataset import PromptSource
from astra.dataflow.done import DoneGroups
from astra.dataflow.ledger import Ledger
from astra.dataflow.pool import Instance, Pool
from astra.dataflow.records import WorkItem
from astra.dataflow.store import StateStore


@dataclass(slots=True)
class Work:
    """A group that is not done: waiting (instance None) or leased to an instance."""

    item: WorkItem
    stream: str
    instance_id: str | None = None
    lease_expire: float | None = None
    attempts: int = 0


class WorkTable:
    def __init__(
        self,
        store: StateStore,
        pool: Pool,
        ledger: Ledger,
        done: DoneGroups,
        sources: dict[str, PromptSource],
        leases: LeaseSettings,
        feeding: dict[str, list[str]],
        is_eval: Callable[[str], bool],
        wake: Callable[[], None],
    ) -> None:
        self.store, self.pool, self.ledger, self.done = store, pool, ledger, done
        self.sources, self.leases, self.is_eval, self.wake = sources, leases, is_eval, wake
        # The training streams that feed each policy's buffer.
        self.feeding = feeding
        self.work: dict[str, Work] = {}
        self.waiting: deque[str] = deque()
        # Groups of `work` leased to instances, per stream: kept as groups are leased,
        # requeued and settled, so the dispatch round's bounds never scan `work`.
        self.running_by_stream: Counter[str] = Counter()
        self.pulled: list[str] = []  # pulled from a dataset, not written yet

    # ----- counts ----------------------------------------------------------------------------

    def in_flight(self) -> int:
        """Training groups leased to instances (evaluation groups never reach a buffer)."""
        return sum(n for name, n in self.running_by_stream.items() if not self.is_eval(name))

    def running(self, stream: str) -> int:
        return self.running_by_stream[stream]

    def running_for(self, policy_id: str) -> int:
        """Training groups in flight that will land in `policy_id`'s buffer, of any stream."""
        return sum(self.running_by_stream[name] for name in self.feeding[policy_id])

    def epoch_in_flight(self, stream: str, epoch: int) -> bool:
        """Whether a group of the stream's epoch is waiting or leased (in memory)."""
        return any(w.stream == stream and w.item.epoch == epoch for w in self.work.values())

    def has_stream(self, streams: set[str]) -> bool:
        return any(w.stream in streams for w in self.work.values())

    def expired(self, now: float) -> set[str]:
        return {g for g, w in self.work.items() if w.lease_expire and w.lease_expire < now}

    # ----- changes ---------------------------------------------------------------------------

    def add(self, item: WorkItem, stream: str, attempts: int = 0) -> None:
        self.work[item.group_id] = Work(item, stream, attempts=attempts)
        self.waiting.append(item.group_id)

    def next_work(self, stream: StreamSettings) -> str | None:
        """A waiting group of the stream, pulling a new one from the dataset if needed."""
        for gid in self.waiting:
            if self.work[gid].stream == stream.name:
                return gid
        if self.is_eval(stream.name):
            return None  # its groups are all queued when its evaluation is scheduled
        item = self.sources[stream.name].next()
        if item is None:
            return None
        self.add(item, stream.name)
        # Written with the round's leases (or by save_pulled), before anything is sent.
        self.pulled.append(item.group_id)
        return item.group_id

    def save_pulled(self, tx) -> None:
        """Persists groups pulled from datasets this round, with the dataset positions."""
        if not self.pulled:
            return
        for gid in self.pulled:
            w = self.work.get(gid)
            if w is not None and w.instance_id is None:
                tx.set_work(gid, w.stream, "pending")
        for name in {self.work[g].stream for g in self.pulled if g in self.work}:
            tx.put(f"dataset/{name}", self.sources[name].state())
        self.pulled.clear()

    def lease(self, gid: str, inst: Instance) -> None:
        w = self.work[gid]
        self.waiting.remove(gid)
        w.instance_id = inst.instance_id
        self.running_by_stream[w.stream] += 1
        w.lease_expire = time.time() + self.leases.group_lease_s
        w.attempts += 1
        inst.in_flight.add(gid)
        inst.free_slots -= w.item.num_samples
        self.ledger.counters["dispatched"] += 1
        if w.attempts > 1:
            self.ledger.counters["redispatched"] += 1

    def persist_leases(self, gids: list[str]) -> None:
        with self.store.tx() as tx:
            self.save_pulled(tx)
            for gid in gids:
                w = self.work[gid]
                tx.set_work(
                    gid,
                    w.stream,
                    "leased",
                    instance_id=w.instance_id,
                    lease_expire=w.lease_expire,
                    attempts=w.attempts,
                )
            self.ledger.persist(tx)

    def extend_leases(self, seconds: float) -> None:
        """Pushes every group lease back by `seconds` (the pause they waited through), in memory;
        a lease expiring after a restart instead is dispatched again, as any lease is."""
        for w in self.work.values():
            if w.lease_expire:
                w.lease_expire += seconds

    def requeue(self, gids: set[str], why: str, *, count_attempt: bool = True) -> None:
        """Returns leased groups to the waiting queue (durably).

        A group dispatched `leases.max_dispatch_attempts` times without a result is
        given up: it ends as a counted failure instead of circling forever.
        """
        moved, given_up = [], []
        limit = self.leases.max_dispatch_attempts
        for gid in gids:
            w = self.work.get(gid)
            if w is None or w.instance_id is None:
                continue
            inst = self.pool.instances.get(w.instance_id)
            if inst is not None:
                inst.in_flight.discard(gid)
            w.instance_id, w.lease_expire = None, None
            self.running_by_stream[w.stream] -= 1
            if not count_attempt:
                w.attempts -= 1
            if count_attempt and w.attempts >= limit:
                given_up.append(gid)
                continue
            self.waiting.appendleft(gid)
            moved.append(gid)
        if not moved and not given_up:
            return
        counters = self.ledger.counters
        counters[f"requeued_{why}"] += len(moved)
        counters["failed_groups"] += len(given_up)
        counters["gave_up_after_max_attempts"] += len(given_up)
        with self.store.tx() as tx:
            for gid in moved:
                w = self.work[gid]
                tx.set_work(gid, w.stream, "pending", attempts=w.attempts)
            for gid in given_up:
                w = self.work.pop(gid)
                self.done.add(gid)
                tx.set_work(
                    gid,
                    w.stream,
                    "done",
                    attempts=w.attempts,
                    outcome=f"failed: no result after {w.attempts} dispatches ({why})",
                )
            self.ledger.persist(tx)
        self.wake()

    def settle(self, tx, gid: str, outcome: str) -> Work:
        """The group has its outcome (in the caller's transaction): out of the table, done."""
        w = self.work[gid]
        inst = self.pool.instances.get(w.instance_id or "")
        if inst is not None and gid in inst.in_flight:
            inst.in_flight.discard(gid)
            # The RaaS freed these slots; heartbeats correct any drift.
            inst.free_slots = min(inst.capacity, inst.free_slots + w.item.num_samples)
        if w.instance_id is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(gid)
        else:
            self.running_by_stream[w.stream] -= 1
        del self.work[gid]
        self.done.add(gid)
        tx.set_work(gid, w.stream, "done", attempts=w.attempts, outcome=outcome)
        return w
