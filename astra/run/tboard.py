"""TensorBoard event files for a run: <run>/tensorboard/<policy>/events.out.tfevents.*.

Written here without TensorFlow or tensorboardX: an event file is a TFRecord file
(per record: uint64 length, masked CRC-32C of the length, the bytes, masked
CRC-32C of the bytes; little-endian) of `tensorboard.Event` protos. The first
record carries `file_version: "brain.Event:2"`; every later one a step number, a
wall time and a Summary of `simple_value` scalars. The few proto fields used are
encoded by hand (field numbers from tensorboard/compat/proto/event.proto and
summary.proto). One file per policy per `astra run` invocation (a --resume adds a
file beside the first; TensorBoard reads them as one run).

Each metrics.jsonl row becomes one event at the row's trainer step (`row_scalars`
says which tag holds what).
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from astra.protowire import varint


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord uses."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (
        header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))
    )


def _bytes_field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def event(
    *, wall_time: float, step: int | None = None, file_version: str | None = None,
    scalars: Mapping[str, float] | None = None,
) -> bytes:  # fmt: skip
    """One serialised tensorboard.Event (wall_time=1, step=2, file_version=3, summary=5)."""
    out = bytearray(b"\x09" + struct.pack("<d", wall_time))
    if step is not None:
        out += b"\x10" + varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        summary = bytearray()
        for tag, value in scalars.items():  # Summary.Value: tag=1, simple_value=2 (float)
            v = _bytes_field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
            summary += _bytes_field(1, v)
        out += _bytes_field(5, bytes(summary))
    return bytes(out)


class EventWriter:
    """One event file in `logdir`, opened on the first write, flushed after every event."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.path: Path | None = None
        self._f: BinaryIO | None = None

    def _open(self) -> BinaryIO:
        if self._f is None:
            self.logdir.mkdir(parents=True, exist_ok=True)
            name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
            self.path = self.logdir / f"{name}.{os.getpid()}.astra"
            self._f = self.path.open("ab")
            self._f.write(tfrecord(event(wall_time=time.time(), file_version="brain.Event:2")))
        return self._f

    def scalars(
        self, step: int, values: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        f = self._open()
        wall = time.time() if wall_time is None else wall_time
        f.write(tfrecord(event(wall_time=wall, step=step, scalars=values)))
        f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def row_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one metrics.jsonl row (astra.run.observe), by TensorBoard tag:

    loss, accuracy                  the row's loss and accuracy (accuracy: the trainer's
                                    `accuracy`, else `reward_mean`)
    trainer/<name>                  every trainer metric of that step (grad_norm, reward_mean,
                                    version_gap_mean, score, total_ms, tokens_per_s, ...)
    dataflow/staleness              the gate's smoothed staleness score at the last poll
    dataflow/buffer_fill, in_flight, raas_active, buffered (this policy), version (this policy)
    dataflow/gate_barrier, gate_throttled   1 while the gate is in that mode
    dataflow/counters/<name>        Dataflow's run-level counters
    run/elapsed_s, run/version, run/skipped
    """
    out: dict[str, float] = {}

    def put(tag: str, value: Any) -> None:
        if (v := _number(value)) is not None:
            out[tag] = v

    put("loss", row.get("loss"))
    put("accuracy", row.get("accuracy"))
    for k, v in (row.get("trainer") or {}).items():
        put(f"trainer/{k}", v)
    d = row.get("dataflow") or {}
    policy = row.get("policy", "")
    for k in ("staleness", "buffer_fill", "in_flight", "raas_active"):
        put(f"dataflow/{k}", d.get(k))
    put("dataflow/buffered", (d.get("buffered") or {}).get(policy))
    put("dataflow/version", (d.get("versions") or {}).get(policy))
    if d.get("gate"):
        out["dataflow/gate_barrier"] = float(d["gate"] == "SYNC_BARRIER")
        out["dataflow/gate_throttled"] = float(d["gate"] == "THROTTLED")
    for k, v in (d.get("counters") or {}).items():
        put(f"dataflow/counters/{k}", v)
    put("run/elapsed_s", row.get("elapsed_s"))
    put("run/version", row.get("version"))
    out["run/skipped"] = float(bool(row.get("skipped")))
    return out


class TensorBoardSink:
    """metrics.jsonl rows -> one event file per policy under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.writers: dict[str, EventWriter] = {}

    def _writer(self, policy: str) -> EventWriter:
        writer = self.writers.get(policy)
        if writer is None:
            folder = policy if policy not in (".", "..") else f"_{policy}"
            writer = self.writers[policy] = EventWriter(self.root / folder)
        return writer

    def write_row(self, row: Mapping[str, Any]) -> None:
        writer = self._writer(str(row.get("policy") or "policy"))
        writer.scalars(int(row["step"]), row_scalars(row), row.get("time"))

    def write_scalars(self, policy: str, step: int, values: Mapping[str, float]) -> None:
        """Scalars of another kind (eval/...) into the policy's event file."""
        self._writer(policy).scalars(step, values)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
