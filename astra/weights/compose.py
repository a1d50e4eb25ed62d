"""Composes a run of xor+zstd deltas into one delta, and writes deltas from frames.

XOR deltas compose by XOR: the deltas of versions b+1..t together take b to
t, and the same run read backwards takes t to b. Composition decodes each
tensor's frames one tensor at a time (memory: twice the largest tensor),
drops tensors whose changes cancel out, and re-encodes the rest with the
target's Adler-32. The output is an ordinary slime-layout delta directory,
written atomically. Knows nothing of stores, identities' meaning or gRPC.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import zstandard

from astra.weights.checksum import CHECKSUM_FORMAT
from astra.weights.delta import DEFAULT_LEVEL, DeltaError, decode_xor_zstd_into
from astra.weights.layout import Version, delta_shard_name, plan_shards, write_index
from astra.weights.safetensors_io import FormatError, write_file
from astra.weights.staging import staged_dir

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
_CHUNK = 1 << 20


def write_delta_frames(
    out_dir: str | os.PathLike[str],
    frames: Mapping[str, tuple[Any, str]],
    version: str,
    base_version: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    durable: bool = True,
) -> None:
    """Writes a delta directory from {name: (zstd frame, Adler-32 of the new bytes)}."""
    metadata = {
        "version": version,
        "base_version": base_version,
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": CHECKSUM_FORMAT,
    }
    names = sorted(frames)
    sizes = [(n, memoryview(frames[n][0]).nbytes) for n in names]
    plan = plan_shards(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    with staged_dir(out_dir, durable=durable) as stage:
        for i, shard_names in enumerate(plan):
            shard = delta_shard_name(i, len(plan))
            entries = [
                (n, "U8", (memoryview(frames[n][0]).nbytes,), frames[n][0]) for n in shard_names
            ]
            write_file(stage / shard, entries, {n: frames[n][1] for n in shard_names})
            weight_map.update(dict.fromkeys(shard_names, shard))
        write_index(stage, metadata, weight_map)


def _compress(data: np.ndarray, level: int) -> bytes:
    cobj = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(
        size=data.size
    )
    parts = [cobj.compress(data[pos : pos + _CHUNK]) for pos in range(0, data.size, _CHUNK)]
    return b"".join([*parts, cobj.flush()])


def compose_deltas(
    step_dirs: Sequence[str | os.PathLike[str]],
    sizes: Mapping[str, int],
    checksums: Mapping[str, str],
    out_dir: str | os.PathLike[str],
    version: str,
    base_version: str,
    *,
    level: int = DEFAULT_LEVEL,
    durable: bool = True,
) -> dict[str, int]:
    """Writes the one delta equivalent to applying every step (in any order).

    `sizes` gives each tensor's raw size, `checksums` the target's Adler-32
    per tensor. Returns the number of changed tensors and encoded bytes.
    """
    with contextlib.ExitStack() as stack:
        steps = [stack.enter_context(Version(d)) for d in step_dirs]
        names = sorted({n for step in steps for n in step.entries})
        frames: dict[str, tuple[bytes, str]] = {}
        for name in names:
            if name not in sizes or name not in checksums:
                raise FormatError("changed tensor is not in the target", tensor=name)
            acc = np.zeros(sizes[name], dtype=np.uint8)
            scratch = np.empty_like(acc)
            for step in steps:
                if name not in step.entries:
                    continue
                view = step.view(name)
                try:
                    decode_xor_zstd_into(view, acc, scratch)
                except DeltaError as exc:
                    raise FormatError(
                        str(exc), path=step.path, tensor=name, reason="CORRUPT_DELTA"
                    ) from exc
                finally:
                    view.release()
                acc, scratch = scratch, acc
            if acc.any():
                frames[name] = (_compress(acc, level), checksums[name])
        write_delta_frames(out_dir, frames, version, base_version, durable=durable)
    return {
        "changed_tensor_count": len(frames),
        "delta_size_bytes": sum(len(f) for f, _ in frames.values()),
    }
