"""Noticing a run that stopped taking steps: a warning that says why, then (optionally) its end.

A run whose trainers wait for batches that never come (every RaaS gone, the gate throttled,
Dataflow unreachable) prints nothing on its own and holds its machines. `ProgressWatch` is
told of every step a trainer logs (`stepped`) and, each observer tick, `check`s how long the
policy that waited longest has gone without one: past `warn_after_s` it logs a warning naming
what Dataflow and the trainers last said (the gate and its reason, the buffer, the RaaS), again
every `warn_after_s` while it lasts; past `fail_after_s` (0: never) `check` returns the reason
the run ends as stalled. A paused trainer is not waiting: its clock starts again on resume,
as it does when the trainer restarts (`stepped`); one that reached `num_steps` is done, not
waiting. The first step counts from the trainers' start: with a large model whose first batch
needs long rollouts, set warn_after_s above that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("astra.run.observe")


class ProgressWatch:
    def __init__(
        self,
        policies: Iterable[str],
        *,
        warn_after_s: float = 300.0,
        fail_after_s: float = 0.0,
        num_steps: int = 0,
        now: float | None = None,
    ) -> None:
        start = time.monotonic() if now is None else now
        self.warn_after_s, self.fail_after_s = warn_after_s, fail_after_s
        self.num_steps = num_steps
        self.last_step_at = dict.fromkeys(policies, start)
        self.warned_at: float | None = None
        self.warnings = 0

    def stepped(self, policy: str, now: float | None = None) -> None:
        self.last_step_at[policy] = time.monotonic() if now is None else now

    def check(
        self,
        trainers: dict[str, dict[str, Any]],
        dataflow: dict[str, Any],
        dataflow_error: str | None,
        now: float | None = None,
        refusal: str = "",
    ) -> str | None:
        """Warns while a policy takes no step (see the module docstring); the reason to end the
        run once that lasted fail_after_s, else None."""
        now = time.monotonic() if now is None else now
        waiting = {}
        for policy, since in self.last_step_at.items():
            t = trainers.get(policy, {})
            if self.num_steps and t.get("step", 0) >= self.num_steps:
                continue  # done: its trainer finished, the others may go on
            if t.get("paused"):
                since = self.last_step_at[policy] = now
            waiting[policy] = since
        bounds = [t for t in (self.warn_after_s, self.fail_after_s) if t > 0]
        policy, since = min(waiting.items(), key=lambda kv: kv[1], default=("", now))
        idle = now - since
        if not policy or not bounds or idle < min(bounds):
            self.warned_at = None
            return None
        why = explain(policy, trainers, dataflow, dataflow_error)
        if refusal:  # the likely cause, first
            why = f"RaaS refuse the groups sent ({refusal}); {why}"
        if self.fail_after_s and idle >= self.fail_after_s:
            return (
                f"stalled: policy {policy} took no step for {idle:.0f}s ({why}) "
                f"(supervision.max_idle_s: {self.fail_after_s:g})"
            )
        if self.warn_after_s and (
            self.warned_at is None or now - self.warned_at >= self.warn_after_s
        ):
            self.warned_at = now
            self.warnings += 1
            log.warning("policy %s took no step for %.0fs: %s", policy, idle, why)
        return None


def explain(
    policy: str,
    trainers: dict[str, dict[str, Any]],
    dataflow: dict[str, Any],
    dataflow_error: str | None,
) -> str:
    """What the last polls said that bears on a policy's waiting, in one line."""
    parts = []
    t = trainers.get(policy)
    parts.append(f"trainer at step {t['step']}, version {t['version']}" if t else "trainer silent")
    if dataflow_error:
        parts.append(f"Dataflow unreachable ({dataflow_error})")
    if dataflow:
        gate = f"gate {dataflow.get('gate', '?')}"
        if reason := dataflow.get("gate_reason"):
            gate += f": {reason}"
        parts.append(gate)
        parts.append(f"{dataflow.get('buffered', {}).get(policy, 0)} groups buffered")
        states = dataflow.get("raas_states") or {}
        parts.append(
            f"RaaS {dataflow.get('raas_active', 0)}/{len(states)} active, "
            f"{dataflow.get('in_flight', 0)} groups in flight"
        )
    return "; ".join(parts)
