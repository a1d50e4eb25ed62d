"""The RAM copy a publish builds (HotBuilder) and the chunked xor+zstd decode that fills it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import zstandard

from astra.weights.delta import DeltaError, XorZstdChunks, encode_xor_zstd
from astra.weights.hot import HotBuilder
from astra.weights.pool import BufferPool


def pieces_of(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("size", [1, 4096, (1 << 20) + 3, (3 << 20) + 11])
def test_xor_zstd_chunks_give_the_new_bytes_in_order(size: int, into: bool) -> None:
    rng = np.random.default_rng(size)
    old = rng.integers(0, 256, size, np.uint8).tobytes()
    new = bytearray(old)
    for i in rng.choice(size, max(1, size // 100), replace=False):
        new[i] ^= 1 + int(rng.integers(0, 255))
    frame = encode_xor_zstd(bytes(new), old)
    out = np.full(size, 7, np.uint8) if into else None
    cuts = sorted({int(c) for c in rng.integers(1, size, 3)}) if size > 1 else []
    chunks = XorZstdChunks(frame, pieces_of(old, cuts), size, out=out)
    got = b"".join(bytes(c) for c in chunks)
    assert got == new and chunks.changed
    if into:
        assert out.tobytes() == new, "decoded straight into the given buffer"
    unchanged = XorZstdChunks(encode_xor_zstd(old, old), [old], size, out=out)
    assert b"".join(bytes(c) for c in unchanged) == old and not unchanged.changed


@pytest.mark.parametrize("into", [False, True])
def test_xor_zstd_chunks_refuse_frames_of_another_size(into: bool) -> None:
    old = bytes(range(256)) * 8
    out = np.empty(len(old), np.uint8) if into else None
    unsized = zstandard.ZstdCompressor(write_content_size=False)
    for data, needle in [(b"\0" * 1000, "decodes to 1000"), (b"\0" * 3000, "more than")]:
        chunks = XorZstdChunks(unsized.compress(data), [old], len(old), out=out)
        with pytest.raises(DeltaError, match=needle):
            list(chunks)
    frame = encode_xor_zstd(old, old)
    with pytest.raises(DeltaError, match="base tensor has"):
        list(XorZstdChunks(frame, [old, b"x"], len(old), out=out))
    if into:
        with pytest.raises(ValueError, match="output holds"):
            XorZstdChunks(frame, [old], len(old), out=np.empty(10, np.uint8))


def test_a_buffer_in_use_goes_back_to_the_pool_only_when_its_sink_ends() -> None:
    pool = BufferPool(1 << 20)
    builder = HotBuilder(pool, max_bytes=3000)
    a, b = builder.begin("a", 1000), builder.begin("b", 1000)
    builder.end("a")
    assert builder.begin("c", 2000) is None, "past the budget: the version is dropped"
    assert pool.take(1000) is a and pool.take(1000) is None, "b is still being written"
    builder.end("b")
    assert pool.take(1000) is b
    builder.end("b")  # twice: nothing more
    assert pool.take(1000) is None


def test_a_version_handed_over_keeps_its_buffers_whatever_a_sink_says_later() -> None:
    pool = BufferPool(1 << 20)
    builder = HotBuilder(pool, max_bytes=1 << 20)
    a = builder.begin("a", 1000)
    version = builder.finish("v1", ["a"])
    assert version is not None and version.get("a", 1000) is a
    builder.end("a")
    builder.close()
    assert pool.take(1000) is None, "the committed version still holds it"
    del version
    assert pool.take(1000) is a, "back once no publish reads the version"
