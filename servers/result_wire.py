"""A finished group's `GroupResult` wire bytes, written by hand from the engine's arrays.

What a RaaS does once per finished group. Building the message through the generated classes
copies every array three times (`tobytes`, into the message, out of it on serialization) and
makes a Python object per field; here each array's bytes are copied once, into the output, and the
other fields are encoded with the varints of astra.protowire (12 against 26 us a trajectory
of 1,032 tokens with metadata, measured). The bytes parse to the message the generated classes
build from the same values (tests/test_result_wire.py holds the two equal, byte for byte where
no map is involved); a metadata value of a type JSON does not have is left to them.

Field numbers are rollout.proto's and array.proto's. proto3 leaves out a scalar equal to its
default (0, 0.0, "") and writes -0.0, as the generated classes do.
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np
from google.rpc import code_pb2

from astra.common.arrays import DTYPES, dtype_name
from astra.common.v1 import rollout_pb2
from astra.protowire import I64, LEN, VARINT, varint
from astra.protowire import key as _key
from astra.protowire import length_delimited as _message
from astra.raas.backend import SequenceSpec, TrajectorySpec

_FINISH = {
    name: rollout_pb2.FinishReason.Value("FINISH_REASON_" + name.upper())
    for name in ("stop", "length", "aborted", "error")
}
_double = struct.Struct("<d").pack
Encoded = tuple[list, int]  # a message's pieces (bytes or buffers) and their total length


def _text(field: int, text: str) -> bytes:
    """A string field, or nothing for ""."""
    return _message(field, text.encode()) if text else b""


_name = functools.lru_cache(maxsize=1024)(_text)  # strings that repeat: policy, agent ids


def _double_field(field: int, value: float) -> bytes:
    if value or math.copysign(1.0, value) < 0:  # -0.0 is not the default's bits
        return _key(field, I64) + _double(float(value))
    return b""


def _int_field(field: int, value: int) -> bytes:
    value = int(value)  # a numpy integer too, as the generated classes take it
    return _key(field, VARINT) + varint(value) if value else b""


# NDArray: dtype = 1 (string), shape = 2 (packed int64), data = 3 (bytes).
_DTYPE_FIELDS = {dtype: _name(1, name) for name, dtype in DTYPES.items()}
_SHAPE_KEY, _DATA_KEY = _key(2, LEN), _key(3, LEN)
# Sequence fields 4-7 (the arrays) and Trajectory.sequences = 4, GroupResult.trajectories = 2.
_ARRAY_KEYS = [_key(f, LEN) for f in (4, 5, 6, 7)]
_SEQUENCE_KEY, _TRAJECTORY_KEY = _key(4, LEN), _key(2, LEN)


def _nest(parts: list, key: bytes, inner: Encoded) -> int:
    """Appends a submessage (its key, length and pieces) to `parts`; returns the bytes added."""
    pieces, n = inner
    lead = key + varint(n)
    parts.append(lead)
    parts += pieces
    return len(lead) + n


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
    name = dtype_name(arr.dtype)
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
        size += _nest(parts, key, _array(values))
    tail = _int_field(8, _FINISH[s.finish_reason.lower()]) + _double_field(9, s.reward)
    parts.append(tail)
    return parts, size + len(tail)


class _NotPlain(Exception):
    """A metadata value of a type other than JSON's: left to the generated classes."""


def _value(v) -> bytes:
    """A google.protobuf.Value, chosen as `Struct.update` chooses (oneof fields are always
    written): null_value 1, number_value 2, string_value 3, bool_value 4, struct_value 5,
    list_value 6."""
    if v is None:
        return b"\x08\x00"
    if isinstance(v, bool):
        return b"\x20\x01" if v else b"\x20\x00"
    if isinstance(v, str):
        return _message(3, v.encode())
    if isinstance(v, int | float):
        return b"\x11" + _double(float(v))
    if isinstance(v, dict):
        return _message(5, _struct(v))
    if isinstance(v, list | tuple):
        return _message(6, b"".join(_message(1, _value(x)) for x in v))  # ListValue.values
    raise _NotPlain


def _struct(d: dict) -> bytes:
    """A google.protobuf.Struct: map<string, Value> fields = 1."""
    out = []
    for k, v in d.items():
        if not isinstance(k, str):
            raise _NotPlain
        out.append(_message(1, _text(1, k) + _message(2, _value(v))))
    return b"".join(out)


def _rare(t: TrajectorySpec) -> bytes:
    """Fields 6-8 of a Trajectory: agent rewards (map<string, double>), metadata (Struct),
    error (google.rpc.Status)."""
    out = b""
    for name, reward in t.agent_rewards.items():
        out += _message(6, _text(1, name) + b"\x11" + _double(reward))
    if t.metadata:
        try:
            out += _message(7, _struct(t.metadata))
        except _NotPlain:  # what Struct.update makes of it (or refuses, as before)
            meta = rollout_pb2.Trajectory()
            meta.metadata.update(t.metadata)
            out += meta.SerializeToString()
    if t.error is not None:
        out += _message(8, _int_field(1, code_pb2.INTERNAL) + _text(2, t.error))
    return out


def _trajectory(group_field: bytes, group_id: str, t: TrajectorySpec) -> Encoded:
    head = _text(1, f"{group_id}/{t.sample_index}") + group_field + _int_field(3, t.sample_index)
    parts, size = [head], len(head)
    for s in t.sequences:
        size += _nest(parts, _SEQUENCE_KEY, _sequence(s))
    tail = _double_field(5, t.reward) + _rare(t)
    parts.append(tail)
    return parts, size + len(tail)


def group_result_bytes(
    group_id: str, instance_id: str, trajectories: list[TrajectorySpec], *, field: int = 0
) -> bytes:
    """The serialized GroupResult of a finished group. With `field`, as that length-delimited
    field of an enclosing message (CollectResultsResponse.result = 1), with no second copy."""
    group_field = _text(2, group_id)  # Trajectory.group_id = 2
    parts = [b"", _text(1, group_id)]
    size = len(parts[1])
    for t in trajectories:
        size += _nest(parts, _TRAJECTORY_KEY, _trajectory(group_field, group_id, t))
    parts.append(_name(4, instance_id))
    if field:
        parts[0] = _key(field, LEN) + varint(size + len(parts[-1]))
    return b"".join(parts)
