"""Dataflow's dispatch side: which waiting groups go to which rollout service, now.

Each round (when woken by a registration, heartbeat, result, version, finished weight load
or requeue, and at least every IDLE_POLL_S) schedules the evaluations due, asks admission
(astra.dataflow.admission) how many groups each stream may start, routes each to the eligible
instance with the most free slots whose weights are recent enough (astra.dataflow.offpolicy),
writes the leases (astra.dataflow.work), then submits through the instance's `RolloutPort`. A
refused or failed submit puts the groups back. Never imports gRPC.
"""

from __future__ import annotations

import asyncio
import heapq
import logging

from astra.dataflow.admission import Admission
from astra.dataflow.config import DataflowConfig, StreamSettings
from astra.dataflow.dataset import PromptSource
from astra.dataflow.evals import EvalDesk
from astra.dataflow.ledger import Ledger
from astra.dataflow.offpolicy import OffPolicyBudget
from astra.dataflow.pool import Pool
from astra.dataflow.ports import PortError
from astra.dataflow.storage_guard import PauseWatch
from astra.dataflow.store import StateStore
from astra.dataflow.turns import TrainerTurns
from astra.dataflow.versions import VersionBook
from astra.dataflow.work import WorkTable
from astra.waits import wait_set

log = logging.getLogger("astra.dataflow.coordinator")

SUBMIT_BATCH = 32
# The dispatcher runs when woken and at the latest this often.
IDLE_POLL_S = 0.2


class Dispatcher:
    def __init__(
        self,
        config: DataflowConfig,
        streams: dict[str, StreamSettings],
        store: StateStore,
        pool: Pool,
        table: WorkTable,
        ledger: Ledger,
        versions: VersionBook,
        sources: dict[str, PromptSource],
        evals: EvalDesk,
        admission: Admission,
        budget: OffPolicyBudget,
        storage_paused: PauseWatch,
        turns: TrainerTurns,
    ) -> None:
        self.config, self.store, self.pool, self.table = config, store, pool, table
        self.counters, self.ledger, self.versions = ledger.counters, ledger, versions
        self.sources, self.evals, self.admission, self.budget = sources, evals, admission, budget
        self.storage_paused, self.turns = storage_paused, turns
        self.streams = streams
        self.woken = asyncio.Event()

    def wake(self) -> None:
        self.woken.set()

    async def loop(self) -> None:
        while True:
            await wait_set(self.woken, IDLE_POLL_S)
            await self.turns.after_trainers()
            self.woken.clear()
            try:
                await self.round()
            except Exception:
                log.exception("dispatch round failed")

    def schedule_evals(self) -> None:
        """Queues the evaluations that are due (astra.dataflow.evals), durably."""
        for name in self.evals.every:
            stream = self.streams[name]
            version = self.evals.due(name, self.versions.current(stream.policy_ids[0]))
            if version is None:
                continue
            items = [
                i
                for i in self.sources[name].epoch_items(version)
                if i.group_id not in self.table.done
            ]
            self.evals.schedule(name, version, len(items))
            with self.store.tx() as tx:
                for item in items:
                    if item.group_id in self.table.work:  # queued already (kept from before)
                        continue
                    self.table.add(item, name)
                    tx.set_work(item.group_id, name, "pending")
                tx.put("evals", self.evals.state())
            self.counters["evaluations_started"] += 1
            log.info("evaluating %s at version %d: %d groups", name, version, len(items))

    def _budget(self, stream: StreamSettings, can_admit: bool):
        """(groups the stream may start this round, its version floor), or None to skip it."""
        if not self.evals.is_eval(stream.name):
            if not can_admit:
                return None
            budget = min(self.budget.stream_capacity(stream), self.admission.buffer_room(stream))
            return budget, self.budget.version_floor(stream)
        # Not gated (it fills no buffer); only instances holding the version evaluated.
        version = self.evals.floor(stream.name)
        if version is None:
            return None
        floor = {stream.policy_ids[0]: version}
        free = sum(
            inst.free_slots // stream.group_size
            for inst in self.pool.eligible(
                stream.workflow, stream.policy_ids, stream.group_size, floor, stream.raas_labels
            )
        )
        return min(self.budget.stream_capacity(stream), (free + 1) // 2), floor

    async def round(self) -> None:
        if self.evals.every:
            self.schedule_evals()
        if self.pool.empty:
            self.admission.evaluate()
            return
        state = self.admission.evaluate()
        if self.storage_paused():  # status shows the gate THROTTLED with the reason
            return  # evaluations too: their results are written like any other
        # Evaluation streams first, with at most half the free slots: after the training
        # streams an evaluation got only the slots they left, next to none behind an open gate,
        # and crawled while the end of a run waited for it; with all of them, training
        # stalled at every evaluation.
        for stream in sorted(self.streams.values(), key=lambda s: not self.evals.is_eval(s.name)):
            planned = self._budget(stream, state.can_admit)
            if planned is None:
                continue
            budget, floor = planned
            room = None if self.evals.is_eval(stream.name) else self.budget.version_room(floor)
            await self._lease_and_submit(stream, budget, floor, room)
        if self.table.pulled:
            with self.store.tx() as tx:
                self.table.save_pulled(tx)

    async def _lease_and_submit(self, stream: StreamSettings, budget: int, floor, room) -> None:
        leased = 0
        while budget > 0:
            plan: dict[str, list[str]] = {}
            # Pool.pick once per group, without scanning the pool each time: the
            # instance with the most free slots, the first in pool order among equals.
            candidates = self.pool.eligible(
                stream.workflow, stream.policy_ids, stream.group_size, floor, stream.raas_labels
            )
            heap = [(-inst.free_slots, k, inst) for k, inst in enumerate(candidates)]
            heapq.heapify(heap)
            while budget > 0 and heap:
                _, k, inst = heapq.heappop(heap)
                if room is not None and room(inst) <= leased:
                    continue  # its weights are too old for what is left of the bound
                gid = self.table.next_work(stream)
                if gid is None:
                    break
                self.table.lease(gid, inst)
                plan.setdefault(inst.instance_id, []).append(gid)
                budget -= 1
                leased += 1
                if len(plan[inst.instance_id]) >= SUBMIT_BATCH:
                    break
                if inst.free_slots >= stream.group_size:
                    heapq.heappush(heap, (-inst.free_slots, k, inst))
            if not plan:
                break
            self.table.persist_leases([g for gids in plan.values() for g in gids])
            await asyncio.gather(*(self.submit(i, g, stream) for i, g in plan.items()))

    async def submit(self, instance_id: str, gids: list[str], stream: StreamSettings) -> None:
        inst = self.pool.instances[instance_id]
        work = self.table.work
        try:
            accepted, free = await inst.port.submit([(work[g].item, stream) for g in gids])
        except PortError as exc:
            if exc.fatal:
                # The instance answered and refused the groups (INVALID_ARGUMENT,
                # FAILED_PRECONDITION): not a failure of the instance, and not one a resend
                # mends. Each refusal counts as a dispatch attempt, so the groups end as
                # counted failures after leases.max_dispatch_attempts instead of circling.
                log.error("submit to %s refused: %s", instance_id, exc)
                self.counters["submits_refused_invalid"] += 1
                inst.refused_in_a_row += 1
                inst.last_refusal = str(exc)[:512]
                self.table.requeue(set(gids) & inst.in_flight, "submit_invalid")
                return
            if exc.busy:
                inst.free_slots = 0
            else:
                log.warning("submit to %s failed: %s", instance_id, exc)
                self.pool.call_failed(instance_id)
            self.table.requeue(set(gids) & inst.in_flight, "submit_failed", count_attempt=False)
            return
        self.pool.call_succeeded(instance_id)
        inst.refused_in_a_row = 0
        inst.free_slots = free
        self.counters["groups_accepted"] += len(set(accepted) & set(gids))
        missing = set(gids) - set(accepted)
        if missing:
            self.table.requeue(missing & inst.in_flight, "submit_refused", count_attempt=False)
