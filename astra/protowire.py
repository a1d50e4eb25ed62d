"""Protobuf wire-format primitives for the few hot paths that build or slice messages by hand.

Base-128 varints (negative ints as int64 two's complement, as protobuf encodes
them), field keys and length-delimited fields. Used where copying through generated
message classes costs more than the work itself: batch chunks (Dataflow), rollout
results (RaaS), weight chunks (WeightService), TensorBoard event records. Every
hand-built message starts from these; nothing else in Astra encodes wire format.
"""

from __future__ import annotations

import functools
from typing import Any

_INT64 = (1 << 64) - 1
VARINT, I64, LEN = 0, 1, 2  # wire types


@functools.lru_cache(maxsize=4096)
def varint(n: int) -> bytes:
    """The varint encoding of `n` (negative: as int64)."""
    n &= _INT64
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def read_varint(buf: Any, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `pos` in `buf`; ValueError when it is cut
    short or longer than 64 bits."""
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def key(field: int, wire: int) -> bytes:
    """A field's key: its number and wire type."""
    return varint(field << 3 | wire)


def length_delimited(field: int, inner: bytes) -> bytes:
    """A length-delimited field (a submessage, bytes or a string), written even when empty."""
    return key(field, LEN) + varint(len(inner)) + inner
