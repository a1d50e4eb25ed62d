"""A run has one owner (astra.run.ownership, astra.run.children): the supervisor's death ends
every child, SIGHUP stops a run like SIGTERM, `--resume` of a live run is refused, and
`--resume` of a dead run first stops the orphans its last supervisor left (only those whose
command line run.json recorded)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_run import gone

pytestmark = pytest.mark.slow
ALL = {"dataflow", "weights", "raas", "trainer"}


def _until(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return check()


def test_the_supervisors_death_ends_every_child(runs) -> None:
    """SIGKILL (the OOM killer) of `astra run`: no child trains on alone."""
    run = runs("--set", "trainer.num_steps=100000")
    children = run.wait_for_children(ALL, 90)
    time.sleep(1.0)
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(10)
    ended = _until(lambda: all(gone(c["pid"]) for c in children), 60)
    assert ended, _survivors(run, [c for c in children if not gone(c["pid"])])
    # Each stopped by itself, not by its stop's deadline (astra.stop_deadline).
    assert "the stop did not finish" not in run.log_tails(80), run.log_tails(80)


def _survivors(run, left: list[dict]) -> str:
    """The children still there, with their stacks (SIGUSR1: astra.logs) and log tails."""
    for c in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(c["pid"], signal.SIGUSR1)
    time.sleep(1.0)
    return f"{[c['name'] for c in left]} still running\n{run.log_tails(80)}"


def test_sighup_stops_the_run_like_sigterm(runs) -> None:
    """A closed terminal: every child stopped, summary.json written, 128 + SIGHUP."""
    run = runs("--set", "trainer.num_steps=100000")
    children = run.wait_for_children(ALL, 90)
    time.sleep(1.0)
    run.proc.send_signal(signal.SIGHUP)
    assert run.wait(60) == 128 + signal.SIGHUP, run.output()
    assert run.summary()["status"] == "interrupted"
    assert all(gone(c["pid"]) for c in children)


def test_resume_of_a_live_run_is_refused_and_the_run_goes_on(runs) -> None:
    run = runs("--set", "trainer.num_steps=100000")
    run.wait_for_children(ALL, 90)
    cmd = [sys.executable, "-m", "astra.run", "--resume", str(run.run_dir)]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert second.returncode == 2, second.stderr[-3000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"supervisor is pid {run.proc.pid}" in lines[0], lines
    assert run.proc.poll() is None  # the live run was not touched
    state = json.loads((run.run_dir / "run.json").read_text())["supervisor"]
    assert state["pid"] == run.proc.pid
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM, run.output()


def test_resume_stops_the_orphans_of_a_dead_supervisor_first(runs, tmp_path) -> None:
    """Orphans as an older supervisor (no parent-death signal) left them: a WeightService still
    serving the run's store. --resume stops it (its command line is run.json's) and trains on;
    an unrelated process under a recorded pid is left alone."""
    run = runs("--set", "trainer.num_steps=2")
    assert run.wait(100) == 0, run.output()
    record = json.loads((run.run_dir / "run.json").read_text())
    weights = next(c for c in record["children"] if c["role"] == "weights")
    orphan = subprocess.Popen(
        weights["command"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    assert orphan.stdout is not None and json.loads(orphan.stdout.readline())["address"]
    stranger = subprocess.Popen(["sleep", "120"], start_new_session=True)
    weights["pid"] = orphan.pid
    dataflow = next(c for c in record["children"] if c["role"] == "dataflow")
    dataflow["pid"] = stranger.pid  # a reused pid: another command line
    record["supervisor"] = {"pid": 999999, "state": "running"}
    (run.run_dir / "run.json").write_text(json.dumps(record))
    try:
        cmd = [sys.executable, "-m", "astra.run", "--resume", str(run.run_dir)]
        cmd += ["--set", "trainer.num_steps=4"]
        resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert orphan.poll() is not None  # stopped before the new WeightService started
        assert stranger.poll() is None
        assert f"weights (pid {orphan.pid})" in resumed.stderr
        s = run.summary()
        assert s["status"] == "completed" and s["steps"] == 4
        assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    finally:
        for p in (orphan, stranger):
            p.kill()
            p.wait(10)
