"""`astra trainer check`: Astra's own trainer passes every rule; each switch of the broken
trainer (astra.testing.broken_trainer) fails exactly the rule it names, and the broken
trainer with no switch passes every rule. The rules themselves are also judged on
hand-made recordings (no process, no network)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from astra.testing.broken_trainer import SWITCHES
from astra.trainer.check_cli import trainer_group
from astra.trainer.contract_rules import RULES, Event, Recording, evaluate
from tests.conftest import save_tiny_trainer_model

BROKEN = [sys.executable, "-m", "astra.testing.broken_trainer"]
BROKEN += ["--dataflow", "{dataflow}", "--weights", "{weights}", "--policy", "{policy}"]
LEASE_S = "2"


def check(
    command: list[str], *flags: str, log: Path | None = None, timeout: str = "60", steps: str = "2"
) -> tuple[int, dict]:
    args = ["check", "--json", "--steps", steps, "--lease", LEASE_S, "--timeout", timeout, *flags]
    args += ["--log", str(log)] if log is not None else []
    result = CliRunner().invoke(trainer_group, [*args, "--", *command])
    return result.exit_code, json.loads(result.output.splitlines()[-1])


def statuses(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def test_every_switch_names_a_rule() -> None:
    names = {name for name, _, _ in RULES}
    assert set(SWITCHES.values()) <= names
    assert len(SWITCHES) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_each_switch_fails_exactly_its_rule(switch: str, tmp_path: Path) -> None:
    restart = ("--restart",) if switch == "no_resume_flag" else ()
    command = [*BROKEN, "--lease-s", LEASE_S, "--switch", switch]
    timeout = "6" if switch == "stall" else "60"  # it never gets there: do not wait long
    # skip_version's wrong announce follows its second publish, and the check stops the
    # trainer once --steps publishes are committed: a third step makes sure it was made.
    steps = "3" if switch == "skip_version" else "2"
    log = tmp_path / "trainer.log"
    code, report = check(command, *restart, log=log, timeout=timeout, steps=steps)
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failed] == [SWITCHES[switch]], (report, _tail(tmp_path))
    assert code == 1 and failed[0]["detail"]


@pytest.mark.slow
def test_the_broken_trainer_without_a_switch_passes_every_rule(tmp_path: Path) -> None:
    code, report = check([*BROKEN, "--lease-s", LEASE_S], "--restart", log=tmp_path / "t.log")
    assert code == 0 and report["fail"] == 0, (report, _tail(tmp_path))
    seen = statuses(report)
    assert seen["restart_resumes"] == seen["retry_reuses_request_id"] == "pass"


@pytest.mark.slow
@pytest.mark.timeout(300)  # two starts of a torch process, on a loaded machine
def test_astras_trainer_passes_every_rule_across_a_restart(tmp_path: Path, monkeypatch) -> None:
    model = save_tiny_trainer_model(tmp_path / "model")
    monkeypatch.setenv("ASTRA_TRAINER__BATCH__NUM_GROUPS", "1")
    command = [sys.executable, "-m", "astra.trainer", "--dataflow", "{dataflow}"]
    command += ["--weights", "{weights}", "--policy", "{policy}", "--model", str(model)]
    command += ["--port", "0", "--log-level", "info"]
    code, report = check(command, "--restart", log=tmp_path / "trainer.log")
    assert code == 0 and report["fail"] == 0, (report, _tail(tmp_path))
    seen = statuses(report)
    must = ("trains", "retry_reuses_request_id", "batches_acknowledged_in_lease")
    must += ("ack_before_announce", "announce_after_commit", "restart_resumes")
    assert all(seen[name] == "pass" for name in must), seen


def test_placeholders_are_filled_and_a_missing_command_is_exit_1(tmp_path: Path) -> None:
    result = CliRunner().invoke(trainer_group, ["check", "--", "{nope}"])
    assert result.exit_code == 2 and "placeholder" in result.output
    missing = str(tmp_path / "no-such-trainer")
    result = CliRunner().invoke(trainer_group, ["check", "--", missing, "{dataflow}"])
    assert result.exit_code == 1


def _run(events: list[tuple[float, int, str, dict]], steps: int = 1) -> dict[str, str]:
    recording = Recording([Event(*e) for e in events], steps, restarted=False)
    return {v.name: v.status for v in evaluate(recording)}


def test_a_lease_kept_by_extensions_passes_and_one_that_lapses_fails() -> None:
    fetch = {"request_id": "r", "num_groups": 1, "outcome": "batch", "batch_id": "b", "expire": 2.0}
    start = (0.0, 1, "run_start", {"current_version": 0})
    extend = (1.5, 1, "extend", {"batch_id": "b", "outcome": "ok", "expire": 4.0})
    ack = (3.5, 1, "ack", {"batch_id": "b", "untrained_reason": "", "outcome": "ok"})
    end = (9.0, 1, "run_end", {})
    kept = _run([start, (0.1, 1, "fetch", fetch), extend, ack, end])
    assert kept["batches_acknowledged_in_lease"] == "pass"
    assert kept["trains"] == "fail"  # nothing committed: the rules saw nothing trained
    lapsed = _run([start, (0.1, 1, "fetch", fetch), ack, end])
    assert lapsed["batches_acknowledged_in_lease"] == "fail"
    killed = _run([start, (0.1, 1, "fetch", fetch), (1.0, 1, "run_end", {})])
    assert killed["batches_acknowledged_in_lease"] == "pass"  # the process ended first


def _tail(tmp_path: Path) -> str:
    logs = [p for p in tmp_path.glob("*.log") if p.is_file()]
    return "".join(p.read_text(errors="replace")[-3000:] for p in logs) + os.linesep
