"""The state store's layout: the SQLite schema, its rows, and how a group's trajectories are
packed into one blob-log record (astra.dataflow.store reads and writes them). Data only: no
connection, no I/O.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from dataclasses import dataclass

from astra.dataflow.blobs import CorruptRecord
from astra.dataflow.records import BatchRow, GroupRecord, TrajectoryRecord
from astra.dataflow.sealed import open_text, seal_text

# 2: batch_replays; a batch row's groups carry their advantages. A schema-1 directory is
# migrated on open (the new table is created; its batch rows are read without advantages).
# 3: replay_memory (a schema-1 or -2 directory opens with it empty).
# 4: folded_work (astra.dataflow.folding; an older directory opens with nothing folded).
# 5: blob records checksummed, kv values sealed (astra.dataflow.blobs, .sealed). An older
# directory opens with its segments read unchecked (kv `blob_checked_from`: the first
# segment written with checksums) and its unsealed values read as plain JSON.
# 6: batches.untrained_reason (an older directory's batches read as trained).
# 7: a row's meta and a batch row's groups sealed (a CRC-32 of the row's ids and the JSON,
# before the JSON); an older row's unsealed JSON is read as plain JSON.
# 8: every row of every table sealed (its `seal` column: astra.dataflow.row_seals), and
# acked_versions (per policy and batch version, the batches acknowledged as trained and not
# counted discarded since, and their fresh groups: astra.dataflow.batches). An older database is migrated on open: its rows are
# sealed as they stand, acked_versions counted from the batch rows it still holds.
SCHEMA_VERSION = 8
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
    outcome TEXT,
    seal INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS work_state ON work(state);
CREATE TABLE IF NOT EXISTS folded_work (
    stream TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    done INTEGER NOT NULL,
    seal INTEGER NOT NULL DEFAULT 0,
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
    seal INTEGER NOT NULL DEFAULT 0,
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
    untrained_reason TEXT NOT NULL DEFAULT '',
    seal INTEGER NOT NULL DEFAULT 0
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
    seal INTEGER NOT NULL DEFAULT 0,
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
    seal INTEGER NOT NULL DEFAULT 0,
    UNIQUE (policy_id, group_id)
);
CREATE TABLE IF NOT EXISTS acked_versions (
    policy_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    batches INTEGER NOT NULL,
    groups INTEGER NOT NULL,
    seal INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (policy_id, version)
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


def pack(group: GroupRecord) -> tuple[str, list]:
    """(sealed meta, blob parts): each payload after its 4-byte length, the parts not joined
    (`BlobLog.append_parts` writes them with one writev). The meta (each trajectory's id,
    reward, versions, token count) is sealed under the group's and policy's ids, so a
    reward changed at rest is found, not trained (astra.dataflow.sealed)."""
    meta = [
        [t.trajectory_id, t.reward, t.min_version, t.max_version, t.num_tokens, t.failed]
        for t in group.trajectories
    ]
    parts: list[bytes] = []
    for t in group.trajectories:
        parts += (_LENGTH.pack(len(t.payload)), t.payload)
    return seal_text(_meta_key(group.group_id, group.policy_id), json.dumps(meta)), parts


def batch_key(batch_id: str, policy_id: str, policy_version: int) -> str:
    """What a batch row's groups (ids, replay flags, advantages) are sealed under (schema 7)."""
    return f"batch {batch_id} {policy_id} {policy_version}"


def groups_json(b: BatchRow) -> str:
    return json.dumps([list(k) for k in b.group_keys])


def batch_groups(batch_id: str, policy_id: str, policy_version: int, stored: str) -> list:
    """A batch row's group entries ([group_id, replay] or [group_id, replay, advantages]),
    its seal checked; ValueError if it fails or is not JSON. For every reader of the row."""
    return json.loads(open_text(batch_key(batch_id, policy_id, policy_version), stored))


def _meta_key(group_id: str, policy_id: str) -> str:
    return f"meta {group_id} {policy_id}"


_LENGTH = struct.Struct("<I")


def same(a: list[TrajectoryRecord], b: list[TrajectoryRecord]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def unpack_trajectories(
    meta: str, blob: bytes, group_id: str, policy_id: str
) -> list[TrajectoryRecord]:
    """The trajectories of a stored row; ValueError if its meta fails its seal or the record
    does not decode."""
    out = []
    pos = 0
    text = open_text(_meta_key(group_id, policy_id), meta)
    for tid, reward, vmin, vmax, ntok, failed in json.loads(text):
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
