"""Single-tensor shards: one safetensors file per tensor, written once at its final offsets.

A tensor's shard header (name, dtype, shape, and its Adler-32 in the
metadata) is known before its first byte arrives, so a receiver or a
publish stage writes the header first and then the bytes where they will
stay; a version directory is then assembled from such files by hard links
(or `copy_file_range` across file systems) plus an index, with no byte
rewritten and no checksum recomputed. Version files are immutable, so
versions may share inodes. Never touches gRPC.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from astra.weights.checksum import CHECKSUM_FORMAT
from astra.weights.layout import check_identity, full_shard_name, write_index
from astra.weights.records import fsync_path
from astra.weights.safetensors_io import encode_header

_COPY_CHUNK = 1 << 30


def tensor_header(name: str, dtype: str, shape: Any, size: int, adler: str) -> bytes:
    """The header of a shard holding exactly this tensor, its checksum in the metadata."""
    return encode_header([(name, dtype, tuple(shape), size)], {"format": "pt", name: adler})


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def reserve(fd: int, size: int) -> None:
    """Sizes a new file, reserving its blocks where possible (ENOSPC now, not later)."""
    if size and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    os.ftruncate(fd, size)


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int) -> None:
    """Copies bytes between files in the kernel (copy_file_range), falling back to read/write."""
    while count > 0:
        n = 0
        if hasattr(os, "copy_file_range"):
            try:
                n = os.copy_file_range(
                    src_fd, dst_fd, min(count, _COPY_CHUNK), src_offset, dst_offset
                )
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        if n <= 0:
            data = os.pread(src_fd, min(count, 1 << 22), src_offset)
            if not data:
                raise OSError(errno.EIO, "source ended early")
            pwrite_all(dst_fd, data, dst_offset)
            n = len(data)
        src_offset, dst_offset, count = src_offset + n, dst_offset + n, count - n


def link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-links src at dst; copies it when the file system cannot. True when it copied."""
    try:
        os.link(src, dst)
        return False
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    shutil.copyfile(src, dst)
    return True


def assemble(
    out: Path,
    shards: Mapping[str, Path],
    sizes: Mapping[str, int],
    *,
    version: str | None,
    files: Mapping[str, bytes] | None = None,
    durable: bool = True,
) -> None:
    """Builds a full version in `out` (created here) from single-tensor shard files.

    `shards` maps each tensor to a complete single-tensor shard (already
    durable when `durable`); they are linked in under Hugging Face names in
    tensor-name order. Only the index, extra files and links are new.
    """
    out.mkdir(parents=True)
    names = sorted(shards)
    weight_map: dict[str, str] = {}
    copied: list[Path] = []
    for i, name in enumerate(names):
        shard = full_shard_name(i, len(names))
        if link_or_copy(shards[name], out / shard):
            copied.append(out / shard)
        weight_map[name] = shard
    metadata: dict[str, Any] = {"total_size": sum(sizes[n] for n in names)}
    metadata["checksum_format"] = CHECKSUM_FORMAT
    if version is not None:
        metadata["version"] = check_identity(version)
    for name, content in (files or {}).items():
        (out / name).write_bytes(content)
        copied.append(out / name)
    write_index(out, metadata, weight_map)
    if durable:
        for path in (*copied, out / "model.safetensors.index.json"):
            fsync_path(path)
        fsync_path(out)
