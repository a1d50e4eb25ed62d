"""Live observation of a run: GetStatus polling, metrics.jsonl, and a compact status line.

Every `poll_interval_s` the observer asks Dataflow for its status; every quarter
of that it asks each trainer (TrainerService.GetStatus) and reads the new lines
of each trainer's log. Every step becomes one row of metrics.jsonl: step,
version, loss and skip reason from the trainer's per-step log line ("step N
version V loss X [SKIPPED]", astra.servers.trainer), the trainer's figures of
that step from GetStatus (grad norm, staleness, timings, and `accuracy` /
`reward_mean` when the trainer reports them) when a poll saw that step (else
`trainer` is null: GetStatus holds only the last step, and tiny-model steps can
be much shorter than a poll), and the latest Dataflow snapshot (gate, buffer,
pool, counters).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import grpc

from astra.clients.dataflow import DataflowClient
from astra.clients.trainer import TrainerClient
from astra.dataflow.v1 import dataflow_service_pb2 as dpb

ACCURACY_KEYS = ("accuracy", "reward_mean")  # binary rewards: the mean is the accuracy
STEP_LINE = re.compile(rb"astra\.servers\.trainer: step (\d+) version (-?\d+) loss (\S+) ?(\S*)")


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


class Observer:
    def __init__(
        self,
        dataflow: str,
        trainers: dict[str, str],
        trainer_logs: dict[str, tuple[Path, int]],
        metrics_path: Path,
        *,
        num_steps: int,
        poll_interval_s: float = 1.0,
        status_every_s: float = 5.0,
        name: str = "run",
        out: TextIO = sys.stderr,
    ) -> None:
        self.dataflow = DataflowClient(dataflow, timeout_s=5.0)
        self.trainers = {p: TrainerClient(a, timeout_s=5.0) for p, a in trainers.items()}
        self.metrics_path, self.num_steps, self.name, self.out = metrics_path, num_steps, name, out
        self.poll_interval_s, self.status_every_s = poll_interval_s, status_every_s
        self.started = time.monotonic()
        self.last_dataflow: dict[str, Any] = {}
        self.trainer_status: dict[str, dict[str, Any]] = {}
        self.rows: dict[str, list[dict[str, Any]]] = {p: [] for p in trainers}
        # policy -> [log path, offset read up to, partial last line]
        self.logs: dict[str, list[Any]] = {p: [*where, b""] for p, where in trainer_logs.items()}
        self.pending: list[tuple[str, int, int, float, str]] = []  # step lines not yet rows
        self.tty = out.isatty()
        self._first: tuple[float, int] | None = None  # (time, consumed groups) of the first poll
        self._last_print = 0.0

    async def poll_dataflow(self) -> dict[str, Any] | None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            self.last_dataflow = dataflow_snapshot(await self.dataflow.get_status())
            if self._first is None:
                consumed = self.last_dataflow["counters"].get("consumed_groups", 0)
                self._first = (time.monotonic(), consumed)
            return self.last_dataflow
        return None

    async def poll_trainer(self, policy: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            resp = await self.trainers[policy].get_status()
            self.trainer_status[policy] = {
                "step": resp.step,
                "version": resp.version,
                "loss": resp.loss,
                "metrics": {k: round(v, 6) for k, v in sorted(resp.metrics.items())},
            }

    def read_logs(self) -> None:
        """Reads the trainers' new per-step log lines (rows once the next poll has been seen)."""
        for policy, entry in self.logs.items():
            path, offset, partial = entry
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(offset)
                data = partial + f.read()
                entry[1] = f.tell()
            *lines, entry[2] = data.split(b"\n")
            for line in lines:
                if m := STEP_LINE.search(line):
                    step, version, loss, skipped = m.groups()
                    self.pending.append(
                        (policy, int(step), int(version), float(loss), skipped.decode())
                    )

    def flush(self) -> None:
        """Writes the pending steps as rows, with the trainer figures a poll saw for that step."""
        for item in self.pending:
            self._record(*item)
        self.pending.clear()

    def _record(self, policy: str, step: int, version: int, loss: float, skipped: str) -> None:
        status = self.trainer_status.get(policy, {})
        metrics = status.get("metrics") if status.get("step") == step else None
        accuracy = (
            next((metrics[k] for k in ACCURACY_KEYS if k in metrics), None) if metrics else None
        )
        row = {
            "time": round(time.time(), 3),
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "policy": policy,
            "step": step,
            "version": version,
            "loss": loss if math.isfinite(loss) else None,  # NaN is not JSON
            "skipped": skipped or None,
            "accuracy": accuracy,
            "trainer": metrics,
            "dataflow": self.last_dataflow,
        }
        self.rows[policy].append(row)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    async def run(self) -> None:
        """Polls until cancelled."""
        tick = 0
        while True:
            if tick % 4 == 0:
                await self.poll_dataflow()
            await asyncio.gather(*(self.poll_trainer(p) for p in self.trainers))
            self.flush()  # lines read last tick: this poll saw their step unless another followed
            self.read_logs()
            self.print_status()
            tick += 1
            await asyncio.sleep(self.poll_interval_s / 4)

    def status_line(self) -> str:
        elapsed = time.monotonic() - self.started
        parts = [f"{self.name} {elapsed:6.0f}s"]
        for policy, s in sorted(self.trainer_status.items()):
            acc = next((s["metrics"][k] for k in ACCURACY_KEYS if k in s["metrics"]), None)
            acc_s = "-" if acc is None else f"{acc:.2f}"
            parts.append(
                f"{policy} step {s['step']}/{self.num_steps} v{s['version']} "
                f"loss {s['loss']:.4g} acc {acc_s}"
            )
        d = self.last_dataflow
        if d:
            c = d["counters"]
            parts.append(f"gate {d['gate']} stale {d['staleness']:.2f}")
            parts.append(f"buf {sum(d['buffered'].values())} fill {d['buffer_fill']:.2f}")
            parts.append(
                f"raas {d['raas_active']}/{len(d['raas_states'])} inflight {d['in_flight']}"
            )
            parts.append(
                f"groups disp {c.get('dispatched', 0)} done {c.get('groups_done', 0)} "
                f"trained {c.get('consumed_groups', 0)}"
            )
            if self._first is not None and time.monotonic() > self._first[0]:
                rate = (c.get("consumed_groups", 0) - self._first[1]) / (
                    time.monotonic() - self._first[0]
                )
                parts.append(f"{rate:.2f} groups/s")
        return " | ".join(parts)

    def print_status(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            self.out.write("\r\x1b[2K" + self.status_line()[:250])
            self.out.flush()
        elif force or now - self._last_print >= self.status_every_s:
            self._last_print = now
            print(self.status_line(), file=self.out, flush=True)

    def end_line(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()

    async def close(self) -> None:
        for client in (self.dataflow, *self.trainers.values()):
            with contextlib.suppress(Exception):
                await client.close()
