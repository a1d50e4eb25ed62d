"""Complete epochs folded into counts (astra.dataflow.folding): the state stays bounded by the
work in flight, and exactly-once delivery holds across folded epochs.

What must hold: an epoch folds only when every one of its groups is done and the stored
dataset position is past it, and never while a group of it waits, is leased or is in flight in
memory; rows of the newest `keep_done_epochs` complete epochs stay; a late result for a group
of a folded epoch is dropped as a duplicate (before and after a restart); the run's
accounting (done count, astra.run.summary) counts the folded groups.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from astra.dataflow.folding import EpochFolder, durable_epoch
from astra.dataflow.store import StateStore
from astra.run.summary import read_state
from tests.conftest import running_dataflow
from tests.test_dataflow_invariants import (
    POLICY,
    ScriptedGenerator,
    Trainer,
    assert_consumed_once,
    dataflow_config,
    delivered_by_another_raas,
    run,
    with_raas,
)


def rows_of(store: StateStore) -> dict[str, str]:
    return {r.group_id: r.state for r in store.work_rows()}


def test_an_epoch_folds_only_when_all_done_and_a_folded_id_stays_done(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    with store.tx() as tx:
        for e in (0, 1):
            for i in range(3):
                tx.set_work(f"s/{e}/{i}", "s", "done", attempts=1, outcome="accepted")
        tx.set_work("s/1/3", "s", "leased", attempts=1)
        # Neighbours a prefix match must not take: epoch 10, another stream, a longer name.
        tx.set_work("s/10/0", "s", "done", attempts=1)
        tx.set_work("t/0/0", "t", "done", attempts=1)
        tx.set_work("s/0x/0", "s", "done", attempts=1)
    assert store.done_count() == 9
    with store.tx() as tx:
        assert tx.fold_epoch("s", 1, 100) is None  # s/1/3 is leased: nothing changes
        assert tx.fold_epoch("s", 0, 2) == 2  # a chunk of two rows
    assert store.is_done("s/0/2") and store.done_count() == 9  # half folded: still done
    with store.tx() as tx:
        assert tx.fold_epoch("s", 0, 2) == 1  # fewer than asked: the epoch is all folded
        assert tx.fold_epoch("s", 0, 2) == 0  # again: nothing left, nothing changes
    assert set(rows_of(store)) == {"s/1/0", "s/1/1", "s/1/2", "s/1/3", "s/10/0", "t/0/0", "s/0x/0"}
    assert store.folded() == {("s", 0): 3} and store.done_count() == 9
    assert store.newest_folded_epoch("s") == 0 and store.newest_folded_epoch("t") is None
    assert all(store.is_done(f"s/0/{i}") for i in range(3))
    assert store.is_done("s/10/0") and store.is_done("s/1/0")
    for not_done in ("s/1/3", "t/1/0", "s/0", "s", "", "x/s/0/1", "s/00/1", "s/0/"):
        assert not store.is_done(not_done), not_done
    store.close()
    again = StateStore(tmp_path)  # durable
    assert again.folded() == {("s", 0): 3} and again.is_done("s/0/2") and again.done_count() == 9
    again.close()


def test_the_folder_keeps_the_newest_complete_epochs_and_waits_for_work_in_flight(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    with store.tx() as tx:
        for e in range(5):
            for i in range(2):
                tx.set_work(f"s/{e}/{i}", "s", "done", attempts=1)
        tx.put("dataset/s", {"epoch": 4, "position": 2, "size": 2})  # epoch 4 finished too
    assert durable_epoch(store.get("dataset/s")) == 5
    assert durable_epoch({"epoch": 3, "position": 1, "size": 2}) == 3 and durable_epoch(None) == 0
    busy = {("s", 1)}

    def folder(keep, every_s=60.0):
        return EpochFolder(
            store, ["s"], keep, in_flight=lambda s, e: (s, e) in busy, every_s=every_s, chunk_rows=1
        )

    f = folder(2)
    # A chunk (one row) per call once begun, without waiting: epoch 0 in three calls (the
    # third finds it empty); then epoch 1, with a group in flight, stops the stream.
    assert [f.maybe_fold(now=t) for t in (0.0, 0.1, 0.2, 0.3)] == [1, 1, 0, 0]
    assert store.folded() == {("s", 0): 2}
    busy.clear()
    assert f.maybe_fold(now=30.0) == 0  # not due yet: nothing begun
    assert f.fold() == 4  # epochs 1 and 2; 3 and 4 kept (keep 2)
    assert sorted(store.folded()) == [("s", 0), ("s", 1), ("s", 2)]
    assert {g.split("/")[1] for g in rows_of(store)} == {"3", "4"}
    assert folder(None).fold() == 0  # never folds
    assert folder(0).fold() == 4  # a new folder (a restart) goes on from there
    assert rows_of(store) == {} and store.done_count() == 10
    store.close()


def test_late_results_of_folded_epochs_are_dropped_and_the_accounting_counts_them(
    tmp_path: Path,
) -> None:
    """A real Dataflow trains three epochs; with keep_done_epochs 0 all three fold. A late
    result for a group of epoch 0 is dropped as a duplicate, before and after a restart, and
    the summary still counts every group dispatched and done."""
    n, epochs = 4, 3
    config = dataflow_config(
        tmp_path,
        n,
        stream={"dataset": {"path": str(tmp_path / "prompts.jsonl"), "num_epochs": epochs}},
        storage={"min_free_bytes": 0, "keep_done_epochs": 0},
    )
    ids = {f"s/{e}/{i}" for e in range(epochs) for i in range(n)}

    async def late(df, gid: str) -> None:
        before = df.counters["duplicates_dropped"]
        result = await delivered_by_another_raas(gid, "raas-late")
        assert await df.ingest("raas-late", [result]) == [gid]
        assert df.counters["duplicates_dropped"] == before + 1
        assert gid not in df.buffers[POLICY] and gid not in df.work

    async def first_run():
        async with with_raas(config, ScriptedGenerator(), capacity=32, name="raas-a") as (
            df,
            client,
            _,
        ):
            trainer = Trainer(client)
            await trainer.drain(df)
            # Upkeep may have folded an epoch already (a slow machine: its look came late).
            rows, early = set(rows_of(df.store)), df.counters["groups_folded"]
            assert rows <= ids and len(rows) + early == n * epochs
            df.done._limit = 1  # memory forgets; the store answers
            assert df.folder.fold() == n * epochs - early
            assert df.counters["groups_folded"] == n * epochs
            assert rows_of(df.store) == {} and len(df.done) == n * epochs
            assert sorted(df.store.folded()) == [("s", e) for e in range(epochs)]
            await late(df, "s/0/0")
            return trainer.consumed

    async def second_run():
        async with running_dataflow(config) as (_, df, _):
            assert len(df.done) == n * epochs and not df.work
            await late(df, "s/0/1")
            await late(df, "s/2/3")
            return df.status()["counters"]

    consumed = run(first_run())
    assert_consumed_once(consumed)
    assert set(consumed) == ids
    counters = run(second_run())
    assert counters["groups_done"] == n * epochs and counters["consumed_groups"] == n * epochs
    assert counters["groups_folded"] == n * epochs  # counted in the folding transactions
    state = read_state(Path(config.state_dir))
    assert state["dispatched"] == state["with_outcome"] == n * epochs
    assert state["unfinished"] == 0


def test_the_open_rows_of_an_epoch_are_found_through_the_state_index(tmp_path: Path) -> None:
    """The check a fold makes before each chunk reads the few rows in flight, not the epoch."""
    from astra.dataflow.store_schema import OPEN_ROW_IN_SPAN

    store = StateStore(tmp_path)
    query = OPEN_ROW_IN_SPAN.format(where="group_id >= ? AND group_id < ? AND stream = ?")
    plan = store.conn.execute(f"EXPLAIN QUERY PLAN {query}", ("s/0/", "s/00", "s")).fetchall()
    assert any("work_state" in str(step) for step in plan), plan
    with pytest.raises(ValueError, match="work state"), store.tx() as tx:
        tx.set_work("s/0/0", "s", "cancelled")  # a state the query would not see as open
    store.close()
