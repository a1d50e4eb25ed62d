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
