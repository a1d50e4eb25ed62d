"""ModeGate, StalenessTracker and offpolicy_capacity: order, hysteresis, formulas, eta = 0."""

from __future__ import annotations

import math

import pytest

from astra.dataflow.buffer import PolicyBuffer
from astra.dataflow.config import BufferSettings, GateSettings
from astra.dataflow.gate import GateMode, ModeGate, StalenessTracker, offpolicy_capacity
from astra.dataflow.records import GroupRecord, TrajectoryRecord


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_gate() -> tuple[ModeGate, FakeClock]:
    clock = FakeClock()
    return ModeGate(GateSettings(), clock=clock), clock


def test_starts_admitting() -> None:
    gate, _ = make_gate()
    assert gate.mode is GateMode.ASYNC_RUNNING and gate.can_admit


def test_capacity_checked_before_staleness() -> None:
    gate, _ = make_gate()
    state = gate.evaluate(staleness=0.9, capacity=0, buffer_fill_ratio=0.95, in_flight=3)
    assert state.mode is GateMode.THROTTLED and not state.can_admit
    assert "capacity 0" in state.reason and "0" in state.reason


def test_staleness_checked_before_buffer_fill() -> None:
    gate, _ = make_gate()
    state = gate.evaluate(staleness=0.31, capacity=5, buffer_fill_ratio=0.95, in_flight=0)
    assert state.mode is GateMode.SYNC_BARRIER
    assert "0.310" in state.reason and "0.300" in state.reason


def test_buffer_fill_throttles_and_recovers() -> None:
    gate, _ = make_gate()
    state = gate.evaluate(staleness=0.1, capacity=5, buffer_fill_ratio=0.91, in_flight=2)
    assert state.mode is GateMode.THROTTLED and "0.910" in state.reason
    state = gate.evaluate(staleness=0.1, capacity=5, buffer_fill_ratio=0.5, in_flight=2)
    assert state.mode is GateMode.ASYNC_RUNNING and state.can_admit


def test_boundaries_are_strict() -> None:
    gate, _ = make_gate()
    assert gate.evaluate(0.3, 1, 0.9, 0).mode is GateMode.ASYNC_RUNNING
    assert gate.evaluate(0.0, 0, 0.0, 0).mode is GateMode.THROTTLED  # capacity <= watermark


def test_state_records_inputs() -> None:
    gate, _ = make_gate()
    state = gate.evaluate(0.12, 7, 0.25, 3)
    assert (state.staleness, state.capacity, state.buffer_fill_ratio, state.in_flight) == (
        0.12,
        7,
        0.25,
        3,
    )
    assert gate.state is state


def test_barrier_hysteresis_in_flight_and_min_duration() -> None:
    gate, clock = make_gate()
    assert gate.evaluate(0.35, 5, 0.1, 4).mode is GateMode.SYNC_BARRIER
    clock.now += 1.0
    # Below the threshold but above 0.8 * 0.3 = 0.24: stays.
    state = gate.evaluate(0.28, 5, 0.1, 0)
    assert state.mode is GateMode.SYNC_BARRIER and "0.240" in state.reason
    # Staleness fine but rollouts still in flight: stays.
    state = gate.evaluate(0.2, 5, 0.1, 2)
    assert state.mode is GateMode.SYNC_BARRIER and "2 in-flight" in state.reason
    state = gate.evaluate(0.2, 5, 0.1, 0)
    assert state.mode is GateMode.ASYNC_RUNNING and gate.can_admit
    # Outside a barrier, 0.28 is fine: hysteresis only applies once inside.
    assert gate.evaluate(0.28, 5, 0.1, 0).mode is GateMode.ASYNC_RUNNING


def test_barrier_lasts_its_minimum_duration_from_entry() -> None:
    gate, clock = make_gate()
    gate.evaluate(0.5, 5, 0.1, 0)
    clock.now += 0.05
    assert gate.evaluate(0.5, 5, 0.1, 0).mode is GateMode.SYNC_BARRIER  # does not restart timer
    clock.now += 0.04
    state = gate.evaluate(0.0, 5, 0.1, 0)
    assert state.mode is GateMode.SYNC_BARRIER and "minimum" in state.reason
    clock.now += 0.02  # 0.11 s since entry
    assert gate.evaluate(0.0, 5, 0.1, 0).mode is GateMode.ASYNC_RUNNING
    # A new barrier starts a new timer.
    gate.evaluate(0.5, 5, 0.1, 0)
    clock.now += 0.05
    assert gate.evaluate(0.0, 5, 0.1, 0).mode is GateMode.SYNC_BARRIER


def test_throttle_ends_a_barrier() -> None:
    gate, clock = make_gate()
    gate.evaluate(0.5, 5, 0.1, 0)
    assert gate.evaluate(0.28, 0, 0.1, 0).mode is GateMode.THROTTLED
    clock.now += 0.01
    assert gate.evaluate(0.28, 5, 0.1, 0).mode is GateMode.ASYNC_RUNNING


@pytest.mark.parametrize(
    "kwargs",
    [
        {"barrier_staleness_score": 0.0},
        {"buffer_high_watermark": 1.5},
        {"min_barrier_duration_s": -1.0},
        {"barrier_exit_ratio": 0.0},
    ],
)
def test_bad_gate_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        GateSettings(**kwargs)


def test_staleness_gap_only_and_ema() -> None:
    tracker = StalenessTracker()
    assert tracker.value == 0.0
    assert tracker.update(5) == pytest.approx(1.0)  # first sample seeds the EMA
    assert tracker.update(0) == pytest.approx(0.9)
    assert tracker.update(10) == pytest.approx(0.1 * 1.0 + 0.9 * 0.9)
    assert StalenessTracker().update(2) == pytest.approx(0.4)


def test_staleness_full_formula() -> None:
    tracker = StalenessTracker()
    expected = 0.4 * min(1, 0.05 / 0.1) + 0.3 * min(1, 1.0 / 2) + 0.3 * min(1, 1 / 5)
    assert tracker.update(1, kl=0.05, iw_var=1.0) == pytest.approx(expected)
    assert tracker.last_raw == pytest.approx(expected)
    saturated = StalenessTracker().update(50, kl=3.0, iw_var=9.0)
    assert saturated == pytest.approx(1.0)


def test_staleness_missing_term_renormalises_and_clamps() -> None:
    only_kl = StalenessTracker().update(0, kl=0.1)
    assert only_kl == pytest.approx(0.4 / 0.7)
    assert StalenessTracker().update(-3, kl=-0.2, iw_var=-1.0) == 0.0
    with pytest.raises(ValueError):
        StalenessTracker().update(math.nan)
    with pytest.raises(ValueError):
        StalenessTracker(alpha=0.0)


def test_staleness_leaves_out_the_allowed_gap() -> None:
    tracker = StalenessTracker(gap_allowance=2)
    assert tracker.update(2) == 0.0  # within what the off-policy bound allows
    assert tracker.update(3.5) == pytest.approx(0.1 * 0.3)  # (3.5 - 2) / 5, folded in
    assert StalenessTracker(gap_allowance=2).update(9) == pytest.approx(1.0)
    assert StalenessTracker(gap_allowance=2).update(1, kl=0.1) == pytest.approx(0.4 / 0.7)
    with pytest.raises(ValueError, match="gap_allowance"):
        StalenessTracker(gap_allowance=-1)


def test_the_gap_allowance_defaults_to_eta() -> None:
    assert GateSettings().gap_allowance == 2  # the default max_version_lag
    assert GateSettings(max_version_lag=8).gap_allowance == 8
    assert GateSettings(max_version_lag=None).gap_allowance == 0  # no bound: all the gap
    assert GateSettings(max_version_lag=8, barrier_gap_allowance=0).gap_allowance == 0
    assert GateSettings(max_version_lag=None, barrier_gap_allowance=3).gap_allowance == 3
    with pytest.raises(ValueError, match="barrier_gap_allowance"):
        GateSettings(barrier_gap_allowance=-1)


def test_capacity_formula() -> None:
    # (eta + version + 1) * batch - (accepted + running), capped by free slots.
    assert offpolicy_capacity(2, 3, 4, 10, 5, 100) == (2 + 3 + 1) * 4 - 15
    assert offpolicy_capacity(2, 3, 4, 0, 5, 8) == 3
    assert offpolicy_capacity(0, 0, 4, 10, 0, 100) == 0  # never negative
    assert offpolicy_capacity(0, 0, 4, 0, 9, 8) == 0
    with pytest.raises(ValueError):
        offpolicy_capacity(-1, 0, 4, 0, 0, 8)
    with pytest.raises(ValueError):
        offpolicy_capacity(0, 0, 0, 0, 0, 8)


def test_eta_zero_allows_one_batch_per_version() -> None:
    assert offpolicy_capacity(0, 0, 4, 0, 0, 100) == 4
    assert offpolicy_capacity(0, 0, 4, 0, 4, 100) == 0
    assert offpolicy_capacity(0, 0, 4, 4, 0, 100) == 0
    assert offpolicy_capacity(0, 1, 4, 4, 0, 100) == 4
    assert offpolicy_capacity(1, 0, 4, 0, 0, 100) == 8


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_capacity_and_buffer_bound_trained_staleness(eta: int) -> None:
    """Generate only within capacity; every trained group is at most eta versions old."""
    batch = 3
    buf = PolicyBuffer(BufferSettings(max_version_lag=eta, drop_equal_rewards=False))
    version, accepted, started = 0, 0, 0
    running: list[GroupRecord] = []
    for _ in range(60):
        free = offpolicy_capacity(eta, version, batch, accepted, len(running), 100)
        for _ in range(free):
            t = TrajectoryRecord(f"t{started}", 1.0, version, version, 4)
            running.append(GroupRecord(f"g{started}", "p", 0, [t]))
            started += 1
        # Half the in-flight groups finish each tick, oldest first.
        done, running = running[: (len(running) + 1) // 2], running[(len(running) + 1) // 2 :]
        for g in done:
            assert buf.add(g, version) == "accepted"
            accepted += 1
        taken = buf.take(batch, version)
        if taken is not None:
            assert all(g.staleness(version) <= eta for g in taken)
            version += 1
    assert version > 10
    if eta == 0:
        assert buf.counters["filtered_stale"] == 0  # nothing was generated that would be wasted
