"""A run that stopped taking steps says why, and (supervision.max_idle_s) ends as stalled:
astra.run.progress on its own with a given clock, then inside the observer's loop."""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path

from astra.run.observe import Observer
from astra.run.progress import ProgressWatch
from astra.run.recipe import load_recipe

DATAFLOW = {
    "gate": "THROTTLED",
    "gate_reason": "staleness 1.00 >= bound 1",
    "buffered": {"p": 3},
    "raas_states": {"raas-0": "ACTIVE", "raas-1": "DEAD"},
    "raas_active": 1,
    "in_flight": 0,
}
TRAINERS = {"p": {"step": 7, "version": 9, "paused": False}}


def test_a_policy_without_steps_is_warned_about_with_the_reason(caplog) -> None:
    w = ProgressWatch(["p"], warn_after_s=60, now=0.0)
    with caplog.at_level(logging.WARNING, logger="astra.run.observe"):
        assert w.check(TRAINERS, DATAFLOW, None, now=59.0) is None
        assert w.warnings == 0
        assert w.check(TRAINERS, DATAFLOW, None, now=60.0) is None
        assert w.check(TRAINERS, DATAFLOW, None, now=100.0) is None  # said once a period
        assert w.warnings == 1
        w.check(TRAINERS, DATAFLOW, None, now=121.0)
        assert w.warnings == 2
        w.stepped("p", now=130.0)  # a step: quiet again
        w.check(TRAINERS, DATAFLOW, None, now=150.0)
        assert w.warnings == 2
    said = caplog.records[0].getMessage()
    assert "policy p took no step for 60s" in said
    for part in ("step 7, version 9", "THROTTLED: staleness 1.00", "3 groups buffered"):
        assert part in said, said
    assert "RaaS 1/2 active" in said


def test_the_run_ends_after_max_idle_and_not_while_a_trainer_is_paused() -> None:
    w = ProgressWatch(["p"], warn_after_s=0, fail_after_s=100, now=0.0)
    paused = {"p": {**TRAINERS["p"], "paused": True}}
    assert w.check(paused, DATAFLOW, None, now=500.0) is None  # paused: not waiting
    assert w.check(TRAINERS, DATAFLOW, None, now=599.0) is None
    why = w.check(TRAINERS, {}, "UNAVAILABLE: connection refused", now=600.0)
    assert why is not None and why.startswith("stalled: policy p took no step for 100s")
    assert "Dataflow unreachable (UNAVAILABLE: connection refused)" in why
    assert "supervision.max_idle_s: 100" in why


def test_the_slowest_policy_counts_and_zero_bounds_never_fire() -> None:
    w = ProgressWatch(["a", "b"], warn_after_s=0, fail_after_s=50, now=0.0)
    w.stepped("a", now=40.0)
    why = w.check({}, {}, None, now=50.0)
    assert why is not None and "policy b" in why and "trainer silent" in why
    assert (
        ProgressWatch(["a"], warn_after_s=0, fail_after_s=0, now=0).check({}, {}, None, 1e9) is None
    )


def test_the_recipe_defaults_warn_and_never_end_the_run() -> None:
    s = load_recipe(None).supervision
    assert s.progress_warn_s == 300.0 and s.max_idle_s == 0.0


def test_the_observer_ends_a_run_whose_trainer_never_steps(tmp_path: Path) -> None:
    """Dataflow and the trainer unreachable, no step line: on_stall is called with the reason."""
    stalls: list[str] = []

    async def go() -> None:
        obs = Observer(
            "127.0.0.1:1",
            {"p": "127.0.0.1:1"},
            {"p": (tmp_path / "trainer.log", 0)},
            tmp_path / "metrics.jsonl",
            num_steps=3,
            poll_interval_s=0.1,
            out=io.StringIO(),
            on_stall=stalls.append,
            progress_warn_s=0,
            max_idle_s=0.5,
        )
        task = asyncio.create_task(obs.run())
        try:
            for _ in range(200):
                if stalls:
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await obs.close()

    asyncio.run(go())
    assert len(stalls) == 1, stalls
    assert stalls[0].startswith("stalled: policy p took no step") and "unreachable" in stalls[0]


def test_a_finished_policy_is_not_waiting_and_a_restart_starts_the_clock_again() -> None:
    w = ProgressWatch(["a", "b"], warn_after_s=0, fail_after_s=50, num_steps=10, now=0.0)
    trainers = {"a": {"step": 10, "version": 10}, "b": {"step": 4, "version": 4}}
    w.stepped("b", now=45.0)
    assert w.check(trainers, {}, None, now=60.0) is None  # a finished at 10; b stepped at 45
    w.stepped("b", now=90.0)  # b's trainer restarted (Observer.set_trainer)
    assert w.check(trainers, {}, None, now=130.0) is None
    why = w.check(trainers, {}, None, now=140.0)
    assert why is not None and "policy b" in why
