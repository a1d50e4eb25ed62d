"""NDArray <-> numpy: the arrays every contract carries (token ids, log-probs, masks, tensors).

`to_array` and `from_array` are shared by every service and client, so each one rejects the
same malformed arrays (a dtype not listed, a negative extent, data that does not fill the
shape) with the same field-level message (`Malformed`). Little-endian, row-major, no
padding, as proto/astra/common/v1/array.proto states. Protobuf messages only, no gRPC.
"""

from __future__ import annotations

import math

import numpy as np

from astra.common.v1 import array_pb2

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


MAX_DIMS = 64  # NDArray dimensions


class Malformed(ValueError):
    """A wire message that breaks the contract; the message names the field."""


_DTYPE_NAMES = {d: k for k, d in DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str:
    """The NDArray dtype name of a numpy dtype of either byte order; ValueError if none."""
    # A dict lookup for the usual (little-endian or native) dtypes: scanning DTYPES with
    # newbyteorder() cost half of to_array.
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = next((k for k, d in DTYPES.items() if d == dtype.newbyteorder("<")), None)
    if name is None:
        raise ValueError(f"unsupported dtype {dtype}")
    return name


def to_array(values: np.ndarray) -> array_pb2.NDArray:
    arr = np.ascontiguousarray(values)
    name = dtype_name(arr.dtype)
    return array_pb2.NDArray(
        dtype=name, shape=list(arr.shape), data=arr.astype(DTYPES[name], copy=False).tobytes()
    )


def from_array(msg: array_pb2.NDArray, field: str) -> np.ndarray:
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise Malformed(f"{field}.dtype: unsupported dtype {msg.dtype!r}")
    if len(msg.shape) > MAX_DIMS:
        raise Malformed(f"{field}.shape: more than {MAX_DIMS} dimensions")
    if any(d < 0 for d in msg.shape):
        raise Malformed(f"{field}.shape: negative extent")
    count = math.prod(msg.shape)
    if len(msg.data) != count * dtype.itemsize:
        raise Malformed(
            f"{field}.data: {len(msg.data)} bytes, expected {count * dtype.itemsize} "
            f"for {msg.dtype}{list(msg.shape)}"
        )
    return np.frombuffer(msg.data, dtype=dtype).reshape(tuple(msg.shape))
