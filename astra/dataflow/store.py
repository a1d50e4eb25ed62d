"""Durable state of Dataflow in SQLite (WAL): survives `kill -9`.

Holds the work table (every dispatched group: pending, leased, done), the
buffered groups (their trajectory bytes in a `BlobLog` beside the database),
trainer batch leases (with their advantages and the bytes of their replayed copies, so a
leased batch is rebuilt exactly), each policy's replay memory (trained groups kept
for replay, in the order they entered), and small key/value state (dataset positions,
versions, counters). Every change that
Dataflow acknowledges to anyone is committed here first. WAL with
synchronous=NORMAL is durable against a process crash; only a power loss can
drop the last transactions. Checkpoints (WAL into the database file, with an
fsync) run on a thread of their own, so they never stall the committing event
loop. Knows nothing of gRPC or of the pool.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astra.damage import Damaged
from astra.dataflow.blobs import SEGMENT_BYTES, BlobLog, CorruptRecord, record_size, write_record
from astra.dataflow.records import GroupRecord, TrajectoryRecord
from astra.dataflow.sealed import damaged, fix_for, is_damage, quick_check, seal, unseal

# 2: batch_replays; a batch row's groups carry their advantages. A schema-1 directory is
# migrated on open (the new table is created; its batch rows are read without advantages).
# 3: replay_memory (a schema-1 or -2 directory opens with it empty).
# 4: folded_work (astra.dataflow.folding; an older directory opens with nothing folded).
# 5: blob records checksummed, kv values sealed (astra.dataflow.blobs, .sealed). An older
# directory opens with its segments read unchecked (kv `blob_checked_from`: the first
# segment written with checksums) and its unsealed values read as plain JSON.
# 6: batches.untrained_reason (an older directory's batches read as trained).
SCHEMA_VERSION = 6
CHECKED_FROM = "blob_checked_from"
WORK_STATES = ("pending", "leased", "done")  # what `Tx.set_work` writes
OPEN_ROW_IN_SPAN = (
    "SELECT 1 FROM work INDEXED BY work_state WHERE state IN ('pending', 'leased') AND {where}"
    " LIMIT 1"
)
SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS work (
    group_id TEXT PRIMARY KEY,
    stream TEXT NOT NULL,
    state TEXT NOT NULL,
    instance_id TEXT,
    lease_expire REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    outcome TEXT
);
CREATE INDEX IF NOT EXISTS work_state ON work(state);
CREATE TABLE IF NOT EXISTS folded_work (
    stream TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    done INTEGER NOT NULL,
    PRIMARY KEY (stream, epoch)
);
CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT NOT NULL,
    policy_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    batch_id TEXT,
    meta TEXT NOT NULL,
    seg INTEGER NOT NULL,
    off INTEGER NOT NULL,
    len INTEGER NOT NULL,
    PRIMARY KEY (group_id, policy_id)
);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    policy_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    trainer_id TEXT NOT NULL,
    state TEXT NOT NULL,
    lease_expire REAL NOT NULL,
    policy_version INTEGER NOT NULL,
    groups TEXT NOT NULL,
    untrained_reason TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS batches_request ON batches(policy_id, request_id);
CREATE TABLE IF NOT EXISTS batch_replays (
    batch_id TEXT NOT NULL,
    pos INTEGER NOT NULL,
    group_id TEXT NOT NULL,
    policy_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    meta TEXT NOT NULL,
    seg INTEGER NOT NULL,
    off INTEGER NOT NULL,
    len INTEGER NOT NULL,
    PRIMARY KEY (batch_id, pos)
);
CREATE TABLE IF NOT EXISTS replay_memory (
    entered INTEGER PRIMARY KEY,
    policy_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    meta TEXT NOT NULL,
    seg INTEGER NOT NULL,
    off INTEGER NOT NULL,
    len INTEGER NOT NULL,
    UNIQUE (policy_id, group_id)
);
"""


def is_storage_error(exc: BaseException) -> bool:
    """A failure of the store itself (SQLite or the blob log), not of its caller."""
    return isinstance(exc, (sqlite3.Error, OSError))


@dataclass(slots=True)
class WorkRow:
    group_id: str
    stream: str
    state: str
    instance_id: str | None
    lease_expire: float | None
    attempts: int
    outcome: str | None


@dataclass(slots=True)
class BatchRow:
    batch_id: str
    policy_id: str
    request_id: str
    trainer_id: str
    state: str
    lease_expire: float
    policy_version: int
    # (group_id, replay, advantages) in batch order; advantages None in a schema-1 row and
    # in a finished batch's row.
    group_keys: list[tuple[str, bool, list[float] | None]]
    # An acknowledged batch's groups not in the trainer's weights: why ("" trained).
    untrained_reason: str = ""


def _pack(trajectories: list[TrajectoryRecord]) -> tuple[str, list]:
    """(meta JSON, blob parts): each payload after its 4-byte length, the parts not joined
    (`BlobLog.append_parts` writes them with one writev)."""
    meta = [
        [t.trajectory_id, t.reward, t.min_version, t.max_version, t.num_tokens, t.failed]
        for t in trajectories
    ]
    parts = []
    for t in trajectories:
        parts += (_LENGTH.pack(len(t.payload)), t.payload)
    return json.dumps(meta), parts


_LENGTH = struct.Struct("<I")


def _same(a: list[TrajectoryRecord], b: list[TrajectoryRecord]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def unpack_trajectories(meta_json: str, blob: bytes) -> list[TrajectoryRecord]:
    out = []
    pos = 0
    for tid, reward, vmin, vmax, ntok, failed in json.loads(meta_json):
        (n,) = struct.unpack_from("<I", blob, pos)
        pos += 4
        if pos + n > len(blob):
            raise ValueError(f"a payload of {n} bytes at {pos} runs past the record")
        out.append(TrajectoryRecord(tid, reward, vmin, vmax, ntok, blob[pos : pos + n], failed))
        pos += n
    if pos != len(blob):
        raise ValueError(f"{len(blob) - pos} bytes after the last payload")
    return out


@dataclass(slots=True)
class BadRecord:
    """A stored record found corrupt at read (see `StateStore.corrupt`). `table`: groups,
    batch_replays or replay_memory; `batch_id`: the batch it is leased or replayed in."""

    table: str
    group_id: str
    policy_id: str
    batch_id: str | None
    pos: int | None
    error: CorruptRecord


@dataclass(slots=True)
class Staged:
    """A group's trajectory bytes, placed in the blob log before its row is written.

    `StateStore.stage` reserves the room (event loop), `write_staged` writes the bytes
    (any thread, e.g. off the event loop), then `Tx.add_groups(..., staged)` points the
    row at them. Room not used by a committed row is given back by `discard_staged`.
    """

    key: tuple[str, str]
    trajectories: list[TrajectoryRecord]
    meta: str
    parts: list
    segment: int
    offset: int
    length: int
    fd: int
    used: bool = False


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
        self.c.execute(
            "INSERT INTO work(group_id, stream, state, instance_id, lease_expire, attempts, outcome)"
            " VALUES(?, ?, ?, ?, ?, ?, ?) ON CONFLICT(group_id) DO UPDATE SET"
            " state=excluded.state, instance_id=excluded.instance_id,"
            " lease_expire=excluded.lease_expire, attempts=excluded.attempts,"
            " outcome=excluded.outcome",
            (group_id, stream, state, instance_id, lease_expire, attempts, outcome),
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
            "INSERT INTO folded_work(stream, epoch, done) VALUES(?, ?, ?) "
            "ON CONFLICT(stream, epoch) DO UPDATE SET done = done + excluded.done",
            (stream, epoch, n),
        )
        return n

    def add_groups(
        self, groups: Iterable[GroupRecord], staged: dict[tuple[str, str], Staged] | None = None
    ) -> None:
        """Inserts the groups' rows; their bytes are written now, or were (`staged`, for the
        same trajectories) before the transaction began."""
        for g in groups:
            st = staged.get((g.group_id, g.policy_id)) if staged else None
            if st is not None and not st.used and _same(st.trajectories, g.trajectories):
                st.used = True
                self.staged_used.append(st)
                meta, seg, off, length = st.meta, st.segment, st.offset, st.length
            else:
                meta, seg, off, length = self._append(g)
            # A group enters the store once (ingest de-duplicates by id): a second
            # insert is a bug and fails the transaction.
            self.c.execute(
                "INSERT INTO groups(group_id, policy_id, seq, epoch, batch_id, meta, seg, off, len)"
                " VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (g.group_id, g.policy_id, g.seq, g.epoch, None, meta, seg, off, length),
            )

    def _append(self, g: GroupRecord) -> tuple[str, int, int, int]:
        """Writes the group's trajectory bytes to the blob log: (meta, segment, offset, length)."""
        meta, parts = _pack(g.trajectories)
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
            "UPDATE groups SET batch_id=? WHERE group_id=? AND policy_id=?",
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
            self.c.execute(
                "INSERT INTO batch_replays(batch_id, pos, group_id, policy_id, seq, epoch, meta,"
                " seg, off, len) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, pos, g.group_id, g.policy_id, g.seq, g.epoch, meta, seg, off, length),
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
            ).rowcount
            if moved != 1:  # a trained group's row is in the store until now: a bug
                raise RuntimeError(f"group {group_id!r} of {policy_id!r} is not stored")
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
                "UPDATE folded_work SET done = done - 1 WHERE stream=? AND epoch=? AND done > 0",
                (stream, epoch),
            )
        self.set_work(group_id, stream, "pending")

    def put_batch(self, b: BatchRow) -> None:
        self.c.execute(
            "INSERT OR REPLACE INTO batches(batch_id, policy_id, request_id, trainer_id, state,"
            " lease_expire, policy_version, groups, untrained_reason)"
            " VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                b.batch_id,
                b.policy_id,
                b.request_id,
                b.trainer_id,
                b.state,
                b.lease_expire,
                b.policy_version,
                json.dumps([list(k) for k in b.group_keys]),
                b.untrained_reason,
            ),
        )

    def set_batch_untrained_reason(self, batch_ids: list[str], reason: str) -> None:
        """Only the reason: an acknowledged batch's row keeps its group keys."""
        self.c.executemany(
            "UPDATE batches SET untrained_reason=? WHERE batch_id=?",
            [(reason, b) for b in batch_ids],
        )


class StateStore:
    def __init__(self, state_dir: str | Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        path = Path(state_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / "dataflow.sqlite"
        # Records found corrupt by the reads below (`groups`, `replays`, `replay_memory`):
        # the caller quarantines them (`Tx.drop_record`).
        self.corrupt: list[BadRecord] = []
        try:
            self._open(path, segment_bytes)
        except sqlite3.DatabaseError as exc:
            if not is_damage(exc):
                raise
            raise damaged(self.path, exc) from exc

    def _open(self, path: Path, segment_bytes: int) -> None:
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        quick_check(self.conn, self.path)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, 1, 2, 3, 4, 5, SCHEMA_VERSION):
            raise Damaged(
                self.path,
                f"schema {version}, this build reads up to {SCHEMA_VERSION}",
                "run it with the build that wrote it, or start Dataflow on a new state_dir",
            )
        self.conn.executescript(SCHEMA)
        columns = {r[1] for r in self.conn.execute("PRAGMA table_info(batches)")}
        if "untrained_reason" not in columns:
            self.conn.execute(
                "ALTER TABLE batches ADD COLUMN untrained_reason TEXT NOT NULL DEFAULT ''"
            )
        self.blobs = BlobLog(path / "blobs", segment_bytes)
        checked_from = self.get(CHECKED_FROM)
        if checked_from is None:
            if version >= 5:  # written with checksums from the start
                raise Damaged(self.path, f"kv {CHECKED_FROM!r} is missing", fix_for(self.path))
            # From the segment this process opens on, the log is written with checksums.
            checked_from = self.blobs.active
            self.conn.execute(
                "INSERT INTO kv(key, value) VALUES(?, ?)",
                (CHECKED_FROM, seal(CHECKED_FROM, checked_from)),
            )
        self.blobs.checked_from = int(checked_from)
        self.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        for (seg,) in self.conn.execute(
            "SELECT seg FROM groups UNION ALL SELECT seg FROM batch_replays"
            " UNION ALL SELECT seg FROM replay_memory"
        ):
            self.blobs.adopt(seg)
        self.blobs.collect_garbage()
        # Checkpoints (WAL -> database file, with an fsync) run on a thread of their own:
        # done by the committing connection, as SQLite does by default, they stall the
        # caller's event loop for the fsync (tens of ms, sometimes 100+). The connection
        # below checkpoints itself only if the WAL outgrows WAL_LIMIT_BYTES, i.e. if the
        # thread never finds a moment without a commit in flight.
        self.conn.execute("PRAGMA wal_autocheckpoint=0")
        self.conn.execute(f"PRAGMA journal_size_limit={WAL_KEEP_BYTES}")
        self._wal = Path(f"{self.path}-wal")
        self._commits = 0
        self._checkpointer = _Checkpointer(self.path)
        # Called with the error when a transaction fails in storage (see `tx`).
        self.on_failure: Callable[[BaseException], None] | None = None

    @contextlib.contextmanager
    def tx(self, *, any_failure: bool = False) -> Iterator[Tx]:
        """One transaction. A storage failure in it (SQLite or the blob log: a full disk, an
        I/O error), at COMMIT too, is rolled back and reported to `on_failure` before it is
        raised: the caller's in-memory state may already hold what the store does not.
        `any_failure`: any other exception raised in the block is reported too (the caller
        changes its memory as it goes, which the rollback cannot undo)."""
        tx: Tx | None = None
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            tx = Tx(self.conn, self.blobs)
            yield tx
            self.conn.execute("COMMIT")
        except BaseException as exc:
            if tx is not None:
                with contextlib.suppress(sqlite3.Error):  # a failed COMMIT may have ended it
                    self.conn.execute("ROLLBACK")
                for seg in tx.appended:
                    self.blobs.release(seg)
                for st in tx.staged_used:  # back to its owner, who discards it
                    st.used = False
            reported = is_storage_error(exc) or (any_failure and isinstance(exc, Exception))
            if reported and self.on_failure is not None:
                self.on_failure(exc)
            raise
        for seg in tx.released:
            self.blobs.release(seg)
        self._commits += 1
        if self._commits % WAL_CHECK_EVERY == 0 and _size(self._wal) > WAL_LIMIT_BYTES:
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def stage(self, group: GroupRecord) -> Staged:
        """Reserves room for the group's bytes (see `Staged`); nothing is written yet."""
        meta, parts = _pack(group.trajectories)
        segment, offset, length, fd = self.blobs.reserve(record_size(sum(len(p) for p in parts)))
        return Staged(
            (group.group_id, group.policy_id),
            list(group.trajectories),
            meta,
            parts,
            segment,
            offset,
            length,
            fd,
        )

    @staticmethod
    def write_staged(staged: Iterable[Staged]) -> None:
        """Writes staged bytes into their room; safe on a thread other than the owner's."""
        for st in staged:
            write_record(st.fd, st.offset, st.parts)

    def discard_staged(self, staged: Iterable[Staged]) -> None:
        """Gives back the room of staged bytes that no committed row points at."""
        for st in staged:
            st.parts = []
            if not st.used:
                self.blobs.release(st.segment)

    def get(self, key: str, default: Any = None) -> Any:
        """The value stored under `key`; Damaged if it fails its seal (astra.dataflow.sealed)."""
        row = self.conn.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return default if row is None else unseal(self.path, key, row[0])

    def _load(
        self, table: str, gid: str, pid: str, batch_id, pos, meta: str, seg: int, off: int, n: int
    ) -> list[TrajectoryRecord] | None:
        """A row's trajectories, or None (the row noted in `corrupt`) if its record is not as
        written or does not decode."""
        try:
            blob = self.blobs.read(seg, off, n)
            try:
                return unpack_trajectories(meta, blob)
            except (ValueError, TypeError, struct.error) as exc:
                where = self.blobs.dir / f"{seg:08d}.seg"
                raise CorruptRecord(where, off, f"does not decode: {exc}") from exc
        except CorruptRecord as exc:
            self.corrupt.append(BadRecord(table, gid, pid, batch_id, pos, exc))
            return None

    def work_rows(self) -> list[WorkRow]:
        """Every row, done ones included, but for the folded epochs' (`folded`): the run's
        history, for accounting and tests."""
        return [WorkRow(*r) for r in self.conn.execute("SELECT * FROM work")]

    def unfinished_work(self) -> list[WorkRow]:
        """The rows of groups not done (waiting or leased): what a restart takes up again."""
        rows = self.conn.execute("SELECT * FROM work WHERE state != 'done'")
        return [WorkRow(*r) for r in rows]

    def is_done(self, group_id: str) -> bool:
        """True when the work table records the group as done, or its epoch was folded
        (inside a transaction, its writes so far count)."""
        row = self.conn.execute(
            "SELECT 1 FROM work WHERE group_id=? AND state='done'", (group_id,)
        ).fetchone()
        if row is not None:
            return True
        stream, _, rest = group_id.rpartition("/")
        stream, _, epoch = stream.rpartition("/")
        canonical = epoch.isascii() and epoch.isdigit() and str(int(epoch)) == epoch
        if not (stream and canonical and rest):  # not an id a dataset makes
            return False
        row = self.conn.execute(
            "SELECT 1 FROM folded_work WHERE stream=? AND epoch=?", (stream, int(epoch))
        ).fetchone()
        return row is not None

    def done_count(self) -> int:
        """Groups done: those of the work table and of its folded epochs."""
        (rows,) = self.conn.execute("SELECT COUNT(*) FROM work WHERE state='done'").fetchone()
        (folded,) = self.conn.execute("SELECT COALESCE(SUM(done), 0) FROM folded_work").fetchone()
        return rows + folded

    def newest_folded_epoch(self, stream: str) -> int | None:
        """The stream's newest epoch with a folded count (it may still have rows: folding goes
        a chunk per transaction), None when none has."""
        (newest,) = self.conn.execute(
            "SELECT MAX(epoch) FROM folded_work WHERE stream=?", (stream,)
        ).fetchone()
        return newest

    def folded(self) -> dict[tuple[str, int], int]:
        """(stream, epoch) -> groups done, of every folded epoch."""
        return {(s, e): n for s, e, n in self.conn.execute("SELECT * FROM folded_work")}

    def groups(self) -> list[tuple[GroupRecord, str | None]]:
        """Every stored group with the batch it is leased in (None if buffered)."""
        out = []
        for gid, pid, seq, epoch, batch_id, meta, seg, off, length in self.conn.execute(
            "SELECT group_id, policy_id, seq, epoch, batch_id, meta, seg, off, len FROM groups"
        ):
            trajectories = self._load("groups", gid, pid, batch_id, None, meta, seg, off, length)
            if trajectories is not None:
                out.append((GroupRecord(gid, pid, epoch, trajectories, seq=seq), batch_id))
        return out

    def batches(self) -> list[BatchRow]:
        out = []
        for row in self.conn.execute(
            "SELECT batch_id, policy_id, request_id, trainer_id, state, lease_expire,"
            " policy_version, groups, untrained_reason FROM batches"
        ):
            *head, groups, reason = row
            try:
                entries = json.loads(groups)
            except ValueError as exc:
                what = f"batch {head[0]}'s groups are not JSON ({exc})"
                raise Damaged(self.path, what, fix_for(self.path)) from exc
            keys = [(k[0], bool(k[1]), k[2] if len(k) > 2 else None) for k in entries]
            out.append(BatchRow(*head, keys, reason))
        return out

    def replays(self) -> dict[str, dict[int, GroupRecord]]:
        """The stored replayed copies: batch id -> position in the batch -> copy."""
        out: dict[str, dict[int, GroupRecord]] = {}
        for batch_id, pos, gid, pid, seq, epoch, meta, seg, off, length in self.conn.execute(
            "SELECT batch_id, pos, group_id, policy_id, seq, epoch, meta, seg, off, len"
            " FROM batch_replays"
        ):
            got = self._load("batch_replays", gid, pid, batch_id, pos, meta, seg, off, length)
            if got is not None:
                group = GroupRecord(gid, pid, epoch, got, seq=seq, replay=True)
                out.setdefault(batch_id, {})[pos] = group
        return out

    def replay_memory(self) -> dict[str, list[GroupRecord]]:
        """Each policy's replay memory, oldest to enter first."""
        out: dict[str, list[GroupRecord]] = {}
        for gid, pid, seq, epoch, meta, seg, off, length in self.conn.execute(
            "SELECT group_id, policy_id, seq, epoch, meta, seg, off, len FROM replay_memory"
            " ORDER BY entered"
        ):
            got = self._load("replay_memory", gid, pid, None, None, meta, seg, off, length)
            if got is not None:
                group = GroupRecord(gid, pid, epoch, got, seq=seq, replay=True)
                out.setdefault(pid, []).append(group)
        return out

    def close(self) -> None:
        self._checkpointer.stop()
        self.conn.close()
        self.blobs.close()


# The checkpoint thread checkpoints every WAL_CHECKPOINT_S (SQLite's default, 1000 pages
# ~4 MB, comes every ~0.5 s under full ingest). A WAL that was checkpointed to the end
# restarts from its beginning and is cut back to WAL_KEEP_BYTES.
WAL_CHECKPOINT_S = 0.5
WAL_KEEP_BYTES = 16 << 20
WAL_LIMIT_BYTES = 64 << 20
WAL_CHECK_EVERY = 64


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class _Checkpointer:
    """A daemon thread with its own connection that runs PASSIVE checkpoints.

    PASSIVE never blocks writers or readers; SQLite releases the GIL while it copies
    and fsyncs, so the event loop keeps committing meanwhile. Durability is unchanged:
    a commit is in the WAL (synchronous=NORMAL) before anything is acknowledged.
    """

    def __init__(self, db: Path) -> None:
        self._db = db
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sqlite-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = sqlite3.connect(self._db, isolation_level=None, check_same_thread=False)
        try:
            while not self._stop.wait(WAL_CHECKPOINT_S):
                with contextlib.suppress(sqlite3.Error):  # busy or closing: next round
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
