"""summary.json is never rewritten with figures from a start that did not reach Dataflow.

The real supervisor (`astra run --resume`'s Supervisor.run) with fake children (processes
that print an address line and answer nothing, tests.test_run_children): the RaaS dies
before serving, so the start fails while Dataflow's state directory holds a previous run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from astra.dataflow.store import StateStore
from astra.run.layout import RunDir
from astra.run.recipe import load_recipe
from astra.run.supervisor import EXIT_FAILED, Supervisor
from tests.test_run_children import fake_factory

DISPATCHED = 12


def failing_start(tmp_path: Path, rd: RunDir) -> int:
    recipe = load_recipe(
        None, ["warmup.steps=0", "eval.every_steps=0", "supervision.stop_grace_s=1"]
    )
    factory = fake_factory(tmp_path, {"dataflow": "serve", "weights": "serve", "raas": "die"})
    sup = Supervisor(recipe, rd, resume=True, child_factory=factory)
    return asyncio.run(asyncio.wait_for(sup.run(), 60))


def previous_state(rd: RunDir) -> None:
    """Dataflow's file as a previous start left it: DISPATCHED groups, every one done."""
    store = StateStore(rd.dataflow_state)
    store.conn.executemany(
        "INSERT INTO work(group_id, stream, state, attempts) VALUES(?, 's', 'done', 1)",
        [(f"g{i}",) for i in range(DISPATCHED)],
    )
    store.close()


def test_a_failed_start_keeps_the_summary_of_the_run_so_far(tmp_path: Path) -> None:
    """It was overwritten: counters empty (Dataflow never answered), so groups_lost was every
    group ever dispatched."""
    rd = RunDir(tmp_path / "run")
    rd.config.mkdir(parents=True)
    previous_state(rd)
    before = {"status": "interrupted", "steps": 5, "groups_trained": 40, "groups_lost": 0}
    rd.summary.write_text(json.dumps(before) + "\n")
    assert failing_start(tmp_path, rd) == EXIT_FAILED
    assert json.loads(rd.summary.read_text()) == before


def test_a_first_start_that_failed_says_so_without_figures(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run")
    rd.config.mkdir(parents=True)
    previous_state(rd)
    assert failing_start(tmp_path, rd) == EXIT_FAILED
    s = json.loads(rd.summary.read_text())
    assert s["status"].startswith("failed") and s["started"] is False
    assert not any(k.startswith("groups_") for k in s), s
