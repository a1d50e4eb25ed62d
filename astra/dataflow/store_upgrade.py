"""The state store's tables brought from an older schema to this build's, inside the opening
transaction (astra.dataflow.store runs it at every start; on a current database it changes
nothing). Knows the schema history (astra.dataflow.store_schema), not the blob log; never
imports gRPC.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from astra.damage import Damaged
from astra.dataflow import row_seals
from astra.dataflow.sealed import fix_for
from astra.dataflow.store_schema import SCHEMA, batch_groups


def upgrade(conn: sqlite3.Connection, db: Path, version: int) -> None:
    """Creates what is missing and migrates a database of schema `version`: its rows sealed
    as they stand (before schema 8 they carried no seal), acked_versions counted from its
    batch rows. The connection has `row_seal` (row_seals.register) and a transaction open."""
    for statement in SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    _add_column(conn, "batches", "untrained_reason TEXT NOT NULL DEFAULT ''")
    if version < row_seals.ROWS_SEALED_FROM:
        for table in row_seals.COLUMNS:
            _add_column(conn, table, "seal INTEGER NOT NULL DEFAULT 0")
        _count_acked_versions(conn, db)
        row_seals.seal_every_row(conn)


def _add_column(conn: sqlite3.Connection, table: str, column: str) -> None:
    """Adds the column (its definition) to a table of an older schema that lacks it."""
    if column.split()[0] not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


def _count_acked_versions(conn: sqlite3.Connection, db: Path) -> None:
    """acked_versions of a database of before schema 8, from the batch rows it holds (the
    newest KEEP_FINISHED finished): what a trainer restart could count discarded before."""
    counts: dict[tuple[str, int], list[int]] = {}
    for batch_id, policy_id, version, groups in conn.execute(
        "SELECT batch_id, policy_id, policy_version, groups FROM batches"
        " WHERE state='acked' AND untrained_reason=''"
    ):
        try:
            entries = batch_groups(batch_id, policy_id, version, groups)
        except ValueError as exc:
            what = f"batch {batch_id}'s groups are damaged ({exc})"
            raise Damaged(db, what, fix_for(db)) from exc
        count = counts.setdefault((policy_id, version), [0, 0])
        count[0] += 1
        count[1] += sum(not e[1] for e in entries)
    conn.executemany(
        "INSERT OR REPLACE INTO acked_versions(policy_id, version, batches, groups)"
        " VALUES(?, ?, ?, ?)",
        [(p, v, b, g) for (p, v), (b, g) in counts.items()],
    )
