"""tools/bench/checkpoint_stall.py --quick --tiny-only: both modes run against a real
WeightService, each writes checkpoints, and the section it prints opens with their table
(the ~100M model, a minute more, runs in the full benchmark)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_form_measures_both_modes():
    proc = subprocess.run(
        [sys.executable, "tools/bench/checkpoint_stall.py", "--quick", "--tiny-only"],
        capture_output=True,
        text=True,
        timeout=580,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    section = proc.stdout[proc.stdout.index("## Trainer: checkpoint stall") :]
    rows = re.findall(
        r"^\| (tiny|~100M) \([\d.]+M\) \| (staged|drained) \| ([\d.]+) ", section, re.M
    )
    assert {(m, mode) for m, mode, _ in rows} == {("tiny", mode) for mode in ("staged", "drained")}
    assert all(float(s) > 0 for _, _, s in rows)
    assert "section of BENCHMARKS.md" not in proc.stdout  # --quick prints only
