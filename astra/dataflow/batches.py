"""Training batches handed to trainers: cut, leased, acknowledged, expired.

A batch is cut from one policy's buffer and leased to the trainer until
AckBatch. A retry with the same request id gets the same batch; a lease that
runs out puts the groups back into the buffer. Durable through the store,
so a trainer can acknowledge a batch across a Dataflow restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from astra.dataflow.records import GroupRecord
from astra.dataflow.store import BatchRow
from astra.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

if TYPE_CHECKING:
    from astra.dataflow.coordinator import Dataflow

MAX_WAIT_S = 60.0
# Finished (acknowledged or expired) batches remembered for request-id replays.
KEEP_FINISHED = 4096


@dataclass(slots=True)
class Batch:
    batch_id: str
    policy_id: str
    request_id: str
    trainer_id: str
    groups: list[GroupRecord]
    policy_version: int
    lease_expire: float
    state: str = "leased"

    @property
    def num_trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)

    def row(self) -> BatchRow:
        return BatchRow(
            self.batch_id,
            self.policy_id,
            self.request_id,
            self.trainer_id,
            self.state,
            self.lease_expire,
            self.policy_version,
            [(g.group_id, g.replay) for g in self.groups],
        )

    def stored_keys(self) -> list[tuple[str, str]]:
        return [(g.group_id, g.policy_id) for g in self.groups if not g.replay]


class BatchDesk:
    def __init__(self, df: Dataflow) -> None:
        self.df = df
        self.batches: dict[str, Batch] = {}
        self.by_request: dict[tuple[str, str], str] = {}

    def recover(self, rows: list[BatchRow], groups: dict[str, list[GroupRecord]]) -> None:
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
                )
                continue
            batch = Batch(
                row.batch_id,
                row.policy_id,
                row.request_id,
                row.trainer_id,
                groups.get(row.batch_id, []),
                row.policy_version,
                row.lease_expire,
            )
            self.batches[row.batch_id] = batch
            self.by_request[(row.policy_id, row.request_id)] = row.batch_id

    def leased_groups(self, policy_id: str) -> int:
        return sum(
            len(b.groups)
            for b in self.batches.values()
            if b.policy_id == policy_id and b.state == "leased"
        )

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
        df = self.df
        if policy_id not in df.buffers:
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
        buf = df.buffers[policy_id]
        deadline = time.monotonic() + min(max(max_wait_s, 0.0), MAX_WAIT_S)
        async with df.data_ready:
            while True:
                version = max(df.versions.current(policy_id), trainer_version)
                # take() drops stale groups first; _persist_dropped deletes them from the store.
                groups = buf.take(num_groups, version)
                self._persist_dropped(policy_id)
                if groups is not None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Unavailable(
                        f"batch of {num_groups} groups for {policy_id!r} not ready: "
                        f"{len(buf)} buffered; {df.why()}",
                        reason="BATCH_NOT_READY",
                        metadata={"policy_id": policy_id, "buffered_groups": str(len(buf))},
                        retry_after_s=1.0,
                    )
                if on_wait is not None:
                    on_wait()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(df.data_ready.wait(), remaining)
        batch = Batch(
            uuid.uuid4().hex,
            policy_id,
            request_id,
            trainer_id,
            groups,
            version,
            time.time() + df.config.leases.batch_lease_s,
        )
        self.batches[batch.batch_id] = batch
        self.by_request[(policy_id, request_id)] = batch.batch_id
        df.counters["batches_served"] += 1
        with df.store.tx() as tx:
            tx.set_group_batch(batch.stored_keys(), batch.batch_id)
            tx.put_batch(batch.row())
            df.persist_counters(tx)
        return batch

    def _persist_dropped(self, policy_id: str) -> None:
        dropped = self.df.buffers[policy_id].pop_dropped()
        if dropped:
            with self.df.store.tx() as tx:
                tx.delete_groups((g.group_id, g.policy_id) for g in dropped)

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
        batch.lease_expire = time.time() + self.df.config.leases.batch_lease_s
        with self.df.store.tx() as tx:
            tx.put_batch(batch.row())
        self.df.counters["batch_leases_extended"] += 1
        return batch.lease_expire

    def ack(self, batch_id: str) -> int:
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
        consumed = len(batch.groups)
        df = self.df
        df.counters["consumed_groups"] += consumed
        df.counters["consumed_trajectories"] += batch.num_trajectories
        with df.store.tx() as tx:
            tx.delete_groups(batch.stored_keys())
            tx.put_batch(batch.row())
            df.persist_counters(tx)
        batch.groups = []
        return consumed

    def _prune(self) -> None:
        finished = [b for b in self.batches.values() if b.state != "leased"]
        if len(finished) <= KEEP_FINISHED:
            return
        drop = finished[: len(finished) - KEEP_FINISHED]
        for b in drop:
            del self.batches[b.batch_id]
            self.by_request.pop((b.policy_id, b.request_id), None)
        with self.df.store.tx() as tx:
            tx.delete_batches(b.batch_id for b in drop)

    def expire(self, now: float) -> None:
        self._prune()
        for batch in self.batches.values():
            if batch.state != "leased" or batch.lease_expire >= now:
                continue
            batch.state = "expired"
            fresh = [g for g in batch.groups if not g.replay]
            self.df.buffers[batch.policy_id].put_back(fresh)
            self.df.counters["batch_leases_expired"] += 1
            with self.df.store.tx() as tx:
                tx.set_group_batch(batch.stored_keys(), None)
                tx.put_batch(batch.row())
                self.df.persist_counters(tx)
            batch.groups = []
