"""A finished group's `GroupResult` wire bytes, written by hand from the engine's arrays.

What a RaaS does once per finished group. Building the message through the generated classes
copies every array three times (`tobytes`, into the message, out of it on serialization) and
makes a Python object per field; here each array's bytes are copied once, into the output, and
the scalars are encoded with the varints of astra.protowire. The bytes parse to the message the
generated classes build from the same arrays (tests/test_result_wire.py holds the two equal,
byte for byte where no map is involved); the rarely set parts of a trajectory (agent rewards, metadata, error) are encoded
by the generated classes and appended, which protobuf's merge-on-concatenation allows.

Field numbers are rollout.proto's and array.proto's. proto3 leaves out a scalar equal to its
default (0, 0.0, "") and writes -0.0, as the generated classes do.
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np
from google.rpc import code_pb2, status_pb2

from astra.common.v1 import rollout_pb2
from astra.protowire import varint
from astra.raas.backend import SequenceSpec, TrajectorySpec
from astra.servers.convert import _DTYPE_NAMES, DTYPES

_LEN, _VARINT, _I64 = 2, 0, 1
_FINISH = {
    name: rollout_pb2.FinishReason.Value("FINISH_REASON_" + name.upper())
    for name in ("stop", "length", "aborted", "error")
}
_double = struct.Struct("<d").pack
Encoded = tuple[list, int]  # a message's pieces (bytes or buffers) and their total length


def _key(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def _text(field: int, text: str) -> bytes:
    """A string field, or nothing for ""."""
    if not text:
        return b""
    data = text.encode()
    return _key(field, _LEN) + varint(len(data)) + data


_name = functools.lru_cache(maxsize=1024)(_text)  # strings that repeat: policy, agent ids


def _double_field(field: int, value: float) -> bytes:
    if value or math.copysign(1.0, value) < 0:  # -0.0 is not the default's bits
        return _key(field, _I64) + _double(value)
    return b""


def _int_field(field: int, value: int) -> bytes:
    return _key(field, _VARINT) + varint(value) if value else b""


# NDArray: dtype = 1 (string), shape = 2 (packed int64), data = 3 (bytes).
_DTYPE_FIELDS = {dtype: _name(1, name) for name, dtype in DTYPES.items()}
_SHAPE_KEY, _DATA_KEY = _key(2, _LEN), _key(3, _LEN)
# Sequence fields 4-7 (the arrays) and Trajectory.sequences = 4, GroupResult.trajectories = 2.
_ARRAY_KEYS = [_key(f, _LEN) for f in (4, 5, 6, 7)]
_SEQUENCE_KEY, _TRAJECTORY_KEY = _key(4, _LEN), _key(2, _LEN)


def _array(values: np.ndarray) -> Encoded:
    dtype_field = _DTYPE_FIELDS.get(values.dtype)
    if dtype_field is None or values.ndim != 1 or not values.flags.c_contiguous:
        return _any_array(values)
    n = values.shape[0]
    packed = varint(n)
    head = dtype_field + _SHAPE_KEY + varint(len(packed)) + packed
    if not n:  # proto3 leaves empty bytes out
        return [head], len(head)
    data = memoryview(values).cast("B")
    head += _DATA_KEY + varint(len(data))
    return [head, data], len(head) + len(data)


def _any_array(values: np.ndarray) -> Encoded:
    """Any shape, order and byte order: converted to a contiguous little-endian copy."""
    arr = np.ascontiguousarray(values)
    name = _DTYPE_NAMES.get(arr.dtype)
    if name is None:
        name = next((k for k, d in DTYPES.items() if d == arr.dtype.newbyteorder("<")), None)
    if name is None:
        raise ValueError(f"unsupported dtype {arr.dtype}")
    arr = arr.astype(DTYPES[name], copy=False)
    head = _name(1, name)
    if arr.ndim:
        packed = b"".join(varint(d) for d in arr.shape)
        head += _SHAPE_KEY + varint(len(packed)) + packed
    if not arr.nbytes:
        return [head], len(head)
    head += _DATA_KEY + varint(arr.nbytes)
    return [head, memoryview(arr).cast("B")], len(head) + arr.nbytes


def _sequence(s: SequenceSpec) -> Encoded:
    head = _name(1, s.policy_id) + _name(2, s.agent_id) + _int_field(3, s.prompt_length)
    parts, size = [head], len(head)
    for key, values in zip(
        _ARRAY_KEYS, (s.token_ids, s.logprobs, s.loss_mask, s.weight_versions), strict=True
    ):
        pieces, n = _array(values)
        lead = key + varint(n)
        parts.append(lead)
        parts += pieces
        size += len(lead) + n
    tail = _int_field(8, _FINISH[s.finish_reason.lower()]) + _double_field(9, s.reward)
    parts.append(tail)
    return parts, size + len(tail)


def _rare(t: TrajectorySpec) -> bytes:
    """Fields 6-8 of a Trajectory (agent rewards, metadata, error), by the generated classes."""
    if not (t.agent_rewards or t.metadata or t.error is not None):
        return b""
    msg = rollout_pb2.Trajectory(agent_rewards=t.agent_rewards)
    if t.metadata:
        msg.metadata.update(t.metadata)
    if t.error is not None:
        msg.error.CopyFrom(status_pb2.Status(code=code_pb2.INTERNAL, message=t.error))
    return msg.SerializeToString()


def _trajectory(group_field: bytes, group_id: str, t: TrajectorySpec) -> Encoded:
    head = _text(1, f"{group_id}/{t.sample_index}") + group_field + _int_field(3, t.sample_index)
    parts, size = [head], len(head)
    for s in t.sequences:
        pieces, n = _sequence(s)
        lead = _SEQUENCE_KEY + varint(n)
        parts.append(lead)
        parts += pieces
        size += len(lead) + n
    tail = _double_field(5, t.reward) + _rare(t)
    parts.append(tail)
    return parts, size + len(tail)


def group_result_bytes(
    group_id: str, instance_id: str, trajectories: list[TrajectorySpec]
) -> bytes:
    """The serialized GroupResult of a finished group."""
    group_field = _text(2, group_id)  # Trajectory.group_id = 2
    parts = [_text(1, group_id)]
    for t in trajectories:
        pieces, n = _trajectory(group_field, group_id, t)
        parts.append(_TRAJECTORY_KEY + varint(n))
        parts += pieces
    parts.append(_name(4, instance_id))
    return b"".join(parts)
