"""The GPU check scripts stay runnable: their CPU dry runs (FAKE engine servers; gloo ranks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_trainer_check_cpu_dry_run():
    cmd = [sys.executable, str(ROOT / "tools/gpu/run_trainer.py"), "--device", "cpu"]
    proc = subprocess.run(
        [*cmd, "--steps", "2", "--ranks", "2"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "fsdp x2 (gloo)" in proc.stdout
    assert proc.stdout.count(" ok") == 3 and "FAILED" not in proc.stdout


def test_engine_check_against_the_fake_servers(tmp_path: Path):
    out = tmp_path / "engines.json"
    cmd = [sys.executable, str(ROOT / "tools/gpu/run_engines.py"), "--fake", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert out.is_file()
