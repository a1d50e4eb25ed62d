"""`astra run` end to end with real processes: the default recipe trains a few steps and writes
summary.json; SIGTERM stops every child; a RaaS killed with SIGKILL does not stop the run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SMALL = ["--set", "dataset.size=64", "--set", "observe.baseline_samples=8"]
SMALL += ["--set", "warmup.steps=20", "--set", "trainer.batch_groups=4"]
SMALL += ["--set", "supervision.stop_grace_s=10", "--set", "eval.size=16"]


class Run:
    """`python -m astra.run` in a session of its own, with its output in a file."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.out = (run_dir.parent / f"{run_dir.name}.out").open("wb")
        cmd = [sys.executable, "-m", "astra.run", "--run-dir", str(run_dir), *SMALL, *args]
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def children(self) -> list[dict]:
        path = self.run_dir / "run.json"
        return json.loads(path.read_text())["children"] if path.is_file() else []

    def wait_for_children(self, roles: set[str], timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            children = self.children()
            if roles <= {c["role"] for c in children}:
                return children
            time.sleep(0.2)
        raise AssertionError(f"children {roles} not started: {self.output()}")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"astra run still running: {self.output()}\n{self.log_tails()}"
            ) from None

    def log_tails(self, lines: int = 12) -> str:
        """The last lines of every child's log: what a hung run's own output does not show."""
        parts = []
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(line[:300] for line in tail))
        return "\n".join(parts)

    def output(self) -> str:
        self.out.flush()
        return Path(self.out.name).read_text(errors="replace")[-4000:]

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def cleanup(self) -> None:
        """Kills whatever this test started and is still there (by process group)."""
        groups = [self.proc.pid, *(c["pid"] for c in self.children() if c["pid"])]
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(10)
        self.out.close()


def gone(pid: int) -> bool:
    """No process left in the group `pid` led (children are group leaders)."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_default_recipe_runs_end_to_end(runs) -> None:
    run = runs("--set", "trainer.num_steps=3", "--set", "eval.every_steps=2")
    assert run.wait(100) == 0, run.output()
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == 3
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    assert s["versions_published"] >= 3
    # The last line says what was learned; every step's row has its accuracy.
    last = run.output().strip().splitlines()[-1]
    assert ": completed (" in last and "accuracy " in last and "held-out " in last, last
    rows = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["accuracy"] is not None for r in rows), rows
    assert s["groups_trained"] == 3 * 4 and s["groups_dispatched"] >= s["groups_trained"]
    assert s["wall_seconds"] > 0 and 0 <= s["random_baseline_accuracy"] <= 1
    assert s["warmup"]["steps"] == 20 and 0 <= s["warmup"]["accuracy_after"] <= 1
    assert (run.run_dir / "warmup" / "policy" / "model" / "config.json").is_file()
    assert all(c["metrics_port"] is None for c in run.children())  # observe.prometheus off
    assert 0 <= s["accuracy_first10"] <= 1 and 0 <= s["accuracy_last10"] <= 1
    rows = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # held-out evaluations at versions 0 and 2 (the last multiple of 2 reached), never trained
    evals = [json.loads(x) for x in (run.run_dir / "evals.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2], evals
    assert all(e["samples"] + e["failed_samples"] == 16 and e["groups"] == 16 for e in evals)
    assert all(e["token_versions"][0] >= e["version"] for e in evals)
    assert [r["version"] for r in s["eval"]["results"]] == [0, 2]
    assert s["eval"]["last"] == evals[-1]["mean_reward"] and 0 <= s["eval"]["last"] <= 1
    (events,) = (run.run_dir / "tensorboard" / "policy").glob("events.out.tfevents.*")
    assert b"eval/mean_reward" in events.read_bytes()
    assert (run.run_dir / "plot.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    names = {c["name"] for c in run.children()}
    assert names == {"dataflow", "weights", "raas-0", "raas-1", "trainer-policy"}
    for name in names:
        text = (run.run_dir / "logs" / f"{name}.log").read_text()
        assert text and "Task exception was never retrieved" not in text, name
    assert all(gone(c["pid"]) for c in run.children())


def test_sigterm_stops_every_child(runs) -> None:
    run = runs("--set", "trainer.num_steps=100000")
    children = run.wait_for_children({"dataflow", "weights", "raas", "trainer"}, 90)
    time.sleep(1.0)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 128 + signal.SIGTERM, run.output()
    assert run.summary()["status"] == "interrupted"
    left = [c["name"] for c in children if not gone(c["pid"])]
    assert not left, f"children left running: {left}"


def test_killed_raas_does_not_stop_the_run(runs) -> None:
    run = runs("--set", "trainer.num_steps=12", "--set", "on_raas_death=continue")
    children = run.wait_for_children({"trainer"}, 90)
    victim = next(c for c in children if c["name"] == "raas-1")
    os.kill(victim["pid"], signal.SIGKILL)
    assert run.wait(100) == 0, run.output()
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == 12
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    supervisor_log = (run.run_dir / "logs" / "supervisor.log").read_text()
    assert "raas-1 (pid" in supervisor_log and "exited with -9" in supervisor_log
    assert all(gone(c["pid"]) for c in children)


def test_resume_continues_a_stopped_run(runs) -> None:
    first = runs(
        "--set", "trainer.num_steps=100000", "--set", "trainer.checkpoint.every_steps=2",
        "--set", "observe.prometheus=true",
    )  # fmt: skip
    ckpts = first.run_dir / "checkpoints" / "policy"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not list(ckpts.glob("step-*")):
        time.sleep(0.2)
    # Every service serves /metrics on the port run.json records.
    families = {"dataflow": "astra_dataflow_", "raas": "astra_raas_", "trainer": "astra_trainer_"}
    families["weights"] = "astra_weights_head_version"
    for child in first.children():
        if child["role"] in families:
            url = f"http://127.0.0.1:{child['metrics_port']}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                assert families[child["role"]] in resp.read().decode(), child["name"]
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(60) == 128 + signal.SIGTERM, first.output()
    before = {c["name"]: c["address"] for c in first.children()}
    done = int(sorted(ckpts.glob("step-*"))[-1].name.removeprefix("step-"))
    cmd = [sys.executable, "-m", "astra.run", "--resume", str(first.run_dir)]
    cmd += ["--set", f"trainer.num_steps={done + 2}"]
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    s = first.summary()
    assert s["status"] == "completed" and s["steps"] == done + 2
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    assert s["versions_published"] >= done + 2
    # Dataflow keeps each version's weights address: the WeightService comes back on its port.
    assert {c["name"]: c["address"] for c in first.children()}["weights"] == before["weights"]
    trainer_log = (first.run_dir / "logs" / "trainer-policy.log").read_text()
    assert f"resumed from {ckpts}/step-{done:09d}" in trainer_log
    # The figures cover the whole run, and each start has its own segment.
    by_step: dict[int, float | None] = {}
    for line in (first.run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step = {k: v for k, v in by_step.items() if k < row["step"]}  # a rerun cuts back
        by_step[row["step"]] = row["accuracy"]
    accs = [a for _, a in sorted(by_step.items()) if a is not None]
    assert s["accuracy_steps_observed"] == len(accs) and len(accs) >= done + 1
    assert s["accuracy_first10"] == pytest.approx(sum(accs[:10]) / len(accs[:10]), abs=1e-4)
    assert s["accuracy_last10"] == pytest.approx(sum(accs[-10:]) / len(accs[-10:]), abs=1e-4)
    earlier, this = s["segments"]
    assert earlier["status"] != "completed" and earlier["steps"] >= done
    assert this["status"] == "completed" and this["steps"] == done + 2
    assert this["first_step"] is not None and this["first_step"] <= done + 1
    assert s["wall_seconds_total"] == pytest.approx(earlier["wall_seconds"] + this["wall_seconds"])
    assert (first.run_dir / "plot.png").is_file()
    assert list((first.run_dir / "tensorboard" / "policy").glob("events.out.tfevents.*"))


def test_a_run_whose_groups_are_all_dropped_ends_as_stalled(runs, tmp_path, monkeypatch) -> None:
    """Every reward equal, equal-reward groups dropped: no batch can ever form. The run ends as
    stalled (exit 1) instead of waiting forever; Dataflow's status says why."""
    (tmp_path / "flat_reward.py").write_text("def zero(record, completion, **_):\n    return 0.0\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = runs(
        "--set", "streams.0.reward=flat_reward:zero",
        "--set", "policies.0.buffer.drop_equal_rewards=true",
        "--set", "supervision.max_dropped_in_a_row=40",
        "--set", "eval.every_steps=0",
    )  # fmt: skip
    assert run.wait(120) == 1, run.output()
    s = run.summary()
    assert s["status"].startswith("stalled: policy policy: the last "), s["status"]
    assert "filtered_equal_reward" in s["status"] and s["steps"] == 0
    assert s["groups_trained"] == 0 and s["groups_lost"] == 0
    text = (run.run_dir / "logs" / "dataflow.log").read_text()
    assert "groups were all dropped (the newest: filtered_equal_reward)" in text


def test_a_run_whose_data_runs_out_before_its_steps_ends_as_stalled(runs) -> None:
    """One epoch of 10 prompts, batches of 4, 50 steps: after two batches no batch can ever
    form. The run ends as stalled (exit 1) with the fix, instead of the trainer waiting forever;
    what was trained is kept (its final checkpoint and summary)."""
    run = runs(
        "--set", "dataset.size=10", "--set", "dataset.num_epochs=1",
        "--set", "trainer.num_steps=50", "--set", "eval.every_steps=0",
    )  # fmt: skip
    assert run.wait(180) == 1, run.output()
    s = run.summary()
    assert s["status"].startswith("stalled: training data exhausted"), s["status"]
    # The step the last trainer poll saw (it may trail the acknowledgement by a tick).
    assert re.search(r"policy policy is at step [12] of 50 with 2 groups buffered", s["status"])
    assert "raise dataset.num_epochs or lower trainer.num_steps" in s["status"]
    assert s["steps"] == 2 and s["groups_lost"] == 0 and s["groups_duplicated"] == 0


def test_a_run_whose_data_lasts_exactly_its_steps_completes(runs) -> None:
    """8 prompts, one epoch, batches of 4, 2 steps: the data runs out as the last step is
    taken, which is no stall."""
    run = runs(
        "--set", "dataset.size=8", "--set", "dataset.num_epochs=1",
        "--set", "trainer.num_steps=2", "--set", "eval.every_steps=0",
    )  # fmt: skip
    assert run.wait(180) == 0, run.output()
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == 2 and s["groups_lost"] == 0


def test_logs_are_kept_small_and_the_trainers_steps_are_still_read(runs) -> None:
    """supervision.max_log_bytes: every child's log and the supervisor's own are rotated
    while the run goes on, and the observer, which reads the trainer's step lines from its
    log, still sees every step."""
    run = runs(
        "--set", "trainer.num_steps=8", "--set", "eval.every_steps=0",
        "--set", "supervision.max_log_bytes=256", "--set", "supervision.log_backups=2",
        # Looked at often: 8 steps take under 2 s on a quick machine.
        "--set", "supervision.log_check_interval_s=0.1",
    )  # fmt: skip
    assert run.wait(120) == 0, run.output()
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == 8
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    rows = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    logs = run.run_dir / "logs"
    rotated = {p.name.removesuffix(".log.1") for p in logs.glob("*.log.1")}
    assert {"trainer-policy", "supervisor"} <= rotated, sorted(rotated)
    assert not list(logs.glob("*.log.3"))  # two copies kept
    for copy in logs.glob("*.log.[12]"):
        assert b"\0" not in copy.read_bytes(), copy
