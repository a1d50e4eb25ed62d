"""Wire <-> domain conversions shared by the servicers: arrays, trajectories, groups.

Validation of what arrives on the wire lives here, so every service rejects
the same malformed arrays with the same field-level messages.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
from google.protobuf import struct_pb2

from astra.common.v1 import array_pb2, rollout_pb2
from astra.dataflow.config import StreamSettings
from astra.dataflow.ports import IncomingGroup
from astra.dataflow.records import TrajectoryRecord, WorkItem
from astra.errors import invalid_field

DTYPES = {
    "bool": np.dtype("bool"),
    "uint8": np.dtype("<u1"),
    "int8": np.dtype("<i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
# Sequence arrays: field -> accepted dtypes.
SEQUENCE_ARRAYS = {
    "token_ids": ("int32", "int64"),
    "logprobs": ("float32", "float64"),
    "loss_mask": ("uint8", "bool"),
    "weight_versions": ("int64", "int32"),
}


MAX_ID_CHARS = 128


def check_id(value: str, field: str, limit: int = MAX_ID_CHARS) -> None:
    """A required identifier of at most `limit` characters, else INVALID_ARGUMENT naming it."""
    if not value:
        raise invalid_field(field, "required")
    if len(value) > limit:
        raise invalid_field(field, f"longer than {limit} characters")


class Malformed(ValueError):
    """A wire message that breaks the contract; the message names the field."""


def to_array(values: np.ndarray) -> array_pb2.NDArray:
    arr = np.ascontiguousarray(values)
    name = next((k for k, d in DTYPES.items() if d == arr.dtype.newbyteorder("<")), None)
    if name is None:
        raise ValueError(f"unsupported dtype {arr.dtype}")
    return array_pb2.NDArray(
        dtype=name, shape=list(arr.shape), data=arr.astype(DTYPES[name], copy=False).tobytes()
    )


def from_array(msg: array_pb2.NDArray, field: str) -> np.ndarray:
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise Malformed(f"{field}.dtype: unsupported dtype {msg.dtype!r}")
    if any(d < 0 for d in msg.shape):
        raise Malformed(f"{field}.shape: negative extent")
    count = math.prod(msg.shape)
    if len(msg.data) != count * dtype.itemsize:
        raise Malformed(
            f"{field}.data: {len(msg.data)} bytes, expected {count * dtype.itemsize} "
            f"for {msg.dtype}{list(msg.shape)}"
        )
    return np.frombuffer(msg.data, dtype=dtype).reshape(tuple(msg.shape))


def _check_trajectory(t: rollout_pb2.Trajectory, where: str) -> dict[str, tuple[int, int, int]]:
    """Validates one trajectory; returns policy -> (min version, max version, tokens)."""
    if not math.isfinite(t.reward):
        raise Malformed(f"{where}.reward: not finite")
    for agent, r in t.agent_rewards.items():
        if not math.isfinite(r):
            raise Malformed(f"{where}.agent_rewards[{agent}]: not finite")
    if not t.sequences:
        raise Malformed(f"{where}.sequences: empty")
    facts: dict[str, tuple[int, int, int]] = {}
    for j, s in enumerate(t.sequences):
        sw = f"{where}.sequences[{j}]"
        if not s.policy_id:
            raise Malformed(f"{sw}.policy_id: empty")
        if not math.isfinite(s.reward):
            raise Malformed(f"{sw}.reward: not finite")
        n = -1
        raw = {}
        for name, allowed in SEQUENCE_ARRAYS.items():
            msg = getattr(s, name)
            dtype = msg.dtype
            if dtype not in allowed:
                raise Malformed(f"{sw}.{name}.dtype: {dtype!r}, expected one of {allowed}")
            shape = msg.shape
            if len(shape) != 1:
                raise Malformed(f"{sw}.{name}.shape: must be one-dimensional")
            data = msg.data
            if len(data) != shape[0] * DTYPES[dtype].itemsize:
                raise Malformed(
                    f"{sw}.{name}.data: {len(data)} bytes, expected "
                    f"{shape[0] * DTYPES[dtype].itemsize} for {dtype}{list(shape)}"
                )
            if n < 0:
                n = shape[0]
            elif shape[0] != n:
                raise Malformed(f"{sw}.{name}: length {shape[0]} != token_ids length {n}")
            raw[name] = (data, DTYPES[dtype])
        if not 0 <= s.prompt_length <= n:
            raise Malformed(f"{sw}.prompt_length: {s.prompt_length} outside 0..{n}")
        data, dtype = raw["logprobs"]
        if not np.isfinite(np.frombuffer(data, dtype=dtype)).all():
            raise Malformed(f"{sw}.logprobs: not finite")
        data, dtype = raw["weight_versions"]
        versions = np.frombuffer(data, dtype=dtype)
        vmax = int(versions.max()) if n else -1
        vmin = int(versions.min(where=versions >= 0, initial=vmax)) if vmax >= 0 else -1
        vmax = max(vmax, -1)
        old = facts.get(s.policy_id)
        if old is not None:
            vmin = vmin if old[0] < 0 else (old[0] if vmin < 0 else min(old[0], vmin))
            vmax = max(old[1], vmax)
            n += old[2]
        facts[s.policy_id] = (vmin, vmax, n)
    return facts


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def field_slices(buf: bytes, field_number: int, *, copy: bool = True) -> list:
    """The raw bytes of every length-delimited `field_number` at the top level of `buf`.

    With copy=False the slices are memoryviews into `buf`.
    """
    out = []
    pos, end = 0, len(buf)
    view = memoryview(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        wire = key & 7
        if wire == 2:
            length, pos = _read_varint(buf, pos)
            if key >> 3 == field_number:
                part = view[pos : pos + length]
                out.append(bytes(part) if copy else part)
            pos += length
        elif wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise Malformed(f"unsupported wire type {wire}")
    return out


def incoming_group(
    result: rollout_pb2.GroupResult, instance_id: str, raw: bytes | None = None
) -> IncomingGroup:
    """Splits a GroupResult per policy, validating every trajectory.

    With `raw` (the serialized GroupResult as received), single-policy trajectories
    keep their received bytes instead of being serialized again.
    """
    out = IncomingGroup(result.group_id, instance_id)
    raw_trajectories = field_slices(raw, 2) if raw is not None else None
    if result.HasField("error") and result.error.code != 0:
        out.error = result.error.message or f"code {result.error.code}"
        return out
    try:
        for i, t in enumerate(result.trajectories):
            where = f"result.trajectories[{i}]"
            if t.group_id and t.group_id != result.group_id:
                raise Malformed(f"{where}.group_id: {t.group_id!r} != {result.group_id!r}")
            failed = t.HasField("error") and t.error.code != 0
            facts = {} if failed else _check_trajectory(t, where)
            if failed:
                policies = {s.policy_id for s in t.sequences} or {""}
                facts = dict.fromkeys(policies, (-1, -1, 0))
            single = len(facts) == 1
            for policy_id, (vmin, vmax, ntok) in facts.items():
                if single and raw_trajectories is not None:
                    payload = raw_trajectories[i]
                elif single:
                    payload = t.SerializeToString()
                else:
                    part = rollout_pb2.Trajectory()
                    part.CopyFrom(t)
                    del part.sequences[:]
                    part.sequences.extend(s for s in t.sequences if s.policy_id == policy_id)
                    payload = part.SerializeToString()
                tid = t.trajectory_id or f"{result.group_id}/{t.sample_index}"
                reward = t.reward if single else _policy_reward(t, policy_id)
                out.per_policy.setdefault(policy_id, []).append(
                    TrajectoryRecord(tid, reward, vmin, vmax, ntok, payload, failed)
                )
    except Malformed as exc:
        out.per_policy = {}
        out.invalid = str(exc)
    return out


def _policy_reward(t: rollout_pb2.Trajectory, policy_id: str) -> float:
    """A policy's reward in a multi-policy episode: the mean of its sequences' rewards."""
    rewards = [s.reward for s in t.sequences if s.policy_id == policy_id]
    return sum(rewards) / len(rewards) if rewards else t.reward


def _struct(record: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(json.loads(json.dumps(record, default=str)))
    return s


def prompt_group(item: WorkItem, stream: StreamSettings) -> rollout_pb2.PromptGroup:
    sp = stream.sampling
    return rollout_pb2.PromptGroup(
        group_id=item.group_id,
        workflow=item.workflow,
        policy_ids=list(item.policy_ids),
        prompt=rollout_pb2.Prompt(
            text=str(item.record.get(stream.dataset.prompt_field, "")), data=_struct(item.record)
        ),
        num_samples=item.num_samples,
        sampling_params=rollout_pb2.SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            max_new_tokens=sp.max_new_tokens,
            stop_strings=sp.stop_strings,
            stop_token_ids=sp.stop_token_ids,
            seed=sp.seed * 1_000_003 + item.epoch * 65_537 + item.index,
        ),
        reward=stream.reward,
        epoch=item.epoch,
    )


def varint(n: int) -> bytes:
    """Protobuf base-128 varint encoding of a non-negative int."""
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_ADVANTAGE_TAG = bytes([(9 << 3) | 1])  # Trajectory.advantage, fixed64
_REPEATED_TAG = bytes([(1 << 3) | 2])  # field 1, length-delimited


def trajectories_blob(payloads_and_advantages: list[tuple[bytes, float]]) -> bytes:
    """Serialized BatchTrajectories built from stored trajectory bytes, advantages set.

    Appending a field to a serialized message overrides it (last value wins), so
    stored payloads are never decoded on the batch path.
    """
    parts: list[bytes] = []
    for payload, adv in payloads_and_advantages:
        parts += (
            _REPEATED_TAG,
            varint(len(payload) + 9),
            payload,
            _ADVANTAGE_TAG,
            struct.pack("<d", adv),
        )
    return b"".join(parts)
