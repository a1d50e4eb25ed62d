"""An append-only log of trajectory payloads, in rotating segment files.

SQLite holds the facts about each buffered group; the bytes of its
trajectories go here, because writing ~100 MB/s of blobs through SQLite's
WAL costs several times what a plain append does. Order of writes makes it
safe against a process crash: the bytes are written (into the page cache)
before the SQLite row that points at them commits, so a committed row never
points at missing bytes, and bytes without a row are garbage. A segment file
is deleted once it is no longer the active one and no row points into it.

Room can be reserved first (`reserve`, on the owner's thread) and the bytes
written later on another thread (`write_record`), so Dataflow writes them off
its event loop; the row is still committed only after the write returned.

Record format (version 2): each record is an 8-byte header, the body's length
and CRC-32 (little-endian u32 each), then the body. `read` checks both against
the row's length and raises `CorruptRecord` (file, offset, why) on a mismatch or
a short read: the caller quarantines the record, it is never trained. Segments
numbered below `checked_from` were written by a build without the header
(version 1) and are read unchecked; the store keeps that number durably.

fsync policy: the blob log is never fsynced. Its bytes reach the page cache
before the SQLite row that points at them commits, so a process crash
(kill -9) loses nothing that was acknowledged. A machine crash or power loss
may lose or tear the newest records while their rows survive (SQLite's WAL
with synchronous=NORMAL is not fsynced per commit either): such a record fails
its length or CRC check at the next start, is dropped, counted and its group
dispatched again; it is never trained and it does not stop the start.
A segment's *name* is made durable when it is created (the directory is fsynced,
once per segment): else a power loss could take every segment file away while
rows still point into them, and the next start would number its new segment as
one of theirs.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

try:  # zlib-ng's SIMD CRC-32: the same values, ~8x the speed of the system zlib's here
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; the stdlib still works
    _crc32 = zlib.crc32

from astra.durable import fsync_dir, make_dirs

SEGMENT_BYTES = 256 << 20
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
FORMAT_VERSION = 2
HEADER = struct.Struct("<II")  # body length, CRC-32 of the body


class CorruptRecord(Exception):
    """A record whose bytes are not those written: short, or failing its length or CRC."""

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        self.path, self.offset, self.reason = path, offset, reason
        super().__init__(f"{path} at offset {offset}: {reason}")


def record_size(body_bytes: int) -> int:
    """Bytes a record of `body_bytes` takes in the log (what its row's length says)."""
    return HEADER.size + body_bytes


def write_record(fd: int, offset: int, parts: list) -> None:
    """Writes a record (header, then the concatenation of `parts`) at `offset`; the CRC is
    computed here, so on any thread (zlib-ng, like zlib, releases the GIL on large buffers)."""
    crc, n = 0, 0
    for p in parts:
        crc = _crc32(p, crc)
        n += len(p)
    write_parts(fd, offset, [HEADER.pack(n, crc), *parts])


def check_record(path: Path, offset: int, data: bytes, length: int) -> bytes:
    """The body of the record `data` read at `offset` for a row of `length` bytes."""
    if len(data) != length:
        raise CorruptRecord(path, offset, f"short read ({len(data)} of {length} bytes): torn")
    if length < HEADER.size:
        raise CorruptRecord(path, offset, f"{length} bytes cannot hold a record header")
    n, crc = HEADER.unpack_from(data)
    if n != length - HEADER.size:
        raise CorruptRecord(path, offset, f"header says {n} bytes, the row {length - HEADER.size}")
    body = data[HEADER.size :]
    got = _crc32(body)
    if got != crc:
        raise CorruptRecord(path, offset, f"CRC-32 {got:08x}, header says {crc:08x}")
    return body


def write_parts(fd: int, offset: int, parts: list) -> None:
    """pwritev the concatenation of `parts` at `offset`, until every byte is written (a
    regular file rarely writes short). Touches no BlobLog state: safe on any thread."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        written = os.pwritev(fd, views[:IOV_MAX], offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class BlobLog:
    """Not thread-safe, except `write_parts` on a reservation (see `reserve`)."""

    def __init__(self, directory: str | Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = Path(directory)
        make_dirs(self.dir)
        self.segment_bytes = segment_bytes
        self.live: Counter[int] = Counter()
        existing = segment_numbers(self.dir)
        self.active = (existing[-1] + 1) if existing else 0
        # Segments below this one hold version-1 records (no header): the store sets it.
        self.checked_from = 0
        # Writers stay open until their segment is dropped, so a write on another thread
        # never finds its descriptor closed by a rotation.
        self._writers: dict[int, int] = {self.active: self._open(self.active)}
        self._size = 0
        self._readers: dict[int, int] = {}
        # Runs a segment's deletion elsewhere (e.g. on a writer thread) when set.
        self.defer: Callable[[Callable[[], None]], object] | None = None

    def _path(self, segment: int) -> Path:
        return segment_path(self.dir, segment)

    def _open(self, segment: int) -> int:
        fd = os.open(self._path(segment), os.O_WRONLY | os.O_CREAT, 0o644)
        fsync_dir(self.dir)  # the name survives a power loss, so its number is never reused
        return fd

    def append(self, data: bytes) -> tuple[int, int, int]:
        """Writes a record of `data`; returns (segment, offset, length) to store with the row."""
        return self.append_parts([data])

    def append_parts(self, parts: list) -> tuple[int, int, int]:
        """Writes a record of the concatenation of `parts` (bytes-like) without building it
        in memory. Returns (segment, offset, length) like `append`."""
        segment, offset, length, fd = self.reserve(record_size(sum(len(p) for p in parts)))
        try:
            write_record(fd, offset, parts)
        except BaseException:
            self.release(segment)
            raise
        return segment, offset, length

    def reserve(self, length: int) -> tuple[int, int, int, int]:
        """Room for `length` bytes, a `record_size`: (segment, offset, length, fd). The caller
        writes the record with `write_record(fd, offset, parts)` (on any thread) before the
        row that points at them
        commits, or gives the room back with `release(segment)`. Counts as a live row."""
        if self._size and self._size + length > self.segment_bytes:
            retired = self.active
            self.active += 1
            self._writers[self.active] = self._open(self.active)
            self._size = 0
            if self.live[retired] <= 0:  # everything in it was released while it was active
                del self.live[retired]
                self._drop(retired)
        offset = self._size
        self._size += length
        self.live[self.active] += 1
        return self.active, offset, length, self._writers[self.active]

    def read(self, segment: int, offset: int, length: int) -> bytes:
        """The body of the record a row points at; CorruptRecord if it is not as written
        (a missing segment included). Version-1 segments are returned unchecked."""
        path = self._path(segment)
        fd = self._readers.get(segment)
        if fd is None:
            try:
                fd = self._readers[segment] = os.open(path, os.O_RDONLY)
            except FileNotFoundError as exc:
                raise CorruptRecord(path, offset, "segment file missing") from exc
        data = os.pread(fd, length, offset)
        if segment < self.checked_from:
            if len(data) != length:
                raise CorruptRecord(path, offset, f"short read ({len(data)} of {length} bytes)")
            return data
        return check_record(path, offset, data, length)

    def adopt(self, segment: int) -> None:
        """Counts a row found at start-up that points into `segment`."""
        self.live[segment] += 1

    def release(self, segment: int) -> None:
        """A row pointing into `segment` is gone; drops the file once nothing points in."""
        self.live[segment] -= 1
        if self.live[segment] <= 0:
            del self.live[segment]
            if segment != self.active:
                self._drop(segment)

    def collect_garbage(self) -> None:
        """Deletes every inactive segment with no live row (after start-up adoption)."""
        for seg in segment_numbers(self.dir):
            if seg != self.active and self.live[seg] <= 0:
                self._drop(seg)

    def _drop(self, segment: int) -> None:
        for fds in (self._readers, self._writers):
            fd = fds.pop(segment, None)
            if fd is not None:
                os.close(fd)
        path = self._path(segment)
        if self.defer is None:
            path.unlink(missing_ok=True)
        else:
            # Unlinking a full segment frees its page cache: milliseconds, sometimes tens,
            # better spent off the caller's event loop. A crash before it runs leaves a
            # segment no row points into, deleted at the next start.
            self.defer(lambda: path.unlink(missing_ok=True))

    def close(self) -> None:
        for fds in (self._readers, self._writers):
            for fd in fds.values():
                os.close(fd)
            fds.clear()


def read_checked(path: Path, offset: int, length: int, *, checked: bool = True) -> bytes:
    """One record's body read from a segment file by path (offline: `astra doctor`);
    CorruptRecord as `BlobLog.read`."""
    try:
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), length, offset)
    except FileNotFoundError as exc:
        raise CorruptRecord(path, offset, "segment file missing") from exc
    if not checked:
        if len(data) != length:
            raise CorruptRecord(path, offset, f"short read ({len(data)} of {length} bytes)")
        return data
    return check_record(path, offset, data, length)


def segment_path(directory: Path, segment: int) -> Path:
    return directory / f"{segment:08d}.seg"


def segment_numbers(directory: Path) -> list[int]:
    """The numbers of the segment files in `directory`, ascending (other names ignored)."""
    return sorted(int(p.stem) for p in directory.glob("*.seg") if p.stem.isdigit())
