"""The supervisor never strands its children: a failure in its own ending (a bug, an output
that cannot be written) still stops every child and leaves a summary.json saying what
happened; an observer that fails is logged and the run's figures are still written."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from astra.run.layout import RunDir
from astra.run.recipe import load_recipe
from astra.run.supervisor import Supervisor
from tests.test_run import SMALL, gone

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, steps: int = 2) -> tuple[int, RunDir]:
    sets = [v for k, v in zip(SMALL[::2], SMALL[1::2], strict=True) if k == "--set"]
    recipe = load_recipe(None, [*sets, f"trainer.num_steps={steps}", "eval.every_steps=0"])
    rd = RunDir(tmp_path / "run")
    return asyncio.run(Supervisor(recipe, rd).run()), rd


def _children(rd: RunDir) -> list[dict]:
    return json.loads(rd.run_json.read_text())["children"]


def test_a_failing_ending_still_stops_every_child_and_says_so(tmp_path, monkeypatch) -> None:
    import astra.run.ending as ending

    def broken(**_kw):
        raise RuntimeError("injected into build_summary")

    monkeypatch.setattr(ending, "build_summary", broken)
    code, rd = _run(tmp_path)
    assert code == 1
    s = json.loads(rd.summary.read_text())
    assert s["status"] == "completed; shutdown error: RuntimeError: injected into build_summary"
    children = _children(rd)
    assert {c["role"] for c in children} >= {"dataflow", "weights", "raas", "trainer"}
    assert all(gone(c["pid"]) for c in children), children
    assert json.loads(rd.run_json.read_text())["supervisor"]["state"] == "ended"


def test_an_observer_that_fails_ends_nothing(tmp_path, monkeypatch, caplog) -> None:
    """Every tick and the ending's read of the logs raise: logged, and the run completes with
    its summary taken from Dataflow's records."""
    from astra.run.observe import Observer

    def broken(self) -> None:
        raise ValueError("injected into read_logs")

    monkeypatch.setattr(Observer, "read_logs", broken)
    code, rd = _run(tmp_path)
    assert code == 0
    s = json.loads(rd.summary.read_text())
    assert s["status"] == "completed" and s["groups_lost"] == 0
    assert all(gone(c["pid"]) for c in _children(rd))
    said = [r.getMessage() for r in caplog.records]
    assert "reading the trainers' last steps failed; the run ends without it" in said
