"""Dataflow's bytes at rest: real bytes flipped in the real files its store wrote.

A blob record that is not as written is quarantined at the next start (never trained),
counted, logged with its file and offset, and its group dispatched again; a torn last
record (a crash) is dropped the same way and does not stop the start. A value changed
in the key/value state, or a damaged database file, stops the start with one line that
names the file and what to do.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest

from astra.damage import Damaged
from astra.dataflow.store import StateStore
from astra.raas.results import ResultStore
from tests.test_dataflow_recovery import (
    crash,
    fill_and_fetch,
    leased,
    make_config,
    new_dataflow,
    register,
    replay_config,
    result,
    run,
    write_prompts,
)


def db_path(cfg) -> Path:
    return Path(cfg.state_dir) / "dataflow.sqlite"


def record_of(cfg, group_id: str, policy_id: str = "p") -> tuple[Path, int, int]:
    """(segment file, offset, length) of a stored group's record, read from the database."""
    db = sqlite3.connect(f"file:{db_path(cfg)}?mode=ro", uri=True)
    try:
        seg, off, length = db.execute(
            "SELECT seg, off, len FROM groups WHERE group_id=? AND policy_id=?",
            (group_id, policy_id),
        ).fetchone()
    finally:
        db.close()
    return Path(cfg.state_dir) / "blobs" / f"{seg:08d}.seg", off, length


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


async def buffered(df, n: int) -> list[str]:
    """Dispatches and ingests groups until `n` are buffered; returns their ids."""
    await register(df, versions={p: 0 for p in df.buffers}, policies=tuple(df.buffers))
    await df.dispatcher.round()
    gids = sorted(leased(df))[:n]
    await df.ingest("r1", [result(g, "r1", 0, policies=tuple(df.buffers)) for g in gids])
    return gids


def test_a_flipped_token_byte_is_quarantined_counted_and_its_group_dispatched_again(
    tmp_path, caplog
):
    cfg = make_config(tmp_path, n_prompts=4)

    async def body():
        df = new_dataflow(cfg)
        gids = await buffered(df, 3)
        crash(df)
        victim = gids[1]
        path, off, length = record_of(cfg, victim)
        flip(path, off + length - 3)  # a byte of the last trajectory's payload
        with caplog.at_level(logging.ERROR, "astra.dataflow"):
            df = new_dataflow(cfg)
        try:
            assert victim not in df.buffers["p"]  # never trained
            assert {g for g in gids if g != victim} <= set(df.buffers["p"]._groups)
            assert df.status()["counters"]["records_corrupt"] == 1
            assert df.counters["records_corrupt_redispatched"] == 1
            assert victim in df.work and victim in df.waiting
            assert df.work[victim].item.regenerate  # a RaaS that acknowledged it runs it again
            assert victim not in df.done
            line = next(r.getMessage() for r in caplog.records if "quarantined" in r.getMessage())
            assert str(path) in line and f"offset {off}" in line and "CRC-32" in line
            # Dispatched again, and its new result is buffered once.
            await register(df, "r2", versions={"p": 0})
            await df.dispatcher.round()
            assert leased(df)[victim] == "r2"
            await df.ingest("r2", [result(victim, "r2", 0)])
            assert victim in df.buffers["p"]
            rows = {r.group_id: r for r in df.store.work_rows()}
            assert rows[victim].state == "done" and rows[victim].attempts == 1
        finally:
            crash(df)
        # The next start finds nothing corrupt: the bad row is gone, the new one is sound.
        df = new_dataflow(cfg)
        try:
            assert df.counters["records_corrupt"] == 1
            assert victim in df.buffers["p"] and victim not in df.work
        finally:
            crash(df)

    run(body())


def test_a_reward_changed_in_the_database_is_quarantined_not_trained(tmp_path, caplog):
    """The facts beside a blob record (rewards, versions, token counts: the row's meta) are
    sealed too: a reward edited in place, still valid JSON, would change every advantage of
    its group. It is found at the next start and handled as a damaged record."""
    cfg = make_config(tmp_path, n_prompts=4)

    async def body():
        df = new_dataflow(cfg)
        gids = await buffered(df, 3)
        crash(df)
        victim = gids[0]
        db = sqlite3.connect(db_path(cfg))
        (meta,) = db.execute("SELECT meta FROM groups WHERE group_id=?", (victim,)).fetchone()
        seal, text = meta.split(":", 1)
        rows = json.loads(text)
        rows[0][1] += 1.0  # the first trajectory's reward
        db.execute(
            "UPDATE groups SET meta=? WHERE group_id=?", (f"{seal}:{json.dumps(rows)}", victim)
        )
        db.commit()
        db.close()
        with caplog.at_level(logging.ERROR, "astra.dataflow"):
            df = new_dataflow(cfg)
        try:
            assert victim not in df.buffers["p"] and victim in df.waiting
            assert {g for g in gids if g != victim} <= set(df.buffers["p"]._groups)
            assert df.counters["records_corrupt"] == 1
            line = next(r.getMessage() for r in caplog.records if "quarantined" in r.getMessage())
            assert "fails its checksum" in line and victim in line
        finally:
            crash(df)

    run(body())


def test_a_torn_last_record_after_a_crash_is_dropped_not_trained_not_fatal(tmp_path):
    """What the blob log's fsync policy guarantees: its tail may be lost by a machine crash
    while the row survives; the start goes on without it and the group is generated again."""
    cfg = make_config(tmp_path, n_prompts=4)

    async def body():
        df = new_dataflow(cfg)
        gids = await buffered(df, 3)
        crash(df)
        last = max(gids, key=lambda g: record_of(cfg, g)[1])
        path, off, length = record_of(cfg, last)
        with open(path, "r+b") as f:
            f.truncate(off + length // 2)
        df = new_dataflow(cfg)
        try:
            assert last not in df.buffers["p"] and last in df.waiting
            assert len(df.buffers["p"]) == 2
            assert df.counters["records_corrupt"] == 1
        finally:
            crash(df)

    run(body())


def test_a_multi_policy_group_is_redone_only_for_the_policy_whose_record_was_bad(tmp_path):
    data = write_prompts(tmp_path / "d.jsonl", 2)
    cfg = make_config(
        tmp_path,
        policies=[
            {"id": "a", "batch_groups": 1, "buffer": {"drop_equal_rewards": False}},
            {"id": "b", "batch_groups": 1, "buffer": {"drop_equal_rewards": False}},
        ],
        streams=[
            {"name": "s", "dataset": {"path": str(data)}, "policy_ids": ["a", "b"], "group_size": 2}
        ],
    )

    async def body():
        df = new_dataflow(cfg)
        (gid,) = await buffered(df, 1)
        batch = await df.batches.fetch("a", 1, "req-a", "t", 0.1)  # a trains it
        df.batches.ack(batch.batch_id)
        crash(df)
        path, off, _length = record_of(cfg, gid, "b")
        flip(path, off + 9)
        df = new_dataflow(cfg)
        try:
            assert df.redo.policies == {gid: ["b"]}
            await register(df, "r2", versions={"a": 0, "b": 0}, policies=("a", "b"))
            await df.dispatcher.round()
            await df.ingest("r2", [result(gid, "r2", 0, policies=("a", "b"))])
            assert gid in df.buffers["b"] and gid not in df.buffers["a"]  # a's: trained once
            assert df.counters["redispatch_parts_dropped"] == 1
            assert df.redo.policies == {}
        finally:
            crash(df)

    run(body())


def test_a_changed_dataset_position_stops_the_start_naming_the_file(tmp_path):
    """In range, well-formed, and wrong: only the value's seal tells."""
    cfg = make_config(tmp_path, n_prompts=8, gate={"max_concurrent_groups": 3})

    async def body():
        df = new_dataflow(cfg)
        await buffered(df, 1)
        crash(df)

    run(body())
    db = sqlite3.connect(db_path(cfg))
    (stored,) = db.execute("SELECT value FROM kv WHERE key='dataset/s'").fetchone()
    seal, text = stored.split(":", 1)
    state = json.loads(text)
    assert state["position"] > 1
    state["position"] -= 1
    db.execute("UPDATE kv SET value=? WHERE key='dataset/s'", (f"{seal}:{json.dumps(state)}",))
    db.commit()
    db.close()
    with pytest.raises(Damaged) as info:
        new_dataflow(cfg)
    assert info.value.path == str(db_path(cfg))
    assert "'dataset/s' fails its checksum" in str(info.value)
    assert "\n" not in info.value.line("dataflow")


def test_a_changed_advantage_of_a_leased_batch_stops_the_start_naming_the_file(tmp_path):
    """A leased batch is served again, as stored, to a trainer that retries its fetch: an
    advantage edited in its row would be trained. The row's groups are sealed."""
    cfg = replay_config(tmp_path)

    async def body():
        df = new_dataflow(cfg)
        await fill_and_fetch(df, 1)
        crash(df)

    run(body())
    db = sqlite3.connect(db_path(cfg))
    batch_id, stored = db.execute("SELECT batch_id, groups FROM batches").fetchone()
    seal, text = stored.split(":", 1)
    groups = json.loads(text)
    groups[0][2][0] = -groups[0][2][0] or 1.0  # the first trajectory's advantage
    db.execute(
        "UPDATE batches SET groups=? WHERE batch_id=?", (f"{seal}:{json.dumps(groups)}", batch_id)
    )
    db.commit()
    db.close()
    with pytest.raises(Damaged) as info:
        new_dataflow(cfg)
    assert info.value.path == str(db_path(cfg))
    assert f"batch {batch_id}'s groups are damaged" in str(info.value)
    assert "fails its checksum" in str(info.value)


def test_a_damaged_database_page_stops_the_start_naming_the_file(tmp_path):
    cfg = make_config(tmp_path, n_prompts=8)

    async def body():
        df = new_dataflow(cfg)
        await buffered(df, 4)
        df.store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        crash(df)
        df.store.conn.close()

    run(body())
    path = db_path(cfg)
    raw = bytearray(path.read_bytes())
    page = 4096
    assert len(raw) > 2 * page
    for k in range(page + 8, 2 * page - 8, 7):  # the second page's cells: garbage
        raw[k] ^= 0x5A
    path.write_bytes(bytes(raw))
    with pytest.raises(Damaged) as info:
        StateStore(cfg.state_dir)
    assert info.value.path == str(path)
    assert "astra doctor" in str(info.value)


def test_a_raas_runs_an_acknowledged_group_again_only_when_told_to_regenerate():
    store = ResultStore(8)
    store.try_accept([("s/0/1", 2)])
    store.finish("s/0/1", "first")
    store.ack(["s/0/1"])
    assert store.try_accept([("s/0/1", 2)]).new == []  # a delayed retry: not run twice
    assert store.try_accept([("s/0/1", 2)], regenerate=["s/0/1"]).new == ["s/0/1"]
    assert store.try_accept([("s/0/1", 2)], regenerate=["s/0/1"]).new == []  # running now


def test_a_batch_acknowledgement_is_fsynced_before_it_returns(tmp_path):
    """Power loss: every other commit may be among the last few a power cut takes back (WAL,
    synchronous=NORMAL), but a trainer's acknowledgement is committed with synchronous=FULL,
    which fsyncs the WAL with every commit before it: a batch acknowledged stays so."""
    cfg = make_config(tmp_path, n_prompts=4)

    async def body():
        df = new_dataflow(cfg)
        try:
            await buffered(df, 2)
            batch = await df.batches.fetch("p", 1, "req", "t", 0.1)
            statements: list[str] = []
            df.store.conn.set_trace_callback(statements.append)
            df.batches.ack(batch.batch_id)
            df.store.conn.set_trace_callback(None)
            full = statements.index("PRAGMA synchronous=FULL")
            commit = statements.index("COMMIT", full)
            assert statements[full + 1] == "BEGIN IMMEDIATE"
            assert statements[commit + 1] == "PRAGMA synchronous=NORMAL"
            assert any("replay" in s or "DELETE FROM groups" in s for s in statements[full:commit])
            (mode,) = df.store.conn.execute("PRAGMA synchronous").fetchone()
            assert mode == 1  # NORMAL again for everything else
        finally:
            crash(df)

    run(body())
