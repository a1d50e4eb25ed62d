"""Rows of Dataflow's tables changed in place, still well formed: found, not used.

`PRAGMA quick_check` passes a database whose values were edited with sqlite3: a batch's
state flipped to acknowledged, a work item marked done, a count raised. Every row is sealed
(astra.dataflow.row_seals): the next start stops with one line naming the file, the table,
the row and what to do, and `astra doctor` reports the same. A database of before the seals
is migrated: its rows sealed as they stand, its acknowledged batches counted per version.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from astra.damage import Damaged
from astra.dataflow.row_seals import COLUMNS, KEY_COLUMNS
from astra.dataflow.store import StateStore
from tests.test_at_rest_doctor import doctor
from tests.test_dataflow_recovery import (
    crash,
    fill_and_fetch,
    make_config,
    new_dataflow,
    replay_config,
    run,
)


def state_with_every_table(tmp_path: Path, state_dir: Path | None = None):
    """A crashed Dataflow whose database has rows in every sealed table: work items done,
    groups buffered and leased, two batches acknowledged and one leased with a replayed
    copy, replay memory, per-version acknowledgement counts and a folded epoch count."""
    cfg = replay_config(tmp_path, replay_ratio=0.5, replay_capacity_groups=8)
    if state_dir is not None:
        cfg = cfg.model_copy(update={"state_dir": str(state_dir)})

    async def body():
        df = new_dataflow(cfg)
        await fill_and_fetch(df, 3)
        with df.store.tx() as tx:  # a stream of an earlier configuration, its epoch folded
            tx.fold_epoch("old", 0, 10)
        crash(df)
        df.store.close()

    run(body())
    db = Path(cfg.state_dir) / "dataflow.sqlite"
    conn = sqlite3.connect(db)
    try:
        for table in COLUMNS:
            (n,) = conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
            assert n >= (2 if table in ("work", "batches") else 1), table
    finally:
        conn.close()
    return cfg, db


# A change per table: (column, SQL of its new value), well formed and in range.
CHANGES = {
    "work": ("state", "CASE state WHEN 'done' THEN 'pending' ELSE 'done' END"),
    "folded_work": ("done", "done + 1"),
    "groups": ("batch_id", "CASE WHEN batch_id IS NULL THEN 'b' ELSE NULL END"),
    "batches": ("state", "CASE state WHEN 'acked' THEN 'leased' ELSE 'acked' END"),
    "batch_replays": ("group_id", "group_id || 'x'"),
    "replay_memory": ("seq", "seq + 1"),
    "acked_versions": ("groups", "groups + 1"),
}


def edit(db: Path, sql: str, params=()) -> None:
    conn = sqlite3.connect(db)
    try:
        conn.execute(sql, params)
        conn.commit()
        assert conn.execute("PRAGMA quick_check").fetchone() == ("ok",)  # still sound
    finally:
        conn.close()


def first_key(db: Path, table: str) -> tuple:
    keys = COLUMNS[table][: KEY_COLUMNS[table]]
    conn = sqlite3.connect(db)
    try:
        return conn.execute(f"SELECT {', '.join(keys)} FROM {table} LIMIT 1").fetchone()
    finally:
        conn.close()


def where_key(table: str) -> str:
    return " AND ".join(f"{c}=?" for c in COLUMNS[table][: KEY_COLUMNS[table]])


def test_an_undamaged_database_starts_and_keeps_what_it_held(tmp_path):
    cfg, _db = state_with_every_table(tmp_path)
    df = new_dataflow(cfg)
    try:
        assert df.batches.leased_groups("p") == 2 and df.store.folded() == {("old", 0): 0}
        assert df.store.acked_since("p", 0) == (2, 3)  # b1: 2 fresh groups, b2: 1 (+1 replay)
    finally:
        crash(df)


@pytest.mark.parametrize("table", list(CHANGES))
def test_a_value_changed_in_place_stops_the_start_naming_table_and_row(tmp_path, table):
    cfg, db = state_with_every_table(tmp_path)
    key = first_key(db, table)
    column, value = CHANGES[table]
    edit(db, f"UPDATE {table} SET {column} = {value} WHERE {where_key(table)}", key)
    with pytest.raises(Damaged) as info:
        new_dataflow(cfg)
    assert info.value.path == str(db)
    assert f"the row of table {table} with " in info.value.what
    assert repr(key[0]) in info.value.what and "fails its checksum" in info.value.what
    assert "astra doctor" in info.value.fix
    assert "\n" not in info.value.line("dataflow")


@pytest.mark.parametrize("table", ["work", "batches"])
def test_two_rows_whose_values_were_swapped_are_caught(tmp_path, table):
    """Each row's values, seal included, are sound for some row: the key in the seal tells
    that they are not this row's."""
    cfg, db = state_with_every_table(tmp_path)
    keys = COLUMNS[table][: KEY_COLUMNS[table]]
    values = [c for c in (*COLUMNS[table], "seal") if c not in keys]
    conn = sqlite3.connect(db)
    try:
        a, b = conn.execute(
            f"SELECT {', '.join(keys + tuple(values))} FROM {table}"
            f" ORDER BY {values[0]} LIMIT 2"  # rows that differ where they can
        ).fetchall()
        setter = ", ".join(f"{c}=?" for c in values)
        for this, other in ((a, b), (b, a)):
            conn.execute(
                f"UPDATE {table} SET {setter} WHERE {where_key(table)}",
                (*other[len(keys) :], *this[: len(keys)]),
            )
        conn.commit()
    finally:
        conn.close()
    with pytest.raises(Damaged) as info:
        new_dataflow(cfg)
    assert f"the row of table {table} with " in info.value.what


def test_doctor_reports_a_row_changed_in_place(tmp_path):
    rd = tmp_path / "run"
    _cfg, db = state_with_every_table(tmp_path, rd / "state" / "dataflow")
    assert doctor(rd).returncode == 0
    (batch_id,) = first_key(db, "batches")
    edit(db, "UPDATE batches SET request_id = request_id || 'x' WHERE batch_id=?", (batch_id,))
    out = doctor(rd)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("DAMAGED")]
    assert "dataflow database" in line and str(db) in line
    assert f"the row of table batches with batch_id={batch_id!r} fails its checksum" in line


def to_schema_7(db: Path) -> None:
    """The database as the build before row seals (schema 7) left it."""
    conn = sqlite3.connect(db)
    try:
        for table in COLUMNS:
            if table != "acked_versions":
                conn.execute(f"ALTER TABLE {table} DROP COLUMN seal")
        conn.execute("DROP TABLE acked_versions")
        conn.execute("PRAGMA user_version=7")
        conn.commit()
    finally:
        conn.close()


def test_a_database_of_schema_7_is_migrated_its_rows_sealed_and_checked_from_then(tmp_path):
    cfg, db = state_with_every_table(tmp_path)
    to_schema_7(db)
    store = StateStore(cfg.state_dir)  # migrated: sealed as they stand
    try:
        assert store.conn.execute("PRAGMA user_version").fetchone() == (8,)
        assert store.acked_since("p", 0) == (2, 3)  # counted from the batch rows
        assert len(store.work_rows()) >= 2
    finally:
        store.close()
    df = new_dataflow(cfg)
    try:
        assert df.batches.leased_groups("p") == 2
    finally:
        crash(df)
        df.store.close()
    edit(db, "UPDATE work SET attempts = attempts + 1")
    with pytest.raises(Damaged, match="the row of table work with group_id="):
        new_dataflow(cfg)


def test_a_schema_newer_than_this_build_is_refused_naming_the_file(tmp_path):
    cfg = make_config(tmp_path)
    StateStore(cfg.state_dir).close()
    db = Path(cfg.state_dir) / "dataflow.sqlite"
    edit(db, "PRAGMA user_version=9")
    with pytest.raises(Damaged, match="schema 9, this build reads up to 8") as info:
        StateStore(cfg.state_dir)
    assert info.value.path == str(db)


def test_the_summary_counts_no_figure_from_a_changed_row(tmp_path: Path) -> None:
    """summary.json's dispatch and batch figures (astra.run.summary.read_state) come from
    rows that check: a work item's state changed in place raises, naming the table."""
    from astra.run.summary import read_state

    _, db = state_with_every_table(tmp_path)
    assert read_state(db.parent)["dispatched"] >= 1  # undamaged: counted
    column, value = CHANGES["work"]  # done <-> pending
    edit(db, f"UPDATE work SET {column} = {value} WHERE rowid = (SELECT MIN(rowid) FROM work)")
    with pytest.raises(Damaged, match="table work"):
        read_state(db.parent)
