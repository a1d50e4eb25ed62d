"""One transaction of the state store: the writes Dataflow makes, all or none.

`Tx` is what `StateStore.tx()` yields (astra.dataflow.store): work rows, buffered groups
(their bytes appended to the blob log, or pointed at bytes staged ahead), batches, replay
memory and sealed key/value state. It never commits on its own and never reads state back.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import Any

from astra.dataflow.blobs import BlobLog
from astra.dataflow.records import BatchRow, GroupRecord
from astra.dataflow.row_seals import seal_of, seal_sql
from astra.dataflow.sealed import seal, seal_text
from astra.dataflow.store_schema import (
    OPEN_ROW_IN_SPAN,
    WORK_STATES,
    BadRecord,
    Staged,
    batch_key,
    groups_json,
    pack,
    same,
)


class Tx:
    """Operations inside one transaction."""

    def __init__(self, conn: sqlite3.Connection, blobs: BlobLog) -> None:
        self.c = conn
        self.blobs = blobs
        self.appended: list[int] = []
        self.released: list[int] = []
        self.staged_used: list[Staged] = []

    def put(self, key: str, value: Any) -> None:
        self.c.execute(
            "INSERT INTO kv(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, seal(key, value)),
        )

    def set_work(
        self,
        group_id: str,
        stream: str,
        state: str,
        *,
        instance_id: str | None = None,
        lease_expire: float | None = None,
        attempts: int = 0,
        outcome: str | None = None,
    ) -> None:
        if state not in WORK_STATES:  # the folding query reads the others as open
            raise ValueError(f"work state {state!r} is not one of {WORK_STATES}")
        row = (group_id, stream, state, instance_id, lease_expire, attempts, outcome)
        self.c.execute(
            "INSERT INTO work(group_id, stream, state, instance_id, lease_expire, attempts,"
            " outcome, seal) VALUES(?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(group_id) DO UPDATE SET"
            " stream=excluded.stream, state=excluded.state, instance_id=excluded.instance_id,"
            " lease_expire=excluded.lease_expire, attempts=excluded.attempts,"
            " outcome=excluded.outcome, seal=excluded.seal",
            (*row, seal_of("work", row)),
        )

    def fold_epoch(self, stream: str, epoch: int, limit: int) -> int | None:
        """Moves up to `limit` work rows of the stream's epoch (ids ``<stream>/<epoch>/<index>``)
        into its folded_work count, all done; None, changing nothing, while one of them is
        waiting or leased. Returns the rows folded (fewer than `limit`: the epoch is all
        folded; astra.dataflow.folding)."""
        # Ids with that prefix are exactly those in [prefix, prefix with "/" -> "0"): "0"
        # follows "/" in SQLite's default (BINARY) collation. Not done: the states of
        # WORK_STATES but "done", which the work_state index finds among the few rows in
        # flight (tests/test_dataflow_folding.py holds the query plan to it).
        span = (f"{stream}/{epoch}/", f"{stream}/{epoch}0", stream)
        where = "group_id >= ? AND group_id < ? AND stream = ?"
        open_ = self.c.execute(OPEN_ROW_IN_SPAN.format(where=where), span).fetchone()
        if open_ is not None:
            return None
        n = self.c.execute(
            f"DELETE FROM work WHERE rowid IN (SELECT rowid FROM work WHERE {where} LIMIT ?)",
            (*span, limit),
        ).rowcount
        self.c.execute(
            "INSERT INTO folded_work(stream, epoch, done, seal) VALUES(?, ?, ?, ?) "
            "ON CONFLICT(stream, epoch) DO UPDATE SET done = done + excluded.done, "
            f"seal = {seal_sql('folded_work', done='done + excluded.done')}",
            (stream, epoch, n, seal_of("folded_work", (stream, epoch, n))),
        )
        return n

    def add_groups(
        self, groups: Iterable[GroupRecord], staged: dict[tuple[str, str], Staged] | None = None
    ) -> None:
        """Inserts the groups' rows; their bytes are written now, or were (`staged`, for the
        same trajectories) before the transaction began."""
        for g in groups:
            st = staged.get((g.group_id, g.policy_id)) if staged else None
            if st is not None and not st.used and same(st.trajectories, g.trajectories):
                st.used = True
                self.staged_used.append(st)
                meta, seg, off, length = st.meta, st.segment, st.offset, st.length
            else:
                meta, seg, off, length = self._append(g)
            # A group enters the store once (ingest de-duplicates by id): a second
            # insert is a bug and fails the transaction.
            row = (g.group_id, g.policy_id, g.seq, g.epoch, None, seg, off, length)
            self.c.execute(
                "INSERT INTO groups(group_id, policy_id, seq, epoch, batch_id, seg, off, len,"
                " seal, meta) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*row, seal_of("groups", row), meta),
            )

    def _append(self, g: GroupRecord) -> tuple[str, int, int, int]:
        """Writes the group's trajectory bytes to the blob log: (meta, segment, offset, length)."""
        meta, parts = pack(g)
        seg, off, length = self.blobs.append_parts(parts)
        self.appended.append(seg)
        return meta, seg, off, length

    def delete_groups(self, keys: Iterable[tuple[str, str]]) -> None:
        for group_id, policy_id in keys:
            rows = self.c.execute(
                "DELETE FROM groups WHERE group_id=? AND policy_id=? RETURNING seg",
                (group_id, policy_id),
            ).fetchall()
            self.released.extend(r[0] for r in rows)

    def set_group_batch(self, keys: Iterable[tuple[str, str]], batch_id: str | None) -> None:
        self.c.executemany(
            f"UPDATE groups SET batch_id=?1, seal={seal_sql('groups', batch_id='?1')}"
            " WHERE group_id=?2 AND policy_id=?3",
            [(batch_id, g, p) for g, p in keys],
        )

    def delete_batches(self, batch_ids: Iterable[str]) -> None:
        batch_ids = list(batch_ids)
        self.delete_replays(batch_ids)
        self.c.executemany("DELETE FROM batches WHERE batch_id=?", [(b,) for b in batch_ids])

    def add_replays(self, batch_id: str, groups: Iterable[tuple[int, GroupRecord]]) -> None:
        """Stores the replayed copies of a leased batch, each at its position in the batch:
        their originals' rows may be gone (trained and deleted) by the time the batch has to
        be rebuilt after a restart."""
        for pos, g in groups:
            meta, seg, off, length = self._append(g)
            row = (batch_id, pos, g.group_id, g.policy_id, g.seq, g.epoch, seg, off, length)
            self.c.execute(
                "INSERT INTO batch_replays(batch_id, pos, group_id, policy_id, seq, epoch, seg,"
                " off, len, seal, meta) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*row, seal_of("batch_replays", row), meta),
            )

    def delete_replays(self, batch_ids: Iterable[str]) -> None:
        for batch_id in batch_ids:
            rows = self.c.execute(
                "DELETE FROM batch_replays WHERE batch_id=? RETURNING seg", (batch_id,)
            ).fetchall()
            self.released.extend(r[0] for r in rows)

    def move_to_replay(self, policy_id: str, group_ids: Iterable[str]) -> None:
        """Trained groups' rows become replay memory, newest last; their bytes stay where they
        are in the blob log (one row per blob reference, moved)."""
        for group_id in group_ids:
            self._forget_replay(policy_id, group_id)  # entered again: only the newest row
            moved = self.c.execute(
                "INSERT INTO replay_memory(policy_id, group_id, seq, epoch, meta, seg, off, len)"
                " SELECT policy_id, group_id, seq, epoch, meta, seg, off, len FROM groups"
                " WHERE group_id=? AND policy_id=?",
                (group_id, policy_id),
            )
            if moved.rowcount != 1:  # a trained group's row is in the store until now: a bug
                raise RuntimeError(f"group {group_id!r} of {policy_id!r} is not stored")
            self.c.execute(  # sealed with the place it entered at
                f"UPDATE replay_memory SET seal={seal_sql('replay_memory')} WHERE entered=?",
                (moved.lastrowid,),
            )
            self.c.execute(
                "DELETE FROM groups WHERE group_id=? AND policy_id=?", (group_id, policy_id)
            )

    def forget_replays(self, policy_id: str, group_ids: Iterable[str]) -> None:
        """Groups that left replay memory (evicted, expired)."""
        for group_id in group_ids:
            self._forget_replay(policy_id, group_id)

    def _forget_replay(self, policy_id: str, group_id: str) -> None:
        rows = self.c.execute(
            "DELETE FROM replay_memory WHERE policy_id=? AND group_id=? RETURNING seg",
            (policy_id, group_id),
        ).fetchall()
        self.released.extend(r[0] for r in rows)

    def drop_record(self, bad: BadRecord) -> None:
        """Deletes the row of a corrupt record (its bytes are released with it)."""
        if bad.table == "groups":
            self.delete_groups([(bad.group_id, bad.policy_id)])
        elif bad.table == "replay_memory":
            self._forget_replay(bad.policy_id, bad.group_id)
        else:
            rows = self.c.execute(
                "DELETE FROM batch_replays WHERE batch_id=? AND pos=? RETURNING seg",
                (bad.batch_id, bad.pos),
            ).fetchall()
            self.released.extend(r[0] for r in rows)

    def reopen_work(self, group_id: str, stream: str, epoch: int) -> None:
        """A done group is to be dispatched again: its row pending (out of its epoch's folded
        count if it was folded, so the group is counted done once when it completes)."""
        row = self.c.execute("SELECT 1 FROM work WHERE group_id=?", (group_id,)).fetchone()
        if row is None:
            self.c.execute(
                "UPDATE folded_work SET done = done - 1,"
                f" seal = {seal_sql('folded_work', done='done - 1')}"
                " WHERE stream=? AND epoch=? AND done > 0",
                (stream, epoch),
            )
        self.set_work(group_id, stream, "pending")

    def put_batch(self, b: BatchRow) -> None:
        row = (
            b.batch_id,
            b.policy_id,
            b.request_id,
            b.trainer_id,
            b.state,
            b.lease_expire,
            b.policy_version,
            b.untrained_reason,
        )
        self.c.execute(
            "INSERT OR REPLACE INTO batches(batch_id, policy_id, request_id, trainer_id, state,"
            " lease_expire, policy_version, untrained_reason, seal, groups)"
            " VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                *row,
                seal_of("batches", row),
                seal_text(batch_key(b.batch_id, b.policy_id, b.policy_version), groups_json(b)),
            ),
        )

    def set_batch_untrained_reason(self, batch_ids: list[str], reason: str) -> None:
        """Only the reason: an acknowledged batch's row keeps its group keys."""
        self.c.executemany(
            "UPDATE batches SET untrained_reason=?1,"
            f" seal={seal_sql('batches', untrained_reason='?1')} WHERE batch_id=?2",
            [(reason, b) for b in batch_ids],
        )

    def add_acked(self, policy_id: str, version: int, groups: int) -> None:
        """A batch at `version` with `groups` fresh groups, acknowledged as trained."""
        row = (policy_id, version, 1, groups)
        self.c.execute(
            "INSERT INTO acked_versions(policy_id, version, batches, groups, seal)"
            " VALUES(?, ?, ?, ?, ?) ON CONFLICT(policy_id, version) DO UPDATE SET"
            " batches = batches + 1, groups = groups + excluded.groups, seal = "
            + seal_sql("acked_versions", batches="batches + 1", groups="groups + excluded.groups"),
            (*row, seal_of("acked_versions", row)),
        )

    def forget_acked_since(self, policy_id: str, version: int) -> None:
        """The policy's acked_versions at `version` or later: counted discarded now."""
        self.c.execute(
            "DELETE FROM acked_versions WHERE policy_id=? AND version>=?", (policy_id, version)
        )
