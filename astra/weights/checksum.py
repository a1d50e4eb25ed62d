"""Per-tensor Adler-32 as slime and CoreWeave hot-load write it.

The checksum of a tensor is zlib.adler32 of its raw bytes (little-endian,
row-major) starting from 1, written as 8 lowercase hex digits. Works on any
buffer (bytes, memoryview of an mmap, numpy array) without copying it; knows
nothing of files or formats.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

try:  # zlib-ng's SIMD Adler-32: the same values, ~8x the speed of the system zlib's here
    from zlib_ng.zlib_ng import adler32 as _adler32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; the stdlib still works
    _adler32 = zlib.adler32

CHECKSUM_FORMAT = "adler32"
_HEX8 = re.compile(r"[0-9a-f]{8}")


def adler32(data: Any, value: int = 1) -> int:
    """Running Adler-32 of a buffer; pass the previous result as `value` to continue."""
    return _adler32(memoryview(data).cast("B"), value)


def implementation() -> str:
    """Which Adler-32 this process uses: "zlib-ng" or "zlib"."""
    return "zlib" if _adler32 is zlib.adler32 else "zlib-ng"


def format_adler32(value: int) -> str:
    """8 lowercase hex digits."""
    return format(value & 0xFFFFFFFF, "08x")


def adler32_hex(data: Any) -> str:
    """Adler-32 of a buffer as 8 lowercase hex digits."""
    return format_adler32(adler32(data))


def is_adler32_hex(text: object) -> bool:
    """True for a well-formed checksum string (8 lowercase hex digits)."""
    return isinstance(text, str) and _HEX8.fullmatch(text) is not None
