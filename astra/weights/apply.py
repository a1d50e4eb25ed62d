"""Applies a delta to its full base, producing a full version, all or nothing.

Each changed tensor's frame is decoded straight into the memory-mapped output
shard, XORed with the base and its Adler-32 checked against the delta; each
unchanged tensor is copied and checked against the base's own checksum when
it has one. The output keeps the base's shards, files and tensor order, and
appears (atomic rename) only after every tensor verified. Never writes into
the base or the delta.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from astra.weights.checksum import CHECKSUM_FORMAT, adler32, adler32_hex, format_adler32
from astra.weights.delta import DeltaError, decode_xor_zstd_into
from astra.weights.layout import ChecksumMismatch, Version, extra_files, open_full, write_index
from astra.weights.safetensors_io import FormatError, encode_header
from astra.weights.staging import staged_dir
from astra.weights.validate import delta_metadata

_COPY_CHUNK = 1 << 22


def worker_count(workers: int | None) -> int:
    """Threads for per-tensor work: zstd, numpy and zlib release the GIL."""
    return max(1, workers or min(8, os.cpu_count() or 1))


def _apply_tensor(name: str, base: Version, delta: Version, dst: np.ndarray) -> str:
    old, entry = base.view(name), base.entries[name]
    change = delta.entries.get(name)
    if change is None:
        src, value = np.frombuffer(old, dtype=np.uint8), 1
        for pos in range(0, src.size, _COPY_CHUNK):
            dst[pos : pos + _COPY_CHUNK] = src[pos : pos + _COPY_CHUNK]
            value = adler32(dst[pos : pos + _COPY_CHUNK], value)
        got = format_adler32(value)
        if entry.checksum is not None and entry.checksum != got:
            raise ChecksumMismatch(
                f"base bytes hash to {got}, shard says {entry.checksum}",
                path=base.path,
                tensor=name,
            )
        return got
    try:
        got = format_adler32(decode_xor_zstd_into(delta.view(name), old, dst))
    except DeltaError as exc:
        raise FormatError(
            str(exc), path=change.shard.path, tensor=name, reason="CORRUPT_DELTA"
        ) from exc
    if got != change.checksum:
        cause = "wrong base or corrupt delta"
        if entry.checksum is not None and entry.checksum != adler32_hex(old):
            cause = "the base tensor does not match its own checksum"
        raise ChecksumMismatch(
            f"applied bytes hash to {got}, delta says {change.checksum} ({cause})",
            path=change.shard.path,
            tensor=name,
        )
    return got


def apply_delta(
    base_dir: str | os.PathLike[str],
    delta_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    workers: int | None = None,
    durable: bool = True,
) -> dict[str, Any]:
    """Rebuilds the full version base + delta at out_dir, every checksum verified first.

    The output keeps the base's shards and files; on any failure nothing is
    left at out_dir and the error names the tensor.
    """
    with open_full(base_dir) as base, Version(delta_dir) as delta:
        version, base_version = delta_metadata(delta)
        for name, entry in delta.entries.items():
            if name not in base.entries:
                raise FormatError("changed tensor is not in the base", path=delta.path, tensor=name)
            if entry.info.dtype != "U8" or len(entry.info.shape) != 1:
                raise FormatError(
                    "delta tensor is not a 1-D U8 frame", path=delta.path, tensor=name
                )
        with staged_dir(out_dir, durable=durable) as stage:
            jobs: list[tuple[str, np.ndarray]] = []
            outputs: list[tuple[mmap.mmap, list[str], dict[str, str], list[Any]]] = []
            try:
                for shard_name, shard in base.shards.items():
                    names = list(shard.tensors)
                    keep = {k: v for k, v in shard.metadata.items() if k not in shard.tensors}
                    keep.setdefault("format", "pt")
                    layout = [(n, i.dtype, i.shape, i.nbytes) for n, i in shard.tensors.items()]
                    header = encode_header(layout, {**keep, **dict.fromkeys(names, "0" * 8)})
                    size = len(header) + sum(i.nbytes for i in shard.tensors.values())
                    with open(stage / shard_name, "w+b") as f:
                        # Reserve the blocks now: a full disk is an OSError here, not a SIGBUS later.
                        if hasattr(os, "posix_fallocate"):
                            os.posix_fallocate(f.fileno(), 0, size)
                        else:
                            f.truncate(size)
                        mm = mmap.mmap(f.fileno(), size)
                    body = np.frombuffer(mm, dtype=np.uint8)[len(header) :]
                    jobs += [(n, body[i.begin : i.end]) for n, i in shard.tensors.items()]
                    outputs.append((mm, names, keep, layout))
                    del body
                with ThreadPoolExecutor(worker_count(workers)) as pool:
                    futures = [pool.submit(_apply_tensor, n, base, delta, dst) for n, dst in jobs]
                    try:
                        sums = {
                            n: future.result() for (n, _), future in zip(jobs, futures, strict=True)
                        }
                    except BaseException:
                        pool.shutdown(cancel_futures=True)  # the first failure decides; stop early
                        raise
                jobs.clear()
                for mm, names, keep, layout in outputs:
                    header = encode_header(layout, {**keep, **{n: sums[n] for n in names}})
                    mm[: len(header)] = header
            finally:
                jobs.clear()
                for mm, *_ in outputs:
                    # A failed job's traceback may still hold a view; the mapping then goes with it.
                    with contextlib.suppress(BufferError):
                        mm.close()
            for extra in (*extra_files(base), *extra_files(delta)):
                shutil.copyfile(extra, stage / extra.name)
            metadata = {
                k: v for k, v in base.metadata.items() if k not in ("base_version", "version")
            }
            metadata.update(
                total_size=sum(e.info.nbytes for e in base.entries.values()),
                checksum_format=CHECKSUM_FORMAT,
                version=version,
            )
            write_index(stage, metadata, dict(base.weight_map))
        return {
            "kind": "full",
            "path": str(out_dir),
            "version": version,
            "base_version": base_version,
            "tensor_count": len(base.entries),
            "changed_tensor_count": len(delta.entries),
            "model_size_bytes": metadata["total_size"],
            "delta_size_bytes": sum(e.info.nbytes for e in delta.entries.values()),
        }
