"""Durable state of Dataflow in SQLite (WAL): survives `kill -9`.

Holds the work table (every dispatched group: pending, leased, done), the
buffered groups (their trajectory bytes in a `BlobLog` beside the database),
trainer batch leases (with their advantages and the bytes of their replayed copies, so a
leased batch is rebuilt exactly), each policy's replay memory (trained groups kept
for replay, in the order they entered), and small key/value state (dataset positions,
versions, counters), every row and value sealed (astra.dataflow.row_seals,
.sealed: checked at each start and on every read). Every change that
Dataflow acknowledges to anyone is committed here first. WAL with
synchronous=NORMAL is durable against a process crash; only a power loss can
drop the last transactions. A transaction opened `durable` (a trainer's batch
acknowledgement) is committed with synchronous=FULL: the WAL is fsynced before it
returns, and with it every transaction before it, so no power loss takes back a
batch a trainer was told is acknowledged. Checkpoints (WAL into the database file, with an
fsync) run on a thread of their own, so they never stall the committing event
loop. Knows nothing of gRPC or of the pool.
"""

from __future__ import annotations

import contextlib
import sqlite3
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from astra.damage import Damaged
from astra.dataflow import row_seals
from astra.dataflow.blobs import SEGMENT_BYTES, BlobLog, CorruptRecord, record_size, write_record
from astra.dataflow.records import BatchRow, GroupRecord, TrajectoryRecord
from astra.dataflow.sealed import (
    damaged,
    fix_for,
    is_damage,
    quick_check,
    seal,
    unseal,
)
from astra.dataflow.store_schema import (
    CHECKED_FROM,
    SCHEMA_VERSION,
    BadRecord,
    Staged,
    WorkRow,
    batch_groups,
    is_storage_error,
    pack,
    unpack_trajectories,
)
from astra.dataflow.store_tx import Tx
from astra.dataflow.store_upgrade import upgrade

__all__ = ["BadRecord", "BatchRow", "StateStore", "Tx", "WorkRow", "is_storage_error"]


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
        row_seals.register(self.conn)
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if not 0 <= version <= SCHEMA_VERSION:
            raise Damaged(
                self.path,
                f"schema {version}, this build reads up to {SCHEMA_VERSION}",
                "run it with the build that wrote it, or start Dataflow on a new state_dir",
            )
        self.conn.execute("BEGIN IMMEDIATE")  # a migration is all or nothing
        try:
            self._migrate(path, version, segment_bytes)
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")
        # Every row as written (astra.dataflow.row_seals): a value changed in place stops
        # the start here, naming its table and row.
        row_seals.verify_all(self.conn, self.path)
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

    def _migrate(self, path: Path, version: int, segment_bytes: int) -> None:
        """Brings a database of schema `version` to SCHEMA_VERSION (inside a transaction) and
        opens the blob log."""
        upgrade(self.conn, self.path, version)
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

    @contextlib.contextmanager
    def tx(self, *, any_failure: bool = False, durable: bool = False) -> Iterator[Tx]:
        """One transaction. A storage failure in it (SQLite or the blob log: a full disk, an
        I/O error), at COMMIT too, is rolled back and reported to `on_failure` before it is
        raised: the caller's in-memory state may already hold what the store does not.
        `any_failure`: any other exception raised in the block is reported too (the caller
        changes its memory as it goes, which the rollback cannot undo).
        `durable`: the commit fsyncs the WAL (synchronous=FULL for this transaction)."""
        tx: Tx | None = None
        try:
            if durable:
                self.conn.execute("PRAGMA synchronous=FULL")
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
        finally:
            if durable:
                with contextlib.suppress(sqlite3.Error):
                    self.conn.execute("PRAGMA synchronous=NORMAL")
        for seg in tx.released:
            self.blobs.release(seg)
        self._commits += 1
        if self._commits % WAL_CHECK_EVERY == 0 and _size(self._wal) > WAL_LIMIT_BYTES:
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def stage(self, group: GroupRecord) -> Staged:
        """Reserves room for the group's bytes (see `Staged`); nothing is written yet."""
        meta, parts = pack(group)
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

    def _rows(self, table: str, where: str = "", params=(), **kw) -> Iterator[tuple]:
        """The table's rows, each checked against its seal (Damaged, naming the row, if one
        fails: astra.dataflow.row_seals)."""
        return row_seals.rows(self.conn, self.path, table, where, params, **kw)

    def acked_since(self, policy_id: str, version: int) -> tuple[int, int]:
        """(batches, fresh groups) of the policy acknowledged as trained at `version` or later
        and not counted discarded since (acked_versions), however long ago."""
        found = self._rows("acked_versions", "policy_id=? AND version>=?", (policy_id, version))
        batches = groups = 0
        for _, _, b, g in found:
            batches, groups = batches + b, groups + g
        return batches, groups

    def _load(
        self, table: str, gid: str, pid: str, batch_id, pos, meta: str, seg: int, off: int, n: int
    ) -> list[TrajectoryRecord] | None:
        """A row's trajectories, or None (the row noted in `corrupt`) if its record is not as
        written or does not decode."""
        try:
            blob = self.blobs.read(seg, off, n)
            try:
                return unpack_trajectories(meta, blob, gid, pid)
            except (ValueError, TypeError, struct.error) as exc:
                where = self.blobs.dir / f"{seg:08d}.seg"
                raise CorruptRecord(where, off, f"does not decode: {exc}") from exc
        except CorruptRecord as exc:
            self.corrupt.append(BadRecord(table, gid, pid, batch_id, pos, exc))
            return None

    def work_rows(self) -> list[WorkRow]:
        """Every row, done ones included, but for the folded epochs' (`folded`): the run's
        history, for accounting and tests."""
        return [WorkRow(*r) for r in self._rows("work")]

    def unfinished_work(self) -> list[WorkRow]:
        """The rows of groups not done (waiting or leased): what a restart takes up again."""
        return [WorkRow(*r) for r in self._rows("work", "state != 'done'")]

    def is_done(self, group_id: str) -> bool:
        """True when the work table records the group as done, or its epoch was folded
        (inside a transaction, its writes so far count)."""
        if next(self._rows("work", "group_id=? AND state='done'", (group_id,)), None):
            return True
        stream, _, rest = group_id.rpartition("/")
        stream, _, epoch = stream.rpartition("/")
        canonical = epoch.isascii() and epoch.isdigit() and str(int(epoch)) == epoch
        if not (stream and canonical and rest):  # not an id a dataset makes
            return False
        found = self._rows("folded_work", "stream=? AND epoch=?", (stream, int(epoch)))
        return next(found, None) is not None

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
        return {(s, e): n for s, e, n in self._rows("folded_work")}

    def groups(self) -> list[tuple[GroupRecord, str | None]]:
        """Every stored group with the batch it is leased in (None if buffered)."""
        out = []
        for gid, pid, seq, epoch, batch_id, seg, off, length, meta in self._rows(
            "groups", extra=("meta",)
        ):
            trajectories = self._load("groups", gid, pid, batch_id, None, meta, seg, off, length)
            if trajectories is not None:
                out.append((GroupRecord(gid, pid, epoch, trajectories, seq=seq), batch_id))
        return out

    def batches(self) -> list[BatchRow]:
        out = []
        for row in self._rows("batches", extra=("groups",)):
            batch_id, policy_id, request_id, trainer_id, state, expire, version, reason, groups = (
                row
            )
            try:
                entries = batch_groups(batch_id, policy_id, version, groups)
            except ValueError as exc:
                what = f"batch {batch_id}'s groups are damaged ({exc})"
                raise Damaged(self.path, what, fix_for(self.path)) from exc
            keys = [(k[0], bool(k[1]), k[2] if len(k) > 2 else None) for k in entries]
            out.append(
                BatchRow(
                    batch_id,
                    policy_id,
                    request_id,
                    trainer_id,
                    state,
                    expire,
                    version,
                    keys,
                    reason,
                )
            )
        return out

    def replays(self) -> dict[str, dict[int, GroupRecord]]:
        """The stored replayed copies: batch id -> position in the batch -> copy."""
        out: dict[str, dict[int, GroupRecord]] = {}
        for batch_id, pos, gid, pid, seq, epoch, seg, off, length, meta in self._rows(
            "batch_replays", extra=("meta",)
        ):
            got = self._load("batch_replays", gid, pid, batch_id, pos, meta, seg, off, length)
            if got is not None:
                group = GroupRecord(gid, pid, epoch, got, seq=seq, replay=True)
                out.setdefault(batch_id, {})[pos] = group
        return out

    def replay_memory(self) -> dict[str, list[GroupRecord]]:
        """Each policy's replay memory, oldest to enter first."""
        out: dict[str, list[GroupRecord]] = {}
        for pid, gid, _entered, seq, epoch, seg, off, length, meta in self._rows(
            "replay_memory", extra=("meta",), order="entered"
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
