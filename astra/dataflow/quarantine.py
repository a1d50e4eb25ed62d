"""Corrupt stored records found at start-up: quarantined, counted, dispatched again.

`StateStore` checks every blob record it reads back (astra.dataflow.blobs) and
lists those that are not as written. At the end of recovery `quarantine` deletes
their rows (never trained), counts each in `records_corrupt`, logs the file and
offset, and sends a fresh group (buffered, or leased to a trainer) back to be
dispatched: its work row pending again. A replayed copy or a replay-memory entry
belongs to a group trained already: dropped and counted, not dispatched.

Such a group is dispatched with `regenerate` set (a RaaS that acknowledged its
id before runs it again) and for the policies whose record was lost only: `Redo`
remembers them (kv `redo_policies`, so a restart dispatches it the same way), and
ingest keeps the new result's parts of those policies and drops the others' (their
first result is buffered or trained already): nothing is trained twice.
Never imports gRPC.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from astra.dataflow.records import TrajectoryRecord
from astra.dataflow.work import Work, WorkTable

if TYPE_CHECKING:
    from astra.dataflow.ledger import Ledger
    from astra.dataflow.store import StateStore
    from astra.dataflow.store_schema import BadRecord

log = logging.getLogger("astra.dataflow.coordinator")
KEY = "redo_policies"


class Redo:
    """Groups dispatched again for some of their policies: group id -> those policies."""

    def __init__(self, saved: dict[str, list[str]] | None) -> None:
        self.policies: dict[str, list[str]] = dict(saved or {})

    def restrict(
        self, group_id: str, per_policy: dict[str, list[TrajectoryRecord]]
    ) -> tuple[dict[str, list[TrajectoryRecord]], int]:
        """The parts of a result to take, and how many parts were dropped (already stored)."""
        only = self.policies.get(group_id)
        if only is None:
            return per_policy, 0
        kept = {p: t for p, t in per_policy.items() if p in only}
        return kept, len(per_policy) - len(kept)

    def wanted(self, group_id: str, policy_ids) -> list[str]:
        """The policies whose part of the group's result is still missing."""
        only = self.policies.get(group_id)
        return list(policy_ids) if only is None else [p for p in policy_ids if p in only]

    def finish(self, tx, group_id: str) -> None:
        """The group has its outcome: forgotten (durably, in the caller's transaction)."""
        if self.policies.pop(group_id, None) is not None:
            tx.put(KEY, self.policies)


def quarantine(
    store: StateStore, table: WorkTable, ledger: Ledger, redo: Redo, bad: list[BadRecord]
) -> None:
    """Drops the rows of corrupt records and dispatches their fresh groups again, durably."""
    if not bad:
        return
    counters = ledger.counters
    again: dict[str, set[str]] = {}
    with store.tx() as tx:
        for b in bad:
            tx.drop_record(b)
            counters["records_corrupt"] += 1
            fresh = b.table == "groups"
            log.error(
                "corrupt record quarantined (never trained): %s at offset %d: %s; group %s of "
                "policy %s (%s)%s",
                b.error.path,
                b.error.offset,
                b.error.reason,
                b.group_id,
                b.policy_id,
                b.table,
                ": dispatched again" if fresh else ": trained already, dropped",
            )
            if fresh:
                again.setdefault(b.group_id, set()).add(b.policy_id)
                # Its slot in the off-policy bound is free again (as `Ledger.let_go`).
                ledger.accepted[b.policy_id] = max(0, ledger.accepted[b.policy_id] - 1)
        for group_id, policies in sorted(again.items()):
            stream = group_id.rpartition("/")[0].rpartition("/")[0]
            source = table.sources.get(stream)
            try:
                item = source.item_for(group_id) if source is not None else None
            except ValueError:
                item = None
            if item is None or group_id in table.work:
                counters["records_corrupt_lost"] += 1
                log.error(
                    "group %s cannot be dispatched again: not of a configured stream", group_id
                )
                continue
            table.work[group_id] = Work(replace(item, regenerate=True), stream)
            table.waiting.appendleft(group_id)
            table.done.reopen(group_id)
            tx.reopen_work(group_id, stream, item.epoch)
            redo.policies[group_id] = sorted(policies)
            counters["records_corrupt_redispatched"] += 1
        tx.put(KEY, redo.policies)
        ledger.persist(tx)
