"""Dataflow's GetStatus as plain data: instances, policies, gate, streams, counters, evaluations.

Read-only: takes what Dataflow holds (`StatusView`: the coordinator, astra.dataflow.coordinator,
is one) and shapes it like astra.dataflow.v1.GetStatusResponse in snake_case. No gRPC here.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from astra.dataflow.gate import GateMode

if TYPE_CHECKING:
    from collections import Counter

    from astra.dataflow.batches import BatchDesk
    from astra.dataflow.buffer import PolicyBuffer
    from astra.dataflow.config import DataflowConfig
    from astra.dataflow.done import DoneGroups
    from astra.dataflow.evals import EvalDesk
    from astra.dataflow.pool import Pool
    from astra.dataflow.storage_guard import StorageGuard
    from astra.dataflow.versions import VersionBook
    from astra.dataflow.work import WorkTable

# How the gate's reason begins once no training group is left to generate (the supervisor
# ends a run that still needs a batch on it).
DATA_EXHAUSTED = "training data exhausted"


class StatusView(Protocol):
    """The parts of Dataflow its status reads."""

    dataflow_id: str
    config: DataflowConfig
    admission: Any  # astra.dataflow.admission.Admission (which imports this module)
    storage: StorageGuard
    versions: VersionBook
    pool: Pool
    buffers: dict[str, PolicyBuffer]
    batches: BatchDesk
    sources: dict
    counters: Counter[str]
    evals: EvalDesk
    table: WorkTable
    done: DoneGroups


def dataflow_status(df: StatusView) -> dict:
    """The run's state, shaped like astra.dataflow.v1.GetStatusResponse (snake_case): what
    GetStatus answers (servers/dataflow.py parses it into the message)."""
    now_wall, now_mono = time.time(), time.monotonic()
    gate = df.admission.state or df.admission.evaluate()
    if df.storage.paused:  # no dispatch while the disk is short of space (why() says so)
        gate = replace(gate, mode=GateMode.THROTTLED)
    targets = df.versions.targets()
    instances = []
    for i in df.pool.instances.values():
        seen = now_wall - (now_mono - i.last_seen)
        instances.append(
            {
                "instance_id": i.instance_id,
                "address": i.address,
                "state": f"INSTANCE_STATE_{i.state.value}",
                "capacity": i.capacity,
                "free_slots": max(0, i.free_slots),
                "in_flight_groups": len(i.in_flight),
                "consecutive_failures": i.failures,
                "loaded_versions": [
                    {"policy_id": p, "version": v, "version_id": i.loaded_ids.get(p, "")}
                    for p, v in sorted(i.loaded_versions.items())
                ],
                "labels": i.labels,
                "last_seen_time": _rfc3339(seen),
                "policy_ids": sorted(i.policy_ids),
                "submits_refused_in_a_row": i.refused_in_a_row,
                "last_refusal": i.last_refusal,
            }
        )
    policies = []
    for p in df.config.policies:
        buf = df.buffers[p.id]
        target = targets.get(p.id)
        policies.append(
            {
                "policy_id": p.id,
                "current_version": df.versions.current(p.id),
                "buffered_groups": len(buf),
                "buffer_capacity": p.buffer.capacity_groups,
                "replay_groups": buf.replay_len,
                "leased_groups": df.batches.leased_groups(p.id),
                "target_version": target.version if target else 0,
                "weights_address": target.weights_address if target else "",
                "groups_dropped_in_a_row": buf.dropped_in_a_row,
                "last_drop_reason": buf.last_drop,
            }
        )
    streams = [
        {
            "name": name,
            "epoch": src.epoch,
            "position": src.position,
            "size": src.size,
            "num_epochs": src.num_epochs,
            "exhausted": src.exhausted,
        }
        for name, src in df.sources.items()
    ]
    counters = dict(df.counters)
    for pid, buf in df.buffers.items():
        for k, v in buf.counters.items():
            counters[f"buffer.{pid}.{k}"] = v
    counters["evaluations_skipped"] = df.evals.skipped
    counters["groups_waiting"] = len(df.table.waiting)
    counters["groups_done"] = len(df.done)
    reason = df.admission.why()
    failing = df.pool.failing_loads()
    for i in failing:
        counters[f"weight_load_failing.{i.instance_id}"] = i.load_failures
    if failing:
        reason += "; weight loads failing on " + ", ".join(
            f"{i.instance_id} ({i.load_failures} in a row: {i.load_error[:200]})" for i in failing
        )
    return {
        "dataflow_id": df.dataflow_id,
        "instances": instances,
        "policies": policies,
        "gate": {
            "mode": f"GATE_MODE_{gate.mode.name}",
            "reason": reason,
            "staleness": gate.staleness,
            "capacity": gate.capacity,
            "in_flight_groups": gate.in_flight,
            "buffer_fill_ratio": gate.buffer_fill_ratio,
        },
        "streams": streams,
        "counters": counters,
        "pool_empty": df.pool.empty,
        "status_time": _rfc3339(now_wall),
        "evals": df.evals.results(),
        "storage": df.storage.status(),
    }


def _rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"
