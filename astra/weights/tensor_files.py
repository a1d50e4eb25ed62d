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

import contextlib
import errno
import mmap
import os
import shutil
import struct
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from astra.durable import fsync_path
from astra.weights.checksum import CHECKSUM_FORMAT
from astra.weights.layout import check_identity, full_shard_name, write_index
from astra.weights.safetensors_io import encode_header

_COPY_CHUNK = 1 << 30
ALIGN = 4096  # O_DIRECT: file offsets, lengths and memory aligned to this
BUFFER_BYTES = 8 << 20  # one aligned write buffer; a multiple of ALIGN


def tensor_header(
    name: str, dtype: str, shape: Any, size: int, adler: str, *, align: int = 8
) -> bytes:
    """The header of a shard holding exactly this tensor, its checksum in the metadata.

    With `align` the JSON is padded with spaces (which the format allows) so
    the tensor's bytes start at a multiple of `align`.
    """
    head = encode_header([(name, dtype, tuple(shape), size)], {"format": "pt", name: adler})
    pad = -len(head) % align
    if pad:
        (length,) = struct.unpack("<Q", head[:8])
        head = struct.pack("<Q", length + pad) + head[8:] + b" " * pad
    return head


def write_packed_shard(
    path: Path, tensors: list[tuple[str, str, Any, Any, str]], *, durable: bool
) -> int:
    """Writes one shard holding `tensors` (name, dtype, shape, bytes, Adler-32 hex) in that
    order, each Adler-32 in its header's metadata, fsynced when `durable`; returns the
    header's length (where the first tensor's bytes start). OSError as the file system
    raises it."""
    head = encode_header(
        ((n, d, tuple(s), len(b)) for n, d, s, b, _ in tensors),
        {"format": "pt", **{n: adler for n, *_, adler in tensors}},
    )
    with open(path, "wb") as f:
        f.write(head)
        for *_, data, _ in tensors:
            f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    return len(head)


class _Buffers:
    """Page-aligned buffers reused across shards (O_DIRECT needs aligned memory).

    Fresh anonymous memory costs a page fault per page (dear on a VM), so
    buffers are kept and reused rather than mapped per shard; transparent
    huge pages are asked for where the kernel offers them.
    """

    def __init__(self, size: int = BUFFER_BYTES, keep: int = 8) -> None:
        self.size, self.keep = size, keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        buf = mmap.mmap(-1, self.size)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                buf.madvise(mmap.MADV_HUGEPAGE)
        return buf

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)
                return
        # A view may outlive its use; the mapping then goes with the last one.
        with contextlib.suppress(BufferError):
            buf.close()


BUFFERS = _Buffers()
# Below this, a tensor (or shard) is handled on the thread it arrives on, publishing and
# fetching alike: a hand-off to a worker costs more than the work, most of all on a busy machine.
INLINE_BYTES = 256 << 10


class ShardWriter:
    """Writes one single-tensor shard front to back: its header, then the tensor's bytes.

    Bytes are gathered in an aligned buffer and written a buffer at a time;
    with `direct` (and a header padded to ALIGN) the file is opened with
    O_DIRECT, so no page cache is filled (on a VM, allocating page cache
    costs more than the copy) and an fsync has only metadata left to flush.
    Where the file system refuses O_DIRECT it writes through the page cache.
    `region` + `advance` let a decoder write straight into the buffer. The
    buffer is held only while bytes are being written (from the first to the
    last), so shards waiting to be synced hold none. A full buffer is written
    by a writer thread while the next one fills (one write in flight per
    shard). Sequential, one thread at a time.
    """

    def __init__(self, path: Path, head: bytes, size: int, *, direct: bool = True) -> None:
        self.path, self.size, self.head_len = path, size, len(head)
        self.written = 0  # tensor bytes accepted so far
        # A small shard goes through the page cache, written on the caller's thread: O_DIRECT's
        # aligned writes and a writer thread cost more than such a write.
        self.small = len(head) + size < INLINE_BYTES
        self.direct = (
            direct and not self.small and hasattr(os, "O_DIRECT") and len(head) % ALIGN == 0
        )
        self.fd: int | None = None
        self._head: bytes | None = head  # written into the buffer when it is first taken
        self._buf: mmap.mmap | None = None
        self._mv: memoryview | None = None
        self._fill = self._pos = 0  # bytes in the buffer; file offset of the buffer's start
        self._inflight: Future[None] | None = None  # the previous buffer's write
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self.direct = False
        if self.fd is None:
            self.fd = os.open(path, flags, 0o644)
        try:
            reserve(self.fd, len(head) + size)
        except BaseException:
            self.abort()
            raise

    @property
    def complete(self) -> bool:
        return self.written == self.size

    def _take(self) -> memoryview:
        if self._mv is None:
            self._buf = BUFFERS.get()
            self._mv = memoryview(self._buf)
            head, self._head = self._head, None
            if head:
                self._put(memoryview(head))
        return self._mv

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if self.written + view.nbytes > self.size:
            raise ValueError(f"{self.path.name}: more than {self.size} bytes")
        self._take()
        self._put(view)
        self.written += view.nbytes
        if self.written == self.size:
            self._drain()

    def region(self, limit: int) -> memoryview:
        """Free space in the buffer for up to `limit` more tensor bytes; `advance` commits them."""
        mv = self._take()
        n = min(len(mv) - self._fill, limit, self.size - self.written)
        return mv[self._fill : self._fill + n]

    def advance(self, n: int) -> None:
        self._fill += n
        self.written += n
        if self._fill == len(self._mv):
            self._flush()
        if self.written == self.size:
            self._drain()

    def _put(self, view: memoryview) -> None:
        while view.nbytes:
            mv = self._mv  # a flush swaps in a fresh buffer
            n = min(len(mv) - self._fill, view.nbytes)
            mv[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == len(mv):
                self._flush()

    def _flush(self) -> None:
        """Hands the full buffer to a writer thread (one write in flight) and takes a fresh one."""
        n = self._fill
        if self.direct:
            n += -n % ALIGN  # the tail of the last write; truncated away in close()
            self._mv[self._fill : n] = bytes(n - self._fill)
        self._wait()
        buf, mv, pos, fill = self._buf, self._mv, self._pos, self._fill
        if self.small:
            self._write(buf, mv, n, pos, fill)
        else:
            self._inflight = _WRITERS.submit(self._write, buf, mv, n, pos, fill)
        self._pos += fill
        self._fill = 0
        self._buf = BUFFERS.get()
        self._mv = memoryview(self._buf)

    def _write(self, buf: mmap.mmap, mv: memoryview, n: int, pos: int, fill: int) -> None:
        try:
            try:
                pwrite_all(self.fd, mv[:n], pos)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                # The file system opened with O_DIRECT but refuses its writes: use the cache.
                fd = os.open(self.path, os.O_RDWR)
                os.close(self.fd)
                self.fd, self.direct = fd, False
                pwrite_all(self.fd, mv[:fill], pos)
        finally:
            mv.release()
            BUFFERS.put(buf)

    def _wait(self) -> None:
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            inflight.result()

    def rewrite_head(self, head: bytes) -> None:
        """Replaces the header (same length) once every byte is written, e.g. with a checksum."""
        if len(head) != self.head_len or self._mv is not None:
            raise ValueError("a header is rewritten only after the bytes, at the same length")
        if self._head is not None:  # never written: an empty tensor
            self._head = head
            return
        if not self.direct:
            pwrite_all(self.fd, head, 0)
            return
        # Whole pages through the page cache (no synchronous device write); synced with the rest.
        fd = os.open(self.path, os.O_WRONLY)
        try:
            pwrite_all(fd, head, 0)
        finally:
            os.close(fd)

    def _drain(self) -> None:
        """Writes out what is buffered and gives the buffer back (every byte has arrived)."""
        if self._mv is None:
            return
        if self._fill:
            self._flush()
        self._give_back()
        self._wait()

    def close(self, *, durable: bool) -> None:
        """Writes what is buffered, syncs (when durable) and closes; the file then holds the shard."""
        if self.written != self.size:
            raise ValueError(f"{self.path.name}: {self.written} of {self.size} bytes")
        if self._head is not None:  # an empty tensor: only the header
            self._take()
        self._drain()
        if self.direct:
            os.ftruncate(self.fd, self.head_len + self.size)
        if durable:
            os.fsync(self.fd)
        self._release()

    def abort(self) -> None:
        """Closes without finishing; the caller removes the file."""
        with contextlib.suppress(Exception):
            self._wait()
        self._release()

    def _give_back(self) -> None:
        if self._mv is not None:
            self._mv.release()
            self._mv = None
        if self._buf is not None:
            BUFFERS.put(self._buf)
            self._buf = None

    def _release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._give_back()


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


_READERS = ThreadPoolExecutor(4, thread_name_prefix="read-ahead")
_WRITERS = ThreadPoolExecutor(4, thread_name_prefix="shard-write")


def read_range(path: Path, offset: int, size: int) -> Iterator[memoryview]:
    """A file's bytes [offset, offset + size) as consecutive pieces of reused aligned buffers.

    Read with O_DIRECT when the range starts aligned (a single-tensor shard
    this package wrote), so nothing is faulted in or cached, and one piece
    ahead on a reader thread, so the disk works while the caller computes.
    Each piece stays valid while the caller takes the next one (a caller that
    stitches pieces, like RangeCursor, still holds the previous one then): three
    buffers turn, and the one read ahead into is never the current piece's or
    the previous one's.
    """
    direct = hasattr(os, "O_DIRECT") and offset % ALIGN == 0
    fd = -1
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            direct = False
    if fd < 0:
        fd = os.open(path, os.O_RDONLY)
    state = {"fd": fd, "direct": direct}
    bufs = [BUFFERS.get() for _ in range(3)]
    views = [memoryview(b) for b in bufs]

    def fill(mv: memoryview, pos: int) -> int:
        n = min(len(mv), size - pos)
        got = 0
        while got < n:
            want = n + (-n % ALIGN if state["direct"] else 0)
            try:
                k = os.preadv(state["fd"], [mv[got:want]], offset + pos + got)
            except OSError as exc:
                if not state["direct"] or exc.errno != errno.EINVAL:
                    raise
                os.close(state["fd"])  # O_DIRECT opened but refused: read through the cache
                state["fd"], state["direct"] = os.open(path, os.O_RDONLY), False
                continue
            if k <= 0:
                raise OSError(errno.EIO, f"{path}: ends before byte {offset + size}")
            got += k
        return n

    pending = _READERS.submit(fill, views[0], 0) if size else None
    try:
        pos, i = 0, 0
        while pos < size:
            n = pending.result()
            pending = None
            if pos + n < size:
                pending = _READERS.submit(fill, views[(i + 1) % 3], pos + n)
            piece = views[i][:n]
            yield piece
            piece.release()
            pos, i = pos + n, (i + 1) % 3
    finally:
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.result()
        os.close(state["fd"])
        for mv in views:
            mv.release()
        for buf in bufs:
            BUFFERS.put(buf)


class RangeCursor:
    """Takes a file range front to back in pieces of any size (over `read_range`)."""

    def __init__(self, path: Path, offset: int, size: int) -> None:
        self._pieces = read_range(path, offset, size)
        self._cur: memoryview | None = None
        self._at = 0

    def take(self, n: int) -> Iterator[memoryview]:
        """The next n bytes as consecutive views, each valid until the next is asked for."""
        while n:
            if self._cur is None or self._at == len(self._cur):
                self._cur, self._at = next(self._pieces, None), 0
                if self._cur is None:
                    raise OSError(errno.EIO, "the range ended early")
            k = min(n, len(self._cur) - self._at)
            yield self._cur[self._at : self._at + k]
            self._at += k
            n -= k

    def close(self) -> None:
        self._cur = None
        self._pieces.close()


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
    """Builds a full version in `out` (created here) from shard files.

    `shards` maps each tensor to a complete shard holding it (already durable
    when `durable`): its own, or one several tensors share (a publish's packed
    small tensors). Each file is linked in once, under a Hugging Face name, in
    the order of its first tensor by name. Only the index, extra files and
    links are new.
    """
    out.mkdir(parents=True)
    names = sorted(shards)
    paths = list(dict.fromkeys(shards[n] for n in names))
    shard_of = {path: full_shard_name(i, len(paths)) for i, path in enumerate(paths)}
    weight_map = {name: shard_of[shards[name]] for name in names}
    copied: list[Path] = []
    for path, shard in shard_of.items():
        if link_or_copy(path, out / shard):
            copied.append(out / shard)
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
