"""Every row of Dataflow's tables, sealed: a CRC-32 over its columns, keyed by its table.

`PRAGMA quick_check` finds a damaged page; it cannot find a value changed in place and
still well formed (a work item marked done, a batch's state flipped to acknowledged, a
group id in a batch row changed). So each row of the work, folded_work, groups, batches,
batch_replays, replay_memory and acked_versions tables carries `seal`: the CRC-32 of the
table's name and the row's columns, its key columns included, so that a row whose values
were swapped with another row's fails too. The columns that carry a seal of their own (a
row's `meta`, a batch row's `groups`: astra.dataflow.store_schema) are not sealed twice.

The seal is computed in Python for a row written whole (`seal_of`) and in SQL, through the
`row_seal` function `register` adds to a connection, for a row changed in place
(`seal_sql`). `check` verifies a row read back; `verify_all` every row of every table
(each start, and `astra doctor`). A row that fails is Damaged: one line naming the file,
the table, the row's key and what to do. Never imports gRPC; knows nothing of the rows'
meaning.
"""

from __future__ import annotations

import sqlite3
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from astra.damage import Damaged
from astra.dataflow.sealed import fix_for

ROWS_SEALED_FROM = 8  # the schema (PRAGMA user_version) that seals rows

# Per table, the columns sealed, key columns first (KEY_COLUMNS of them name the row).
COLUMNS: dict[str, tuple[str, ...]] = {
    "work": ("group_id", "stream", "state", "instance_id", "lease_expire", "attempts", "outcome"),
    "folded_work": ("stream", "epoch", "done"),
    "groups": ("group_id", "policy_id", "seq", "epoch", "batch_id", "seg", "off", "len"),
    "batches": (
        "batch_id",
        "policy_id",
        "request_id",
        "trainer_id",
        "state",
        "lease_expire",
        "policy_version",
        "untrained_reason",
    ),
    "batch_replays": (
        "batch_id",
        "pos",
        "group_id",
        "policy_id",
        "seq",
        "epoch",
        "seg",
        "off",
        "len",
    ),
    "replay_memory": ("policy_id", "group_id", "entered", "seq", "epoch", "seg", "off", "len"),
    "acked_versions": ("policy_id", "version", "batches", "groups"),
}
KEY_COLUMNS = {
    "work": 1,
    "folded_work": 2,
    "groups": 2,
    "batches": 1,
    "batch_replays": 2,
    "replay_memory": 2,
    "acked_versions": 2,
}


def _text(v: object) -> str:
    """A column's value as sealed: a number the same whichever way SQLite's affinity stored
    it (5 bound to a REAL column reads back 5.0), NULL distinct from every string."""
    if v is None:
        return "\x01"
    if isinstance(v, str):
        return "s" + v
    if isinstance(v, float) and not v.is_integer():  # also inf and nan
        return "n" + repr(v)
    if isinstance(v, (int, float)):  # bool too
        return "n" + str(int(v))
    if isinstance(v, bytes):
        return "b" + v.hex()
    raise TypeError(f"a column of type {type(v).__name__} cannot be sealed")


def seal_of(table: str, values: Sequence[object]) -> int:
    """The seal of a row of `table` whose columns (COLUMNS order) are `values`."""
    parts = [table]
    for v in values:  # the common types first: a row is sealed at every write
        if type(v) is str:
            parts.append("s" + v)
        else:
            parts.append(f"n{v}" if type(v) is int else _text(v))
    return zlib.crc32("\x00".join(parts).encode())


def register(conn: sqlite3.Connection) -> None:
    """Adds `row_seal(table, column, ...)` (= `seal_of`) to the connection's SQL."""
    conn.create_function(
        "row_seal", -1, lambda table, *values: seal_of(table, values), deterministic=True
    )


def seal_sql(table: str, **new: str) -> str:
    """The SQL expression of a row's seal after an UPDATE: each column in `new` replaced by
    the SQL given (a parameter, or an expression over the old row), the others as they are."""
    unknown = set(new) - set(COLUMNS[table])
    if unknown:
        raise ValueError(f"{table} has no column {sorted(unknown)}")
    return f"row_seal('{table}', {', '.join(new.get(c, c) for c in COLUMNS[table])})"


def select(table: str, where: str = "", extra: tuple[str, ...] = (), order: str = "") -> str:
    """A SELECT of the table's sealed columns (COLUMNS order), its seal, then `extra`."""
    sql = f"SELECT {', '.join((*COLUMNS[table], 'seal', *extra))} FROM {table}"
    sql += f" WHERE {where}" if where else ""
    return sql + (f" ORDER BY {order}" if order else "")


def check(db: Path, table: str, row: Sequence[object]) -> tuple:
    """A row read by `select`, its seal checked and dropped; Damaged if it fails."""
    n = len(COLUMNS[table])
    values = row[:n]
    if seal_of(table, values) != row[n]:
        raise Damaged(db, f"{describe(table, values)} fails its checksum", fix_for(db))
    return (*values, *row[n + 1 :])


def describe(table: str, values: Sequence[object]) -> str:
    """The row, named by its key columns."""
    n = KEY_COLUMNS[table]
    key = ", ".join(f"{c}={v!r}" for c, v in zip(COLUMNS[table][:n], values[:n], strict=True))
    return f"the row of table {table} with {key}"


def rows(
    conn: sqlite3.Connection,
    db: Path,
    table: str,
    where: str = "",
    params: Sequence[object] = (),
    *,
    extra: tuple[str, ...] = (),
    order: str = "",
) -> Iterator[tuple]:
    """The table's rows (sealed columns in COLUMNS order, then `extra`), each checked."""
    for row in conn.execute(select(table, where, extra, order), params):
        yield check(db, table, row)


def verify_all(conn: sqlite3.Connection, db: Path) -> int:
    """Checks every row of every sealed table; returns how many. Damaged at the first bad."""
    n = 0
    for table in COLUMNS:
        for _ in rows(conn, db, table):
            n += 1
    return n


def seal_every_row(conn: sqlite3.Connection) -> None:
    """Seals every row as it stands (a database of before schema 8, migrated: its rows were
    read unsealed until now). The connection has `row_seal` (`register`)."""
    for table in COLUMNS:
        conn.execute(f"UPDATE {table} SET seal = {seal_sql(table)}")
