"""tools/bench/staleness.py and tools/bench/lora.py: their verdicts from figures given."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import lora
import staleness


def srow(name: str, held: float, idle: float) -> dict:
    return {
        "variant": name, "wall_s": 1.0, "steps": 300, "held_out_last": held, "last10": held,
        "idle": idle, "gap": 2.0, "m2po": 0.0, "band": 0.0, "lost": 0, "observed": 10,
    }  # fmt: skip


def test_staleness_needs_the_best_mask_close_to_eta_2_and_less_idle() -> None:
    met = staleness.section(
        [srow("eta 2", 0.94, 0.8), srow("eta 8", 0.90, 0.1), srow("eta 8 + M2PO", 0.93, 0.05)],
        "0", 1.0,
    )  # fmt: skip
    assert "met (eta 8 + M2PO: held-out 0.93 vs 0.94, trainer idle 5.0% vs 80.0%)" in met
    far = staleness.section([srow("eta 2", 0.94, 0.8), srow("eta 8 + M2PO", 0.90, 0.1)], "0", 1)
    assert "missed (eta 8 + M2PO" in far
    busier = staleness.section([srow("eta 2", 0.94, 0.1), srow("eta 8 + M2PO", 0.94, 0.2)], "0", 1)
    assert "missed" in busier


def test_idle_is_taken_between_the_first_and_last_observed_steps() -> None:
    first = {"fetch_s_sum": 1.0, "total_s_sum": 2.0, "fetch_ms": 900.0, "total_ms": 1000.0}
    last = {"fetch_s_sum": 4.0, "total_s_sum": 8.0, "fetch_ms": 0.0, "total_ms": 100.0}
    assert staleness.idle_share([first, {"fetch_ms": 5.0}, last]) == 0.5  # 3 s of 6
    assert staleness.idle_share([first]) == 0.9  # one row: its own step
    assert staleness.idle_share([]) is None


def test_time_in_barrier_is_taken_from_dataflows_gate_counters() -> None:
    def row(barrier: int, running: int, throttled: int) -> dict:
        c = {"gate_ms.SYNC_BARRIER": barrier, "gate_ms.ASYNC_RUNNING": running}
        return {"dataflow": {"counters": {**c, "gate_ms.THROTTLED": throttled, "other": 9}}}

    rows = [row(100, 100, 0), {"dataflow": {}}, row(300, 500, 200)]
    assert staleness.barrier_share(rows) == 0.25  # 200 ms of 800
    assert staleness.barrier_share(rows[:1]) is None


def lrow(name: str, held: float) -> dict:
    return {
        "variant": name, "wall_s": 1.0, "steps": 300, "held_out_first": 0.86,
        "held_out_last": held, "last10": held, "lost": 0,
        "stored": {"full": [2048], "delta": [1024, 3072]}, "fetched": [1024, 1024, 4096],
    }  # fmt: skip


def test_lora_is_within_five_points_of_full_fine_tuning_or_missed() -> None:
    met = lora.section([lrow("full", 0.93), lrow("lora", 0.90)], "0", 1.0)
    assert "met; full minus LoRA is +0.03" in met
    assert "| lora | 300 | 1 | 0.86 | **0.90** | 0.90 | 0 | 2.0 | 2.0 | 1.0 |" in met
    assert "missed" in lora.section([lrow("full", 0.93), lrow("lora", 0.80)], "0", 1.0)
