"""Dataflow's collection side: one long-poll per rollout service, ingest, acknowledgement.

A part of Dataflow (astra.dataflow.coordinator wires it): each instance's collect
loop takes its finished groups, decodes and ingests them a slice at a time
(in turn with the other collectors, and never ahead of a waiting trainer),
writes their bytes off the event loop, commits the decisions in one
transaction and acknowledges only then, so a crash in between repeats the
delivery and the duplicate is dropped by id. Never imports gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from astra.dataflow.buffer import ACCEPTED, DUPLICATE, FAILED, REJECTED_FULL
from astra.dataflow.config import DataflowConfig
from astra.dataflow.evals import EvalDesk
from astra.dataflow.gate import StalenessTracker
from astra.dataflow.ledger import Ledger
from astra.dataflow.pool import Instance, InstanceState, Pool
from astra.dataflow.ports import IncomingGroup, PortError
from astra.dataflow.quarantine import Redo
from astra.dataflow.records import GroupRecord, TrajectoryRecord
from astra.dataflow.storage_guard import PauseWatch, StorageGuard, is_disk_full
from astra.dataflow.store import StateStore
from astra.dataflow.turns import TrainerTurns
from astra.dataflow.versions import VersionBook
from astra.dataflow.work import Work, WorkTable

MALFORMED, MISSING = "malformed", "missing"  # outcomes of results no buffer saw (drop runs)
log = logging.getLogger("astra.dataflow.coordinator")
INGEST_SLICE = 16


async def cancel(inst: Instance, gids: list[str]) -> None:
    """Tells an instance to drop groups (best effort: a lease or a duplicate covers a miss)."""
    with contextlib.suppress(PortError):
        await inst.port.cancel(gids)


class Ingestor:
    def __init__(
        self,
        config: DataflowConfig,
        store: StateStore,
        pool: Pool,
        table: WorkTable,
        ledger: Ledger,
        versions: VersionBook,
        evals: EvalDesk,
        redo: Redo,
        staleness: StalenessTracker,
        storage: StorageGuard,
        storage_paused: PauseWatch,
        turns: TrainerTurns,
        writer: ThreadPoolExecutor,
        data_ready: asyncio.Condition,
        wake: Callable[[], None],
        spawn: Callable,
    ) -> None:
        self.config, self.store, self.pool, self.table = config, store, pool, table
        self.ledger, self.counters, self.buffers = ledger, ledger.counters, ledger.buffers
        self.versions, self.evals, self.redo, self.staleness = versions, evals, redo, staleness
        self.storage, self._storage_paused, self.turns = storage, storage_paused, turns
        self._writer, self.data_ready, self.wake, self._spawn = writer, data_ready, wake, spawn
        self.collectors: dict[str, asyncio.Task] = {}
        self.stopping = False
        self._turn = asyncio.Lock()  # one ingest slice at a time, across the collectors
        self._unattributable: set[tuple[str, str | None]] = set()  # (instance, result) counted

    def ensure_collector(self, instance_id: str) -> None:
        task = self.collectors.get(instance_id)
        if task is not None and task.done() and not task.cancelled() and task.exception():
            # A bug, not a RaaS failure (those are PortErrors, handled in the loop): never
            # silent. The loop starts again below; the results it held are delivered again.
            self.counters["collector_failures"] += 1
            log.error(
                "collector of %s failed; restarting it", instance_id, exc_info=task.exception()
            )
        if task is None or task.done():
            self.collectors[instance_id] = asyncio.create_task(
                self._collect_loop(instance_id), name=f"collect:{instance_id}"
            )

    async def _collect_loop(self, instance_id: str) -> None:
        ps = self.config.pool
        while not self.stopping:
            inst = self.pool.instances.get(instance_id)
            if inst is None or inst.state in (InstanceState.DEAD, InstanceState.LEFT):
                return
            if inst.state is InstanceState.SUSPECT:
                await asyncio.sleep(ps.probe_interval_s)
                continue
            await self.turns.after_trainers()
            if self._storage_paused():  # the RaaS keep their results until there is room
                await asyncio.sleep(min(self.config.storage.check_interval_s, 1.0))
                continue
            try:
                received = await inst.port.collect(ps.collect_max_groups, ps.collect_wait_s)
            except PortError as exc:
                log.warning("collect from %s failed: %s", instance_id, exc)
                self.pool.call_failed(instance_id)
                continue
            self.pool.call_succeeded(instance_id)
            if not received:
                continue
            acks = []
            # Decoding and committing are CPU work on the event loop: one slice at a time,
            # in turn with the other collectors, so trainer fetches are never starved.
            for start in range(0, len(received), INGEST_SLICE):
                async with self._turn:
                    # Checked with the turn held: collectors queued for the turn must not
                    # run their slices past a trainer that arrived meanwhile. Bounded, so a
                    # stream that never closes cannot stall ingest.
                    await self.turns.after_trainers()
                    if self.storage.paused:
                        break  # the rest stays on the RaaS, unacknowledged
                    results = inst.port.decode(received[start : start + INGEST_SLICE])
                    acks += await self.ingest(instance_id, results)
                await asyncio.sleep(0)
            if not acks:  # only results that cannot be acknowledged: they come back at once
                await asyncio.sleep(max(ps.collect_wait_s, 0.5))
                continue
            try:
                await inst.port.ack(acks)
            except PortError as exc:
                # Not lost: the RaaS sends them again and they are dropped as duplicates.
                log.warning("ack to %s failed: %s", instance_id, exc)

    def _stage(self, instance_id: str, results: list[IncomingGroup]) -> dict:
        """Reserves blob-log room for the groups the transaction will likely store, so
        their bytes can be written off the event loop first (see `ingest`)."""
        staged = {}
        for r in results:
            if r.invalid is not None or r.error is not None:
                continue
            w = self.table.work.get(r.group_id)  # a group done is no longer in `work`
            if w is None or self.evals.is_eval(w.stream):
                continue
            for policy_id, trajectories in r.per_policy.items():
                if (r.group_id, policy_id) in staged:  # the same result twice in a batch
                    continue
                buf = self.buffers.get(policy_id)
                kept = [t for t in trajectories if not t.failed]
                if buf is None or not buf.likely_accepts(kept, self.versions.current(policy_id)):
                    continue
                group = GroupRecord(r.group_id, policy_id, w.item.epoch, kept)
                staged[(r.group_id, policy_id)] = self.store.stage(group)
        return staged

    async def ingest(self, instance_id: str, results: list[IncomingGroup]) -> list[str]:
        """Takes finished groups into the buffers durably; returns the ids to acknowledge.

        The groups' bytes are written to the blob log on the writer thread first (the
        event loop serves trainers meanwhile); the decisions and the rows are made after,
        in one transaction, exactly as if nothing had been written ahead: bytes a row does
        not end up pointing at are given back.
        """
        try:
            staged = self._stage(instance_id, results)  # may open a new blob segment
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            return self._defer_disk_full(exc, results)
        if staged:
            write = asyncio.get_running_loop().run_in_executor(
                self._writer, self.store.write_staged, list(staged.values())
            )
            try:
                await write
            except BaseException as exc:
                if not write.done():  # the thread may still write there: leave the room
                    raise
                self.store.discard_staged(staged.values())
                if not isinstance(exc, OSError) or not is_disk_full(exc):
                    raise
                return self._defer_disk_full(exc, results)
            self.storage.note_written(sum(s.length for s in staged.values()))
            self._storage_paused()
        try:
            return await self._ingest(instance_id, results, staged)
        finally:
            self.store.discard_staged(staged.values())

    def _defer_disk_full(self, exc: OSError, results: list[IncomingGroup]) -> list[str]:
        """Nothing changed in memory yet: acknowledge none (the RaaS keeps them) and pause
        until there is room (astra.dataflow.storage_guard)."""
        self.storage.note_full(exc)
        self._storage_paused()
        self.counters["results_deferred_disk_full"] += len(results)
        return []

    async def _ingest(self, instance_id: str, results: list[IncomingGroup], staged) -> list[str]:
        acks: list[str] = []
        others: dict[str, list[str]] = {}  # instances still running a group done here
        evaluated = False  # an evaluation group's result: the tallies are written once, below
        # Memory (buffers, work, done, counters) changes result by result inside the
        # transaction: any exception in it, not only storage's, fail-stops (see
        # Dataflow._storage_failed), or a rolled-back result would stay buffered and done
        # in memory and be dispatched and trained again after a restart.
        with self.store.tx(any_failure=True) as tx:
            for r in results:
                if not r.group_id:  # a result that names no group cannot be acknowledged
                    key = (instance_id, r.invalid)
                    if key not in self._unattributable:  # collected again until its RaaS drops it
                        self._unattributable.add(key)
                        self.counters["unattributable_results"] += 1
                        log.warning("result from %s without a group id: %s", instance_id, r.invalid)
                    continue
                acks.append(r.group_id)
                w = self.table.work.get(r.group_id)
                if w is None:  # done (`work` and `done` never share an id), or never ours
                    if r.group_id in self.table.done:
                        self.counters["duplicates_dropped"] += 1
                    else:
                        self.counters["unknown_results_dropped"] += 1
                    continue
                if w.instance_id is not None and w.instance_id != instance_id:
                    others.setdefault(w.instance_id, []).append(r.group_id)
                evaluated = evaluated or self.evals.is_eval(w.stream)
                outcome = self._take_result(tx, w, r, staged)
                self.table.settle(tx, r.group_id, outcome)
                self.redo.finish(tx, r.group_id)
            for policy_id in self.buffers:
                self.ledger.let_go(tx, policy_id)
            if evaluated:
                tx.put("evals", self.evals.state())
            self.ledger.persist(tx)
        for other, gids in others.items():
            inst = self.pool.instances.get(other)
            if inst is not None:
                self._spawn(cancel(inst, gids))
        async with self.data_ready:
            self.data_ready.notify_all()
        self.wake()
        return acks

    def _take_result(self, tx, w: Work, r: IncomingGroup, staged=None) -> str:
        if self.evals.is_eval(w.stream):
            return self._take_eval(w, r)
        if r.invalid is not None:
            self.counters["malformed_results"] += 1
            log.warning("malformed result for %s: %s", r.group_id, r.invalid)
            self._dropped(w.item.policy_ids, MALFORMED)
            return f"malformed: {r.invalid}"
        if r.error is not None:
            self.counters["failed_groups"] += 1
            self._dropped(w.item.policy_ids, FAILED)
            return f"failed: {r.error}"
        if not r.per_policy:
            # Neither trajectories nor an error: nothing to train, and not a success.
            self.counters["malformed_results"] += 1
            log.warning("malformed result for %s: no trajectories and no error", r.group_id)
            self._dropped(w.item.policy_ids, MALFORMED)
            return "malformed: no trajectories"
        self.counters["completed_groups"] += 1
        outcomes = []
        per_policy = dict(r.per_policy)
        # Failed samples may carry no sequence, hence no policy: they belong to the group's.
        orphans = per_policy.pop("", [])
        for policy_id in w.item.policy_ids if orphans else ():
            per_policy.setdefault(policy_id, []).extend(replace(t) for t in orphans)
        # Dispatched again for some policies only (astra.dataflow.quarantine): the others'
        # parts of its first result are buffered or trained already.
        per_policy, stored = self.redo.restrict(r.group_id, per_policy)
        if stored:
            self.counters["redispatch_parts_dropped"] += stored
        for policy_id in self.redo.wanted(r.group_id, w.item.policy_ids):
            if policy_id not in per_policy:
                # The other policies' parts are trained; this one's is counted, not silent.
                self.counters[f"malformed_missing_policy.{policy_id}"] += 1
                log.warning("result for %s has no trajectories of %s", r.group_id, policy_id)
                self._dropped([policy_id], MISSING)
                outcomes.append(f"{policy_id}:missing")
        for policy_id, trajectories in per_policy.items():
            buf = self.buffers.get(policy_id)
            if buf is None:
                self.counters["foreign_policy_dropped"] += 1
                continue
            group = GroupRecord(r.group_id, policy_id, w.item.epoch, trajectories)
            current = self.versions.current(policy_id)
            outcome = buf.add(group, current)
            self._warn_if_dropping(policy_id, outcome)
            outcomes.append(f"{policy_id}:{outcome}")
            if outcome == "accepted":
                self.ledger.accepted[policy_id] += 1
                self.staleness.update(group.staleness(current))
                tx.add_groups([group], staged)
        return ",".join(outcomes) or "empty"

    def _dropped(self, policy_ids: Sequence[str], outcome: str) -> None:
        """A result that gives these policies nothing to train extends their runs of drops."""
        for policy_id in policy_ids:
            if (buf := self.buffers.get(policy_id)) is not None:
                buf.note(outcome)
                self._warn_if_dropping(policy_id, outcome)

    def _warn_if_dropping(self, policy_id: str, outcome: str) -> None:
        """Warns when a dropped group (`outcome`) makes the policy's run of drops 8 batches'
        worth of groups long, and again at each doubling: no batch forms meanwhile."""
        if outcome in (ACCEPTED, DUPLICATE, REJECTED_FULL):
            return  # (what ends or leaves alone a run of drops: Buffer.note)
        buf = self.buffers[policy_id]
        n, batch = buf.dropped_in_a_row, self.config.policy(policy_id).batch_groups
        batches, rest = divmod(n, 8 * batch)
        if rest == 0 and batches and batches & (batches - 1) == 0:
            hint = (
                "; every sample of a group scored the same: a model that never (or always) "
                "solves the task, say an untrained one. Start from a warmed-up model "
                "(`astra sft`, or `astra run`'s warmup), or set "
                f"policies.{policy_id}.buffer.drop_equal_rewards: false"
                if buf.last_drop == "filtered_equal_reward"
                else ""
            )
            log.warning(
                "policy %s: the last %d finished groups were all dropped (the newest: %s); "
                "no batch of %d forms until one is kept%s",
                policy_id,
                n,
                buf.last_drop,
                batch,
                hint,
            )

    def _take_eval(self, w: Work, r: IncomingGroup) -> str:
        """An evaluation group's result: each policy's samples tallied, never buffered (a
        failure counts as failed samples, so every evaluation completes)."""
        per_policy: dict[str, list[TrajectoryRecord]] = {}
        if r.invalid is not None or r.error is not None:
            self.counters["eval_failed_groups"] += 1  # counted here, not in failed_groups
            failed = [TrajectoryRecord("", 0.0, -1, -1, 0, failed=True)] * w.item.num_samples
            per_policy = dict.fromkeys(w.item.policy_ids, failed)
        else:
            for policy_id in w.item.policy_ids:  # failed samples without a sequence: everyone's
                per_policy[policy_id] = [
                    *r.per_policy.get(policy_id, []),
                    *r.per_policy.get("", []),
                ]
        outcome = self.evals.take(w.stream, w.item.epoch, per_policy)
        self.counters["eval_groups"] += 1  # every evaluation group's outcome, failed or not
        return outcome
