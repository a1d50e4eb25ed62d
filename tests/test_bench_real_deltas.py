"""tools/bench/real_deltas.py: its verdicts and table from figures given."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import real_deltas as rd


def trace(lr: float, wire: float, n: int = 1000, mismatches: int = 0) -> rd.Trace:
    figs = [rd.VersionFig(v, wire * 0.9, wire, 0.01, 0.005, 0.05, "delta") for v in range(1, n + 1)]
    return rd.Trace(lr, figs, mismatches, 20, 0, [0.5] * n * rd.PROMPTS, 10.0, full_bytes=2**20)


ARGS = SimpleNamespace(check_every=50, params=10.4e6, warmup=300, compute_dtype="float32")


def test_the_median_target_is_met_only_at_or_under_one_percent_at_lr_1e_6() -> None:
    met = rd.render([trace(1e-6, 0.009), trace(1e-5, 0.05)], ARGS, 1.0, "0")
    assert "| median delta ≤ 1% of the full size at lr 1e-6 | 0.900% | met |" in met
    assert "| 0 mismatches over 1,000 versions | 1,000 versions, 0 mismatches | met |" in met
    missed = rd.render([trace(1e-6, 0.011)], ARGS, 1.0, "0")
    assert "| 1.100% | **missed** |" in missed


def test_a_mismatch_or_a_short_trace_misses_the_exactness_target() -> None:
    bad = rd.render([trace(1e-6, 0.005, mismatches=1)], ARGS, 1.0, "0")
    assert "mismatches | **missed** |" in bad
    assert "| 1 of 1,000 |" in bad
    short = rd.render([trace(1e-6, 0.005, n=999)], ARGS, 1.0, "0")
    assert "999 versions, 0 mismatches | **missed** |" in short
