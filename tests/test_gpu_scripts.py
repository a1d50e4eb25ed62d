"""The GPU trainer check stays runnable: its CPU dry run (gloo ranks, same code as NCCL).

(tools/gpu/run_engines.py --fake is a manual dry run: the HTTP adapters it drives are tested
against the FAKE servers in tests/test_engine_http.py.)
"""

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
    assert proc.stdout.count(" ok") == 4 and "FAILED" not in proc.stdout


def test_trainer_profile_cpu_dry_run():
    cmd = [sys.executable, str(ROOT / "tools/gpu/profile_trainer.py"), "--device", "cpu"]
    proc = subprocess.run(
        [*cmd, "--steps", "2", "--warm", "1"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("memory sink")]
    assert rows and float(rows[0][-2]) > 0  # total ms of a step that published
    assert "no sink, profiled" in proc.stdout and "aten::mm" in proc.stdout


def test_shaped_reward_is_the_digit_share() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "shaped_reward", Path(__file__).resolve().parents[1] / "tools/gpu/shaped_reward.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.digit_share({}, "") == 0.0
    assert module.digit_share({}, "a1b2") == 0.5
    assert module.digit_share({}, "٣7") == 0.5  # ASCII digits only
