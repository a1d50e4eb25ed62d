"""tools/bench/swap_pause.py: its verdict, and an engine it cannot run is reported, not faked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import swap_pause


def row(engine: str, share: float) -> dict:
    return {
        "engine": engine, "wall_s": 1.0, "steps": 10, "raas": 1, "swaps": 9,
        "pause_per_swap_s": share * 2.0, "between_s": 2.0, "share": share,
    }  # fmt: skip


def test_the_verdict_needs_every_engine_under_five_percent():
    met = swap_pause.section([row("a", 0.01), row("b", 0.049)], [], "0", 1.0)
    assert "each engine): met; the largest share is 4.90%" in met
    missed = swap_pause.section([row("a", 0.01), row("b", 0.2)], [], "0", 1.0)
    assert "missed; the largest share is 20.00%" in missed
    assert "| b | 10 | 1 | 9 | 400.00 | 2.00 | **20.00%** |" in missed


def test_a_missing_vllm_is_reported_and_fails_unless_skipped(monkeypatch, capsys):
    monkeypatch.setattr(swap_pause, "vllm_python", lambda: None)
    ran = []

    def fake_run(name, recipe, steps, root, timeout_s):
        ran.append(name)
        return row(name, 0.01)

    monkeypatch.setattr(swap_pause, "run_engine", fake_run)
    assert swap_pause.main(["--no-write", "--steps", "2"]) == 1
    out = capsys.readouterr().out
    assert "not measured: .venv-vllm missing" in out and "not fully measured" in out
    assert ran == ["built-in (torch)"]  # vLLM never run, no figure written for it
    assert swap_pause.main(["--no-write", "--skip-missing"]) == 0


@pytest.mark.slow
def test_a_short_run_of_the_built_in_engine_counts_its_swaps(tmp_path):
    got = swap_pause.run_engine(
        "built-in (torch)", ["configs/recipes/default.yaml"], 6, tmp_path, 600
    )
    assert got["swaps"] >= 5 and 0 < got["pause_per_swap_s"] < 1.0
    assert 0 < got["share"] < 1.0
