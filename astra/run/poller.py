"""Polling a run's services: Dataflow's and the trainers' GetStatus, as plain data.

`StatusPoller` asks Dataflow (`poll_dataflow`) and each trainer (`poll_trainer`)
for their status and keeps the last answers as plain JSON values;
`snapshot()` is what astra.run.view draws. `astra top` uses it on its own;
astra.run.observe.Observer builds the run's files on it. A failed Dataflow poll
is kept as `error` (the view shows it), a failed trainer poll is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import grpc

from astra.clients.dataflow import DataflowClient
from astra.clients.trainer import TrainerClient
from astra.dataflow.v1 import dataflow_service_pb2 as dpb


def dataflow_snapshot(resp: dpb.GetStatusResponse) -> dict[str, Any]:
    """The figures of a Dataflow GetStatus this module uses, as plain JSON values."""
    states = [
        dpb.InstanceState.Name(i.state).removeprefix("INSTANCE_STATE_") for i in resp.instances
    ]
    return {
        "gate": dpb.GateMode.Name(resp.gate.mode).removeprefix("GATE_MODE_"),
        "gate_reason": resp.gate.reason,
        "staleness": round(resp.gate.staleness, 4),
        "in_flight": sum(i.in_flight_groups for i in resp.instances),
        "buffer_fill": round(resp.gate.buffer_fill_ratio, 4),
        "buffered": {p.policy_id: p.buffered_groups for p in resp.policies},
        "versions": {p.policy_id: p.current_version for p in resp.policies},
        "raas_active": states.count("ACTIVE"),
        "raas_states": dict(zip((i.instance_id for i in resp.instances), states, strict=True)),
        "pool_empty": resp.pool_empty,
        "counters": dict(sorted(resp.counters.items())),
    }


EVAL_FIELDS = (
    "stream",
    "policy_id",
    "version",
    "groups",
    "groups_done",
    "samples",
    "failed_samples",
    "mean_reward",
    "solved_groups",
    "min_token_version",
    "max_token_version",
    "complete",
)


def eval_results(resp: dpb.GetStatusResponse) -> list[dict[str, Any]]:
    """GetStatus `evals` as plain dicts (astra.run.evals reads them)."""
    return [{k: getattr(e, k) for k in EVAL_FIELDS} for e in resp.evals]


def _state(state: int) -> str:
    return dpb.InstanceState.Name(state).removeprefix("INSTANCE_STATE_")


def dataflow_detail(resp: dpb.GetStatusResponse) -> dict[str, Any]:
    """What the live view draws beyond `dataflow_snapshot` (not written to metrics.jsonl)."""
    return {
        "gate_capacity": resp.gate.capacity,
        "policies": {
            p.policy_id: {
                "buffered": p.buffered_groups,
                "capacity": p.buffer_capacity,
                "replay": p.replay_groups,
                "leased": p.leased_groups,
                "target_version": p.target_version,
                "dropped_in_a_row": p.groups_dropped_in_a_row,
                "last_drop": p.last_drop_reason,
            }
            for p in resp.policies
        },
        "instances": [
            {
                "id": i.instance_id,
                "state": _state(i.state),
                "capacity": i.capacity,
                "free": i.free_slots,
                "in_flight": i.in_flight_groups,
                "failures": i.consecutive_failures,
                "refused_in_a_row": i.submits_refused_in_a_row,
                "last_refusal": i.last_refusal,
                "versions": {v.policy_id: v.version for v in i.loaded_versions},
            }
            for i in resp.instances
        ],
        "streams": [
            {
                "name": st.name,
                "epoch": st.epoch,
                "position": st.position,
                "size": st.size,
                "num_epochs": st.num_epochs,
                "exhausted": st.exhausted,
            }
            for st in resp.streams
        ],
    }


class Throughput:
    """Rates of counters over a sliding window: per key, at most `maxlen` (time, value)
    samples no older than `window_s` (the oldest one kept as the window's start)."""

    def __init__(self, window_s: float = 30.0, maxlen: int = 256) -> None:
        self.window_s, self.maxlen = window_s, maxlen
        self.samples: dict[str, deque[tuple[float, float]]] = {}

    def add(self, now: float, key: str, value: float) -> None:
        q = self.samples.setdefault(key, deque(maxlen=self.maxlen))
        if q and value < q[-1][1]:
            q.clear()  # a counter that went back (a restart): start again
        q.append((now, value))
        while len(q) > 2 and now - q[1][0] >= self.window_s:
            q.popleft()

    def rate(self, key: str) -> float | None:
        q = self.samples.get(key)
        if not q or len(q) < 2 or q[-1][0] <= q[0][0]:
            return None
        return (q[-1][1] - q[0][1]) / (q[-1][0] - q[0][0])


class StatusPoller:
    """Dataflow's and the trainers' GetStatus, and the snapshot astra.run.view draws."""

    def __init__(
        self,
        dataflow: str,
        trainers: dict[str, str],
        *,
        name: str = "run",
        num_steps: int | None = None,
        timeout_s: float = 5.0,
        show_elapsed: bool = True,
    ) -> None:
        self.dataflow_address = dataflow
        self.dataflow = DataflowClient(dataflow, timeout_s=timeout_s)
        self.timeout_s = timeout_s
        self.trainers = {p: TrainerClient(a, timeout_s=timeout_s) for p, a in trainers.items()}
        self.name, self.num_steps, self.show_elapsed = name, num_steps, show_elapsed
        self.started = time.monotonic()
        self.last_dataflow: dict[str, Any] = {}
        self.last_detail: dict[str, Any] = {}
        self.last_evals: list[dict[str, Any]] = []
        self.trainer_status: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self.throughput = Throughput()

    async def poll_dataflow(self) -> dict[str, Any] | None:
        try:
            resp = await self.dataflow.get_status()
        except grpc.aio.AioRpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"
            return None
        self.error = None
        self.last_dataflow = dataflow_snapshot(resp)
        self.last_detail = dataflow_detail(resp)
        self.last_evals = eval_results(resp)
        now = time.monotonic()
        self.throughput.add(now, "groups", self.last_dataflow["counters"].get("consumed_groups", 0))
        for policy, version in self.last_dataflow["versions"].items():
            self.throughput.add(now, f"version:{policy}", version)
        return self.last_dataflow

    async def poll_trainer(self, policy: str) -> None:
        client = self.trainers[policy]
        try:
            resp = await client.get_status()
        except grpc.aio.AioRpcError:
            return
        except asyncio.CancelledError:
            # gRPC cancels a call in flight on a channel that closes (set_trainer's old one):
            # that poll is skipped. Only a cancellation of this task itself goes on up.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return
        self.trainer_status[policy] = {
            "step": resp.step,
            "version": resp.version,
            "loss": resp.loss,
            "paused": resp.paused,
            "metrics": {k: round(v, 6) for k, v in sorted(resp.metrics.items())},
        }
        self.throughput.add(time.monotonic(), f"step:{policy}", resp.step)

    def set_trainer(self, policy: str, address: str) -> None:
        """A restarted trainer's new address (the old client is closed in the background)."""
        old = self.trainers.get(policy)
        self.trainers[policy] = TrainerClient(address, timeout_s=self.timeout_s)
        if old is not None:  # a poll in flight on it gets its deadline before the close
            task = asyncio.ensure_future(old.close(grace_s=self.timeout_s))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def poll(self) -> None:
        """Dataflow and every trainer, at once."""
        await asyncio.gather(self.poll_dataflow(), *(self.poll_trainer(p) for p in self.trainers))

    def rates(self) -> dict[str, Any]:
        policies = {*self.trainer_status, *self.last_dataflow.get("versions", {})}
        steps = {}
        for p in sorted(policies):
            rate = self.throughput.rate(f"step:{p}")
            steps[p] = rate if rate is not None else self.throughput.rate(f"version:{p}")
        return {"groups_per_s": self.throughput.rate("groups"), "steps_per_s": steps}

    def snapshot(self) -> dict[str, Any]:
        """Plain data for astra.run.view (see its docstring)."""
        return {
            "name": self.name,
            "elapsed_s": time.monotonic() - self.started if self.show_elapsed else None,
            "num_steps": self.num_steps,
            "dataflow_address": self.dataflow_address,
            "error": self.error,
            "dataflow": self.last_dataflow,
            "detail": self.last_detail,
            "trainers": self.trainer_status,
            "rates": self.rates(),
            "evals": self.last_evals,
        }

    async def close(self) -> None:
        for client in (self.dataflow, *self.trainers.values()):
            with contextlib.suppress(Exception):
                await client.close()
