"""The fault campaign's tool (tools/chaos/campaign.py, `make chaos`) works: one scenario runs
and is audited, and the audit fails a run that lost its groups or left a process behind."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _campaign():
    spec = importlib.util.spec_from_file_location("campaign", ROOT / "tools/chaos/campaign.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_scenario_runs_and_passes_its_audit(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "tools/chaos/campaign.py"), "--steps", "6"]
    cmd += ["--only", "kill-supervisor-then-resume", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| kill-supervisor-then-resume | PASS |" in done.stdout


def test_the_audit_fails_what_it_should(tmp_path: Path) -> None:
    campaign = _campaign()
    run = campaign.Run(tmp_path / "r", steps=4)
    run.run_dir.mkdir()
    run.codes = [0]
    summary = {"status": "completed", "steps": 4, "groups_lost": 3, "groups_duplicated": 0}
    (run.run_dir / "summary.json").write_text(json.dumps(summary))
    sleeper = subprocess.Popen(["sh", "-c", "sleep 30", "sh", str(run.run_dir)])
    try:
        cmdline = Path(f"/proc/{sleeper.pid}/cmdline")
        deadline = time.monotonic() + 10
        while str(run.run_dir).encode() not in cmdline.read_bytes():  # until it has exec'd
            assert time.monotonic() < deadline, "the sleeper never started"
            time.sleep(0.01)
        assert any(f.startswith(f"{sleeper.pid}: ") for f in campaign.leftovers(run.run_dir))
    finally:
        sleeper.kill()
        sleeper.wait(10)
    assert campaign.leftovers(run.run_dir) == []
    failed = campaign.audit(run)
    assert "summary groups_lost = 3" in failed
    assert any("batches < steps" in f for f in failed)  # no Dataflow database at all
