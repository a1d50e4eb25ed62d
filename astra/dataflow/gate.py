"""Admission control for new rollouts: the Flux mode gate, its staleness score, AReaL capacity.

`ModeGate` decides, from a staleness score, the free generation capacity, the buffer fill and
the number of rollouts in flight, whether Dataflow may dispatch new work (ASYNC_RUNNING), must
drain in-flight work first (SYNC_BARRIER, with hysteresis and a minimum duration), or must pause
(THROTTLED). `StalenessTracker` computes the Flux staleness score and smooths it with an EMA.
`offpolicy_capacity` is AReaL's bound on how many groups may be generated for the current
version without exceeding the off-policy bound eta.

Pure decisions over numbers: this module never touches gRPC, protobuf, buffers, threads or the
wall clock (the gate's clock is injected), and it never dispatches or cancels anything itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from astra.dataflow.config import GateSettings


class GateMode(Enum):
    ASYNC_RUNNING = "async_running"
    """Normal operation: new rollouts are admitted."""
    SYNC_BARRIER = "sync_barrier"
    """Too stale: admit nothing until in-flight rollouts drain and staleness falls."""
    THROTTLED = "throttled"
    """No capacity or the buffer is nearly full: admit nothing (backpressure)."""


@dataclass(frozen=True, slots=True)
class GateState:
    """One decision of the gate, with the inputs it was made from."""

    mode: GateMode
    reason: str
    staleness: float
    capacity: int
    buffer_fill_ratio: float
    in_flight: int

    @property
    def can_admit(self) -> bool:
        return self.mode is GateMode.ASYNC_RUNNING


class ModeGate:
    """The Flux mode gate. Not thread-safe: the caller serialises `evaluate`."""

    def __init__(
        self, config: GateSettings | None = None, clock: Callable[[], float] | None = None
    ):
        self.config = config or GateSettings()
        self._clock = clock or time.monotonic
        self._barrier_since: float | None = None
        self._state = GateState(GateMode.ASYNC_RUNNING, "initial", 0.0, 0, 0.0, 0)

    @property
    def state(self) -> GateState:
        return self._state

    @property
    def mode(self) -> GateMode:
        return self._state.mode

    @property
    def can_admit(self) -> bool:
        return self._state.can_admit

    def evaluate(
        self, staleness: float, capacity: int, buffer_fill_ratio: float, in_flight: int
    ) -> GateState:
        """Decide the mode from the current numbers and remember it.

        Checked in order: capacity <= low watermark -> THROTTLED; staleness > threshold ->
        SYNC_BARRIER; fill > high watermark -> THROTTLED; while in SYNC_BARRIER stay there if
        rollouts are in flight, staleness > exit_ratio * threshold, or the barrier is younger
        than its minimum duration; otherwise ASYNC_RUNNING. A THROTTLED decision ends a barrier.
        """
        cfg = self.config
        now = self._clock()
        exit_level = cfg.barrier_exit_ratio * cfg.barrier_staleness_score
        in_barrier = self._barrier_since is not None
        held = now - self._barrier_since if self._barrier_since is not None else 0.0
        if capacity <= cfg.capacity_low_watermark:
            mode = GateMode.THROTTLED
            reason = f"capacity {capacity} <= low watermark {cfg.capacity_low_watermark}"
        elif staleness > cfg.barrier_staleness_score:
            mode = GateMode.SYNC_BARRIER
            reason = f"staleness {staleness:.3f} > threshold {cfg.barrier_staleness_score:.3f}"
        elif buffer_fill_ratio > cfg.buffer_high_watermark:
            mode = GateMode.THROTTLED
            reason = (
                f"buffer fill {buffer_fill_ratio:.3f} > high watermark "
                f"{cfg.buffer_high_watermark:.3f}"
            )
        elif in_barrier and in_flight > 0:
            mode = GateMode.SYNC_BARRIER
            reason = f"barrier: draining {in_flight} in-flight rollouts"
        elif in_barrier and staleness > exit_level:
            mode = GateMode.SYNC_BARRIER
            reason = f"barrier: staleness {staleness:.3f} > exit level {exit_level:.3f}"
        elif in_barrier and held < cfg.min_barrier_duration_s:
            mode = GateMode.SYNC_BARRIER
            reason = f"barrier: held {held:.3f}s < minimum {cfg.min_barrier_duration_s:.3f}s"
        else:
            mode = GateMode.ASYNC_RUNNING
            reason = (
                f"running: staleness {staleness:.3f}, capacity {capacity}, "
                f"fill {buffer_fill_ratio:.3f}, in flight {in_flight}"
            )
        if mode is GateMode.SYNC_BARRIER:
            if not in_barrier:
                self._barrier_since = now
        else:
            self._barrier_since = None
        self._state = GateState(mode, reason, staleness, capacity, buffer_fill_ratio, in_flight)
        return self._state


class StalenessTracker:
    """The Flux staleness score in [0, 1], smoothed by an EMA.

    raw = 0.4 * min(1, KL / 0.1) + 0.3 * min(1, IW-variance / 2) + 0.3 * min(1, gap / 5).
    A term whose input is None is left out and the remaining weights renormalised, so with
    neither KL nor IW variance (behaviour and current log-probs coincide) the score is
    min(1, gap / 5). Negative inputs count as 0. `gap_allowance` is the version gap left out
    (the gap term reads max(0, gap - allowance)): the lag an off-policy bound already allows.
    The first update seeds the EMA; later ones give value = alpha * raw + (1 - alpha) * value.
    """

    def __init__(
        self,
        alpha: float = 0.1,
        *,
        kl_weight: float = 0.4,
        iw_weight: float = 0.3,
        gap_weight: float = 0.3,
        kl_scale: float = 0.1,
        iw_scale: float = 2.0,
        gap_scale: float = 5.0,
        gap_allowance: float = 0.0,
    ):
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        if min(kl_weight, iw_weight) < 0 or not gap_weight > 0:
            raise ValueError("weights must be >= 0 and gap_weight > 0")
        if not min(kl_scale, iw_scale, gap_scale) > 0:
            raise ValueError("scales must be > 0")
        if not gap_allowance >= 0:
            raise ValueError("gap_allowance must be >= 0")
        self.alpha, self.gap_allowance = alpha, gap_allowance
        self._terms = ((kl_weight, kl_scale), (iw_weight, iw_scale), (gap_weight, gap_scale))
        self._value: float | None = None
        self.last_raw = 0.0

    @property
    def value(self) -> float:
        """The smoothed score; 0.0 before the first update."""
        return 0.0 if self._value is None else self._value

    def update(
        self, version_gap: float, kl: float | None = None, iw_var: float | None = None
    ) -> float:
        """Fold one observation into the EMA and return the smoothed score."""
        weighted = 0.0
        total_weight = 0.0
        beyond = version_gap - self.gap_allowance
        for (weight, scale), x in zip(self._terms, (kl, iw_var, beyond), strict=True):
            if x is None:
                continue
            if math.isnan(x):
                raise ValueError("staleness inputs must not be NaN")
            weighted += weight * min(1.0, max(0.0, x) / scale)
            total_weight += weight
        raw = weighted / total_weight
        self.last_raw = raw
        if self._value is None:
            self._value = raw
        else:
            self._value = self.alpha * raw + (1 - self.alpha) * self._value
        return self._value


def offpolicy_capacity(
    eta: int, version: int, batch_groups: int, accepted: int, running: int, max_concurrent: int
) -> int:
    """How many more groups may be started now (AReaL), never below 0.

    min(max_concurrent - running, (eta + version + 1) * batch_groups - (accepted + running)).
    `version` is the trainer's current version, `accepted` the groups accepted into the buffer
    (including those already consumed) counted from version 0 in the same units, `running` the
    groups in flight. eta = 0 is synchronous: only one batch's worth per version may be
    generated, so every trained group comes from the version being trained. A caller restarting
    at version V must restore `accepted` on the same origin (not reset it to 0).
    """
    if eta < 0 or version < 0 or batch_groups < 1:
        raise ValueError("need eta >= 0, version >= 0, batch_groups >= 1")
    if accepted < 0 or running < 0 or max_concurrent < 0:
        raise ValueError("accepted, running and max_concurrent must be >= 0")
    budget = (eta + version + 1) * batch_groups - (accepted + running)
    return max(0, min(max_concurrent - running, budget))
