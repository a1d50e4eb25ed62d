"""Per-tensor xor+zstd delta: one standalone zstd frame of (new bytes XOR old bytes).

Encoding and decoding work in cache-sized chunks over zero-copy numpy views,
so a tensor's bytes are read once and never duplicated; the Adler-32 of the
new bytes is computed in the same pass. Decoding refuses a frame that is not
exactly one zstd frame of the expected size before it allocates or writes
anything. Knows nothing of files, names or checkpoint layout.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import zstandard

from astra.weights.checksum import adler32, format_adler32

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
DEFAULT_LEVEL = 1  # what slime uses: cheap to encode, and sparse XORs compress well at any level
_CHUNK = 1 << 20
_BLOCK_HEADER = 3


class DeltaError(ValueError):
    """A frame that is not one zstd frame of (new XOR old) of the expected size."""


def _u8(buf: Any) -> np.ndarray:
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


def bytes_equal(a: Any, b: Any) -> bool:
    """Equality of two buffers, stopping at the first differing chunk (changed tensors cost ~nothing)."""
    x, y = _u8(a), _u8(b)
    if x.size != y.size:
        return False
    pos, step = 0, 1 << 16
    while pos < x.size:
        end = min(x.size, pos + step)
        if not np.array_equal(x[pos:end], y[pos:end]):
            return False
        pos, step = end, min(step * 2, _CHUNK * 4)
    return True


def frame_content_size(frame: Any) -> int | None:
    """Decoded size the frame declares, None when it declares none; DeltaError if not a frame."""
    if bytes(memoryview(frame)[:4]) != ZSTD_MAGIC:
        raise DeltaError("not a zstd frame (bad magic)")
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"bad zstd frame header: {exc}") from exc
    return None if size < 0 else size


def frame_compressed_size(frame: Any) -> int:
    """Length of the first zstd frame in the buffer, found by walking its block headers."""
    view = memoryview(frame).cast("B")
    frame_content_size(view)
    try:
        pos = zstandard.frame_header_size(view)
        has_checksum = zstandard.get_frame_parameters(view).has_checksum
    except zstandard.ZstdError as exc:
        raise DeltaError(f"bad zstd frame header: {exc}") from exc
    while True:
        if pos + _BLOCK_HEADER > len(view):
            raise DeltaError("zstd frame is truncated")
        (word,) = struct.unpack("<I", bytes(view[pos : pos + _BLOCK_HEADER]) + b"\0")
        last, kind, size = word & 1, (word >> 1) & 3, word >> 3
        if kind == 3:
            raise DeltaError("zstd frame has a reserved block type")
        pos += _BLOCK_HEADER + (1 if kind == 1 else size)
        if last:
            break
    pos += 4 if has_checksum else 0
    if pos > len(view):
        raise DeltaError("zstd frame is truncated")
    return pos


def encode_if_changed(new: Any, old: Any, level: int = DEFAULT_LEVEL) -> tuple[bytes, int] | None:
    """(frame, Adler-32 of new) for a changed tensor, None for an unchanged one."""
    if bytes_equal(new, old):
        return None
    x, y = _u8(new), _u8(old)
    if x.size != y.size:
        raise DeltaError(f"new has {x.size} bytes, old {y.size}: XOR needs equal sizes")
    cobj = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(size=x.size)
    scratch = np.empty(min(_CHUNK, x.size), dtype=np.uint8)
    parts, value = [], 1
    for pos in range(0, x.size, _CHUNK):
        end = min(x.size, pos + _CHUNK)
        out = scratch[: end - pos]
        np.bitwise_xor(x[pos:end], y[pos:end], out=out)
        value = adler32(x[pos:end], value)
        parts.append(cobj.compress(out))
    parts.append(cobj.flush())
    return b"".join(parts), value


class XorZstdEncoder:
    """Encodes one tensor's xor+zstd frame as its new bytes stream in, against a base cursor.

    `base` yields the base tensor's bytes in pieces (tensor_files.RangeCursor);
    `scratch` is a reusable writable buffer, handed back with `release`. `finish`
    returns (frame, Adler-32) or None when the tensor equals the base, like
    encode_if_changed, without holding or re-reading the tensor. With `check`
    (the base's recorded Adler-32) the base bytes are checksummed on the way
    and `finish` raises DeltaError when they differ from it.
    """

    def __init__(
        self,
        base: Any,
        size: int,
        level: int,
        scratch: Any,
        release: Any = None,
        check: str | None = None,
    ) -> None:
        self._base, self._scratch, self._release = base, _u8(scratch), release
        self._check, self._base_adler = check, 1
        self._cobj = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(
            size=size
        )
        self._parts: list[bytes] = []
        self._changed = False

    def update(self, new: Any) -> None:
        x, pos = _u8(new), 0
        for old in self._base.take(x.size):
            y = _u8(old)
            if self._check is not None:
                self._base_adler = adler32(y, self._base_adler)
            n, step = y.size, self._scratch.size
            for k in range(0, n, step):
                m = min(step, n - k)
                out = self._scratch[:m]
                np.bitwise_xor(x[pos + k : pos + k + m], y[k : k + m], out=out)
                if not self._changed and out.any():
                    self._changed = True
                self._parts.append(self._cobj.compress(out))
            del y
            pos += n

    def finish(self, adler: int) -> tuple[bytes, int] | None:
        self.close()
        if self._check is not None and format_adler32(self._base_adler) != self._check:
            raise DeltaError(
                f"base bytes hash to {format_adler32(self._base_adler)}, recorded {self._check}"
            )
        if not self._changed:
            return None
        self._parts.append(self._cobj.flush())
        frame = b"".join(self._parts)
        self._parts = []
        return frame, adler

    def close(self) -> None:
        self._base.close()
        self._scratch = None
        if self._release is not None:
            release, self._release = self._release, None
            release()


def encode_xor_zstd(new: Any, old: Any, level: int = DEFAULT_LEVEL) -> bytes:
    """One standalone zstd frame (content size declared) of new XOR old."""
    encoded = encode_if_changed(new, old, level)
    if encoded is None:
        size = _u8(new).size
        cobj = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(size=size)
        zeros = np.zeros(min(_CHUNK, size), dtype=np.uint8)
        parts = [cobj.compress(zeros[: min(_CHUNK, size - pos)]) for pos in range(0, size, _CHUNK)]
        return b"".join([*parts, cobj.flush()])
    return encoded[0]


def _check_frame(frame: Any, expected: int) -> None:
    declared = frame_content_size(frame)
    if declared is not None and declared != expected:
        raise DeltaError(f"frame declares {declared} bytes, base tensor has {expected}")
    if frame_compressed_size(frame) != len(memoryview(frame).cast("B")):
        raise DeltaError("data after the zstd frame")


def decode_xor_zstd_to_writer(frame: Any, old: Iterable[Any], expected: int, writer: Any) -> int:
    """Writes new = decode(frame) XOR old through a ShardWriter; returns the Adler-32 of new.

    `old` is the base tensor as consecutive pieces (one buffer, or pieces read
    from its file). Decodes straight into the writer's aligned buffer
    (`region` / `advance`), a cache-sized piece at a time: no full-size
    buffer, no extra copy. The same checks as decode_xor_zstd_into.
    """
    _check_frame(frame, expected)
    value, pos = 1, 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False) as reader:
            for piece in old:
                y = _u8(piece)
                if pos + y.size > expected:
                    raise DeltaError(f"base tensor has more than {expected} bytes")
                k = 0
                while k < y.size:
                    region = writer.region(min(_CHUNK, y.size - k))
                    n, filled = len(region), 0
                    while filled < n:
                        got = reader.readinto(region[filled:])
                        if not got:
                            region.release()
                            raise DeltaError(
                                f"frame decodes to {pos + filled} bytes, expected {expected}"
                            )
                        filled += got
                    chunk = np.frombuffer(region, dtype=np.uint8)
                    np.bitwise_xor(chunk, y[k : k + n], out=chunk)
                    value = adler32(chunk, value)
                    del chunk
                    region.release()
                    writer.advance(n)
                    k += n
                    pos += n
                del y
            if pos != expected:
                raise DeltaError(f"base tensor has {pos} bytes, expected {expected}")
            if reader.read(1):
                raise DeltaError(f"frame decodes to more than {expected} bytes")
    except zstandard.ZstdError as exc:
        raise DeltaError(f"corrupt zstd frame: {exc}") from exc
    return value


class XorZstdChunks:
    """new = decode(frame) XOR old, yielded a cache-sized chunk at a time into rotating buffers.

    `old` is the base tensor as consecutive pieces. A yielded chunk stays
    valid until `buffers - 1` more chunks have been yielded, so a consumer
    can hash one on another thread while the next is decoded. Given `out`
    (a uint8 buffer of `expected` bytes), the frame is decoded into it whole
    (zstd then writes straight into it, without a copy out of its window)
    and the chunks are views of `out`, valid as long as it is. `changed` is
    True once any decoded XOR byte was non-zero. The same checks as
    decode_xor_zstd_into: one frame, of exactly `expected` bytes.
    """

    def __init__(
        self,
        frame: Any,
        old: Iterable[Any],
        expected: int,
        buffers: int = 2,
        out: np.ndarray | None = None,
    ) -> None:
        _check_frame(frame, expected)
        if out is not None and out.size != expected:
            raise ValueError(f"output holds {out.size} bytes, base tensor {expected}")
        self.frame, self.old, self.expected, self.out = frame, old, expected, out
        n = max(1, min(_CHUNK, expected))
        count = 0 if out is not None else max(1, buffers)
        self._bufs = [np.empty(n, dtype=np.uint8) for _ in range(count)]
        self.changed = False

    def __iter__(self) -> Iterator[np.ndarray]:
        if self.out is not None:
            yield from self._into_out(self.out)
            return
        pos, turn = 0, 0
        try:
            with zstandard.ZstdDecompressor().stream_reader(
                self.frame, read_across_frames=False
            ) as reader:
                for piece in self.old:
                    y = _u8(piece)
                    if pos + y.size > self.expected:
                        raise DeltaError(f"base tensor has more than {self.expected} bytes")
                    k = 0
                    while k < y.size:
                        buf = self._bufs[turn % len(self._bufs)]
                        turn += 1
                        n = min(buf.size, y.size - k)
                        chunk, target, filled = buf[:n], memoryview(buf), 0
                        while filled < n:
                            got = reader.readinto(target[filled:n])
                            if not got:
                                raise DeltaError(
                                    f"frame decodes to {pos + filled} bytes, expected "
                                    f"{self.expected}"
                                )
                            filled += got
                        del target
                        if not self.changed and chunk.any():
                            self.changed = True
                        np.bitwise_xor(chunk, y[k : k + n], out=chunk)
                        yield chunk
                        k += n
                        pos += n
                    del y
                if pos != self.expected:
                    raise DeltaError(f"base tensor has {pos} bytes, expected {self.expected}")
                if reader.read(1):
                    raise DeltaError(f"frame decodes to more than {self.expected} bytes")
        except zstandard.ZstdError as exc:
            raise DeltaError(f"corrupt zstd frame: {exc}") from exc

    def _into_out(self, out: np.ndarray) -> Iterator[np.ndarray]:
        _decode_whole(self.frame, out)
        pos = 0
        for piece in self.old:
            y = _u8(piece)
            if pos + y.size > self.expected:
                raise DeltaError(f"base tensor has more than {self.expected} bytes")
            for k in range(0, y.size, _CHUNK):
                n = min(_CHUNK, y.size - k)
                chunk = out[pos : pos + n]
                if not self.changed and chunk.any():
                    self.changed = True
                np.bitwise_xor(chunk, y[k : k + n], out=chunk)
                yield chunk
                pos += n
            del y
        if pos != self.expected:
            raise DeltaError(f"base tensor has {pos} bytes, expected {self.expected}")


def decode_xor_zstd_into(frame: Any, old: Any, out: Any) -> int:
    """Writes new = decode(frame) XOR old into `out` (len(old) bytes); returns Adler-32 of new.

    Refuses, before writing, a buffer that is not exactly one frame or whose
    declared size differs from len(old); refuses while decoding a frame that
    yields more or fewer bytes.
    """
    y, dst = _u8(old), np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8)
    expected = y.size
    if dst.size != expected:
        raise ValueError(f"output holds {dst.size} bytes, base tensor {expected}")
    _check_frame(frame, expected)
    _decode_whole(frame, dst)
    value = 1
    for pos in range(0, expected, _CHUNK):  # a cache-sized piece: XOR, then its Adler-32
        end = min(expected, pos + _CHUNK)
        np.bitwise_xor(dst[pos:end], y[pos:end], out=dst[pos:end])
        value = adler32(dst[pos:end], value)
    return value


def _decode_whole(frame: Any, dst: np.ndarray) -> None:
    """Decodes one frame of exactly dst.size bytes into dst.

    One read into the whole buffer lets zstd write straight into it; reading
    it a piece at a time makes zstd decode into its own window and copy out
    (a quarter slower here).
    """
    target, filled, expected = memoryview(dst), 0, dst.size
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False) as reader:
            while filled < expected:
                got = reader.readinto(target[filled:])
                if not got:
                    raise DeltaError(f"frame decodes to {filled} bytes, expected {expected}")
                filled += got
            if reader.read(1):
                raise DeltaError(f"frame decodes to more than {expected} bytes")
    except zstandard.ZstdError as exc:
        raise DeltaError(f"corrupt zstd frame: {exc}") from exc


def decode_xor_zstd(frame: Any, old: Any, expected_size: int) -> bytearray:
    """new = decode(frame) XOR old, refusing frames of any size but `expected_size`."""
    if _u8(old).size != expected_size:
        raise DeltaError(f"base tensor has {_u8(old).size} bytes, expected {expected_size}")
    out = bytearray(expected_size)
    decode_xor_zstd_into(frame, old, out)
    return out
