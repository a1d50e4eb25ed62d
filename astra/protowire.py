"""Protobuf wire-format primitives for the few hot paths that build or slice messages by hand.

Base-128 varints (negative ints as int64 two's complement, as protobuf encodes
them). Used where copying through generated message classes costs more than the
work itself: batch chunks (Dataflow), weight chunks (WeightService), TensorBoard
event records.
"""

from __future__ import annotations

import functools
from typing import Any

_INT64 = (1 << 64) - 1


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
