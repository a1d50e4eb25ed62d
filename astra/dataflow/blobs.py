"""An append-only log of trajectory payloads, in rotating segment files.

SQLite holds the facts about each buffered group; the bytes of its
trajectories go here, because writing ~100 MB/s of blobs through SQLite's
WAL costs several times what a plain append does. Order of writes makes it
safe against a process crash: the bytes are written (into the page cache)
before the SQLite row that points at them commits, so a committed row never
points at missing bytes, and bytes without a row are garbage. A segment file
is deleted once it is no longer the active one and no row points into it.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

SEGMENT_BYTES = 256 << 20
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def _writev_all(fd: int, parts: list) -> None:
    """writev until every byte of `parts` is written (a regular file rarely writes short)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class BlobLog:
    def __init__(self, directory: str | Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.live: Counter[int] = Counter()
        existing = sorted(int(p.stem) for p in self.dir.glob("*.seg"))
        self.active = (existing[-1] + 1) if existing else 0
        self._fd = self._open(self.active)
        self._size = 0
        self._readers: dict[int, int] = {}

    def _path(self, segment: int) -> Path:
        return self.dir / f"{segment:08d}.seg"

    def _open(self, segment: int) -> int:
        return os.open(self._path(segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, data: bytes) -> tuple[int, int, int]:
        """Writes `data`; returns (segment, offset, length) to store with the row."""
        return self.append_parts([data])

    def append_parts(self, parts: list) -> tuple[int, int, int]:
        """Writes the concatenation of `parts` (bytes-like) without building it in memory:
        one `writev` per IOV_MAX parts. Returns (segment, offset, length) like `append`."""
        length = sum(len(p) for p in parts)
        if self._size and self._size + length > self.segment_bytes:
            os.close(self._fd)
            self.active += 1
            self._fd = self._open(self.active)
            self._size = 0
        offset = self._size
        for start in range(0, len(parts), IOV_MAX):
            _writev_all(self._fd, parts[start : start + IOV_MAX])
        self._size += length
        self.live[self.active] += 1
        return self.active, offset, length

    def read(self, segment: int, offset: int, length: int) -> bytes:
        fd = self._readers.get(segment)
        if fd is None:
            fd = self._readers[segment] = os.open(self._path(segment), os.O_RDONLY)
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(f"segment {segment}: short read at {offset} ({len(data)}/{length})")
        return data

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
        for p in self.dir.glob("*.seg"):
            seg = int(p.stem)
            if seg != self.active and self.live[seg] <= 0:
                self._drop(seg)

    def _drop(self, segment: int) -> None:
        fd = self._readers.pop(segment, None)
        if fd is not None:
            os.close(fd)
        self._path(segment).unlink(missing_ok=True)

    def close(self) -> None:
        os.close(self._fd)
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
