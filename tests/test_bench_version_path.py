"""tools/bench/version_path.py: every case runs against a real WeightService process and two
receivers, and the section it prints has a row per case with figures it measured."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = "tools/bench/version_path.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_case_is_measured():
    proc = subprocess.run(
        [sys.executable, BENCH, "--no-write", "--rounds", "2"],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    section = proc.stdout[proc.stdout.index("## Weights: small tensors") :]
    rows = re.findall(
        r"^\| (tiny|lora)(-packed)? \| (\d+) \| [\d.]+ \| new \| ([\d.]+) / ", section, re.M
    )
    assert {(shape, packed, int(n)) for shape, packed, n, _ in rows} == {
        ("tiny", "", 25), ("tiny", "-packed", 1), ("lora", "", 336), ("lora", "-packed", 1)
    }  # fmt: skip
    assert all(float(ms) > 0 for *_, ms in rows)
    assert "ms per further tensor" in section


def test_an_old_checkout_without_its_venv_is_named(tmp_path):
    proc = subprocess.run(
        [sys.executable, BENCH, "--old", str(tmp_path), "--no-write"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"--old {tmp_path}: no .venv there" in proc.stderr
