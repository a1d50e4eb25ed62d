"""Training batches handed to trainers: cut, leased, acknowledged, expired.

A batch is cut from one policy's buffer and leased to the trainer until
AckBatch. A retry with the same request id gets the same batch; a lease that
runs out puts the groups back into the buffer. Durable through the store,
so a trainer can acknowledge a batch across a Dataflow restart, and a retried
fetch after one gets the same batch: the same groups in the same order, with the
same advantages (stored with the batch), replayed copies included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from astra.dataflow.records import Batch, BatchRow, GroupRecord, rebuild
from astra.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from astra.waits import within

if TYPE_CHECKING:
    from astra.dataflow.config import LeaseSettings
    from astra.dataflow.ledger import Ledger
    from astra.dataflow.store import StateStore
    from astra.dataflow.versions import VersionBook

log = logging.getLogger("astra.dataflow.coordinator")

MAX_WAIT_S = 60.0
# Why a trained batch's groups are not in its trainer's weights: the trainer restarted from
# a checkpoint older than the batch's step (AnnounceVersionRequest.resumed_from_version).
TRAINER_RESTART = "TRAINER_RESTART"
# Finished (acknowledged or expired) batches remembered for request-id replays.
KEEP_FINISHED = 4096


class BatchDesk:
    def __init__(
        self,
        store: StateStore,
        ledger: Ledger,
        versions: VersionBook,
        leases: LeaseSettings,
        data_ready: asyncio.Condition,
        notify_data_ready: Callable[[], None],
        why: Callable[[], str],
    ) -> None:
        self.store, self.ledger, self.buffers = store, ledger, ledger.buffers
        self.versions, self.leases, self.data_ready = versions, leases, data_ready
        self.notify_data_ready, self.why = notify_data_ready, why
        self.batches: dict[str, Batch] = {}
        self.by_request: dict[tuple[str, str], str] = {}
        # What each dispatch round asks, without scanning the finished batches remembered:
        # the leased batches per policy (in the order leased) and their groups counted (all,
        # and fresh), kept as batches are leased, acknowledged and expired.
        self._leased: defaultdict[str, dict[str, Batch]] = defaultdict(dict)
        # Per policy, the newest version of an acknowledged batch (one that was trained).
        self._acked_top: dict[str, int] = {}
        # Acknowledged batches a resumed trainer never trained (it restarted at their
        # version or before): not taken (`taken_for`). Durable, kv `untrained_batches`.
        self.untrained: set[str] = set()

    def recover(
        self,
        rows: list[BatchRow],
        groups: dict[str, list[GroupRecord]],
        replays: dict[str, dict[int, GroupRecord]],
    ) -> None:
        """Rebuilds the batches from the store: a leased batch exactly as it was served
        (groups, order, advantages), or, where it cannot be (its stored rows incomplete),
        expired with its fresh groups back in the buffer; never served different."""
        self.untrained = set(self.store.get("untrained_batches", []))
        unbuilt: list[Batch] = []
        for row in rows:
            if row.state != "leased":
                self.by_request[(row.policy_id, row.request_id)] = row.batch_id
                self.batches[row.batch_id] = Batch(
                    row.batch_id,
                    row.policy_id,
                    row.request_id,
                    row.trainer_id,
                    [],
                    row.policy_version,
                    row.lease_expire,
                    row.state,
                    sum(not replay for _, replay, _ in row.group_keys),
                    row.untrained_reason,
                )
                continue
            stored = groups.pop(row.batch_id, [])
            rebuilt = rebuild(row, stored, replays.get(row.batch_id, {}))
            # Its trainer could neither extend nor acknowledge the lease while Dataflow was
            # down: the lease runs a full term from now, or a batch trained during an outage
            # longer than the lease would expire back to the buffer and be trained again.
            lease_expire = max(row.lease_expire, time.time() + self.leases.batch_lease_s)
            batch = Batch(
                row.batch_id,
                row.policy_id,
                row.request_id,
                row.trainer_id,
                stored if rebuilt is None else rebuilt,
                row.policy_version,
                lease_expire,
            )
            if rebuilt is not None and any(a is None for _, _, a in row.group_keys):
                # A schema-1 row: no advantages stored. They depend only on the batch's
                # rewards (and the normalisation settings), so stamping them again gives the
                # numbers first served.
                self.buffers[row.policy_id].stamp_advantages(batch.groups)
            self.batches[row.batch_id] = batch
            self.by_request[(row.policy_id, row.request_id)] = row.batch_id
            self._track(batch)
            if rebuilt is None:
                unbuilt.append(batch)
        for policy_id in {row.policy_id for row in rows}:
            self._recount_acked(policy_id)
        # Rows of groups leased in a batch that is not (or no longer) known: buffered again.
        for orphans in groups.values():
            for g in orphans:
                self.buffers[g.policy_id].restore(g)
            with self.store.tx() as tx:
                tx.set_group_batch([(g.group_id, g.policy_id) for g in orphans], None)
        for batch in unbuilt:
            log.warning(
                "leased batch %s (request %s) cannot be rebuilt as served: expired, its fresh "
                "groups buffered again",
                batch.batch_id,
                batch.request_id,
            )
            self.ledger.counters["batches_expired_on_recovery"] += 1
            row = next(r for r in rows if r.batch_id == batch.batch_id)
            self._expire(batch, restored=True, replays=sum(r for _, r, _ in row.group_keys))

    def _track(self, batch: Batch) -> None:
        """`batch` is leased now (its groups set)."""
        self._leased[batch.policy_id][batch.batch_id] = batch

    def _untrack(self, batch: Batch) -> None:
        """`batch` is no longer leased."""
        del self._leased[batch.policy_id][batch.batch_id]

    def _recount_acked(self, policy_id: str) -> None:
        """`_acked_top` of the policy from the batches remembered (a scan: at start-up, at a
        trainer's resume, and when the newest acknowledged batch is forgotten)."""
        self._acked_top[policy_id] = max(
            (
                b.policy_version
                for b in self.batches.values()
                if b.policy_id == policy_id
                and b.state == "acked"
                and b.batch_id not in self.untrained
            ),
            default=-1,
        )

    def leased_groups(self, policy_id: str) -> int:
        # The leased batches of a policy are few (a trainer leases one at a time): counted
        # from them, never kept beside them.
        return sum(len(b.groups) for b in self._leased[policy_id].values())

    def taken_for(self, policy_id: str, version: int) -> bool:
        """Whether the batch that trains `version` (or a later one) was taken: leased, or
        acknowledged (and not left untrained by a trainer that resumed before it)."""
        return self._acked_top.get(policy_id, -1) >= version or any(
            b.policy_version >= version for b in self._leased[policy_id].values()
        )

    def leased_fresh(self, policy_id: str) -> int:
        """Fresh groups of the policy in leased batches: back in its buffer if a lease expires."""
        return sum(not g.replay for b in self._leased[policy_id].values() for g in b.groups)

    def untrained_since(self, policy_id: str, version: int) -> list[str]:
        """Acknowledged batches of the policy at `version` or later not yet marked untrained:
        a trainer that resumes at `version` never trained them."""
        return [
            b.batch_id
            for b in self.batches.values()
            if b.policy_id == policy_id
            and b.state == "acked"
            and b.policy_version >= version
            and b.batch_id not in self.untrained
        ]

    def discard_since(self, tx, policy_id: str, version: int) -> tuple[int, int]:
        """Counts the policy's batches acknowledged as trained at `version` or later
        discarded (TRAINER_RESTART); returns (batches, fresh groups) newly counted. Counted
        from acked_versions, which keeps them per version however many batches ago they were
        (the rows of the newest KEEP_FINISHED finished are marked too, for the run's summary);
        a batch counted before, or acknowledged untrained, is not counted again."""
        found = [
            b
            for b in self.batches.values()
            if b.policy_id == policy_id
            and b.state == "acked"
            and b.policy_version >= version
            and not b.untrained_reason
        ]
        for b in found:
            b.untrained_reason = TRAINER_RESTART
        tx.set_batch_untrained_reason([b.batch_id for b in found], TRAINER_RESTART)
        batches, groups = self.store.acked_since(policy_id, version)
        tx.forget_acked_since(policy_id, version)
        return batches, groups

    def mark_untrained(self, tx, policy_id: str, batch_ids: list[str]) -> None:
        """Marks acknowledged batches untrained: no longer taken (`taken_for`), durably."""
        self.untrained.update(batch_ids)
        self.untrained = {i for i in self.untrained if i in self.batches}
        self._recount_acked(policy_id)
        tx.put("untrained_batches", sorted(self.untrained))

    async def fetch(
        self,
        policy_id: str,
        num_groups: int,
        request_id: str,
        trainer_id: str,
        max_wait_s: float,
        on_wait=None,
        trainer_version: int = 0,
    ) -> Batch:
        """The batch of `request_id` (a new one, or the same one again). `on_wait` is called
        before waiting for data, if the buffer cannot make the batch yet. Staleness counts
        from the newer of the announced version and `trainer_version` (the trainer's own)."""
        if policy_id not in self.buffers:
            raise NotFound(
                f"policy_id: unknown policy {policy_id!r}",
                reason="POLICY_NOT_FOUND",
                metadata={"policy_id": policy_id},
            )
        if not 1 <= num_groups <= 65536:
            raise InvalidArgument(
                "num_groups: must be in 1..65536",
                reason="INVALID_FIELD",
                field_violations=[("num_groups", "must be in 1..65536")],
            )
        if not 1 <= len(request_id) <= 128:
            raise InvalidArgument(
                "request_id: must be 1-128 characters",
                reason="INVALID_FIELD",
                field_violations=[("request_id", "must be 1-128 characters")],
            )
        known = self.by_request.get((policy_id, request_id))
        if known is not None:
            batch = self.batches[known]
            if batch.state == "expired":
                raise FailedPrecondition(
                    f"batch {known} of request {request_id!r} expired; use a new request_id",
                    reason="BATCH_LEASE_EXPIRED",
                    metadata={"batch_id": known},
                )
            if len(batch.groups) != num_groups:
                raise InvalidArgument(
                    f"request_id {request_id!r} was used for a batch of {len(batch.groups)} groups",
                    reason="REQUEST_ID_REUSED",
                    field_violations=[("request_id", "reused with a different num_groups")],
                )
            return batch
        buf = self.buffers[policy_id]
        deadline = time.monotonic() + min(max(max_wait_s, 0.0), MAX_WAIT_S)
        async with self.data_ready:
            while True:
                version = max(self.versions.current(policy_id), trainer_version)
                # take() drops stale groups first; _persist_dropped deletes them from the store.
                groups = buf.take(num_groups, version)
                self._persist_dropped(policy_id)
                if groups is not None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Unavailable(
                        f"batch of {num_groups} groups for {policy_id!r} not ready: "
                        f"{len(buf)} buffered; {self.why()}",
                        reason="BATCH_NOT_READY",
                        metadata={"policy_id": policy_id, "buffered_groups": str(len(buf))},
                        retry_after_s=1.0,
                    )
                if on_wait is not None:
                    on_wait()
                with contextlib.suppress(TimeoutError):
                    await within(self.data_ready.wait(), remaining)
        batch = Batch(
            uuid.uuid4().hex,
            policy_id,
            request_id,
            trainer_id,
            groups,
            version,
            time.time() + self.leases.batch_lease_s,
        )
        self.batches[batch.batch_id] = batch
        self.by_request[(policy_id, request_id)] = batch.batch_id
        self._track(batch)
        self.ledger.counters["batches_served"] += 1
        self.ledger.replay_slots[policy_id] += sum(1 for g in groups if g.replay)
        with self.store.tx() as tx:
            tx.set_group_batch(batch.stored_keys(), batch.batch_id)
            tx.add_replays(batch.batch_id, [(i, g) for i, g in enumerate(groups) if g.replay])
            tx.put_batch(batch.row())
            self.ledger.persist(tx)
        return batch

    def _persist_dropped(self, policy_id: str) -> None:
        if self.buffers[policy_id].has_dropped:
            with self.store.tx() as tx:
                self.ledger.let_go(tx, policy_id)
                self.ledger.persist(tx)

    def _known(self, batch_id: str) -> Batch:
        batch = self.batches.get(batch_id)
        if batch is None:
            raise NotFound(
                f"batch_id: unknown batch {batch_id!r}",
                reason="BATCH_NOT_FOUND",
                metadata={"batch_id": batch_id},
            )
        return batch

    def extend(self, batch_id: str) -> float:
        """Renews a leased batch's lease for a full batch_lease_s; returns the new expiry."""
        batch = self._known(batch_id)
        if batch.state != "leased":
            reason = "BATCH_ACKNOWLEDGED" if batch.state == "acked" else "BATCH_LEASE_EXPIRED"
            raise FailedPrecondition(
                f"batch {batch_id} is {batch.state}: its lease cannot be extended",
                reason=reason,
                metadata={"batch_id": batch_id},
            )
        batch.lease_expire = time.time() + self.leases.batch_lease_s
        with self.store.tx() as tx:
            tx.put_batch(batch.row())
        self.ledger.counters["batch_leases_extended"] += 1
        return batch.lease_expire

    def ack(self, batch_id: str, *, untrained: str = "") -> int:
        """Consumes a leased batch; returns its fresh groups (0 for a repeat).

        `untrained`: why the trainer took no step on it (empty: trained). Its fresh groups
        then leave without entering replay memory and give their slots in AReaL's bound
        back, as groups let go untrained do (Ledger.let_go): counted in `accepted` with no
        version to come for them, they would otherwise stall dispatch for good."""
        batch = self._known(batch_id)
        if batch.state == "acked":
            return 0
        if batch.state == "expired":
            raise FailedPrecondition(
                f"batch {batch_id} expired; its groups went back to the buffer",
                reason="BATCH_LEASE_EXPIRED",
                metadata={"batch_id": batch_id},
            )
        batch.state = "acked"
        self._untrack(batch)
        top = self._acked_top.get(batch.policy_id, -1)
        self._acked_top[batch.policy_id] = max(top, batch.policy_version)
        # Fresh groups only: a replayed copy is a group consumed before, counted then.
        fresh = [g for g in batch.groups if not g.replay]
        consumed = batch.fresh = len(fresh)
        batch.untrained_reason = untrained
        self.ledger.counters["consumed_groups"] += consumed
        self.ledger.counters["consumed_trajectories"] += sum(len(g.trajectories) for g in fresh)
        self.ledger.counters["consumed_replay_groups"] += len(batch.groups) - consumed
        buf = self.buffers[batch.policy_id]
        if untrained:
            self.ledger.counters["untrained_batches"] += 1
            self.ledger.counters["untrained_groups"] += consumed
            self.ledger.counters[f"untrained_groups.{batch.policy_id}"] += consumed
            self.ledger.counters[f"untrained.{untrained}"] += 1
            self.ledger.counters[f"groups_discarded.{untrained.lower()}"] += consumed
            self.ledger.accepted[batch.policy_id] = max(
                0, self.ledger.accepted[batch.policy_id] - consumed
            )
            entered = []
        else:  # trained now: the fresh groups enter replay (their rows become replay memory)
            self.ledger.counters[f"trained_groups.{batch.policy_id}"] += consumed
            entered = buf.remember(fresh)
        kept = set(entered)
        # any_failure: memory (the batch acknowledged, replay) is already ahead of the store.
        # durable: fsynced before the trainer hears OK, so a power loss never takes it back.
        with self.store.tx(any_failure=True, durable=True) as tx:
            if not untrained:  # counted discarded if its trainer restarts from before it
                tx.add_acked(batch.policy_id, batch.policy_version, consumed)
            tx.move_to_replay(batch.policy_id, entered)
            tx.delete_groups(k for k in batch.stored_keys() if k[0] not in kept)
            tx.delete_replays([batch.batch_id])
            self.ledger.let_go(tx, batch.policy_id)
            tx.put_batch(batch.row())
            self.ledger.persist(tx)
        batch.groups = []
        if entered:  # a fetch waiting for fresh groups may now take replayed copies instead
            self.notify_data_ready()
        return consumed

    def _prune(self) -> None:
        leased = sum(len(batches) for batches in self._leased.values())
        if len(self.batches) - leased <= KEEP_FINISHED:
            return
        finished = [b for b in self.batches.values() if b.state != "leased"]
        drop = finished[: len(finished) - KEEP_FINISHED]
        for b in drop:
            del self.batches[b.batch_id]
            self.by_request.pop((b.policy_id, b.request_id), None)
        # Forgotten: no longer taken (as when `taken_for` scanned the batches remembered).
        for policy_id in {
            b.policy_id
            for b in drop
            if b.state == "acked" and b.policy_version >= self._acked_top.get(b.policy_id, -1)
        }:
            self._recount_acked(policy_id)
        untrained = self.untrained & {b.batch_id for b in drop}
        self.untrained -= untrained
        with self.store.tx() as tx:
            tx.delete_batches(b.batch_id for b in drop)
            if untrained:
                tx.put("untrained_batches", sorted(self.untrained))

    def expire(self, now: float) -> None:
        self._prune()
        for batch in [
            b for batches in self._leased.values() for b in batches.values() if b.lease_expire < now
        ]:
            self._expire(batch)

    def _expire(self, batch: Batch, *, restored: bool = False, replays: int | None = None) -> None:
        """Ends a leased batch: its fresh groups go back to the buffer (`restored`: they were
        read from the store at start-up, not taken from this buffer; `replays`: how many
        replayed copies it held, if not in `groups`)."""
        batch.state = "expired"
        self._untrack(batch)
        fresh = [g for g in batch.groups if not g.replay]
        if replays is None:
            replays = len(batch.groups) - len(fresh)
        self.ledger.replay_slots[batch.policy_id] -= replays  # taken again by the next batch
        buf = self.buffers[batch.policy_id]
        if restored:
            for g in fresh:
                buf.restore(g)
        else:
            buf.put_back(fresh)
        self.ledger.counters["batch_leases_expired"] += 1
        with self.store.tx() as tx:
            tx.set_group_batch(batch.stored_keys(), None)
            tx.delete_replays([batch.batch_id])
            tx.put_batch(batch.row())
            self.ledger.persist(tx)
        batch.groups = []
