"""Each policy's current version kept in RAM by the store, to encode or decode the next publish.

A publish is encoded (raw tensors: xor+zstd against the current version) or
decoded (a sender's frames against it) tensor by tensor. Read from disk, the
base costs a read of the whole model per publish at disk speed (O_DIRECT:
nothing cached), which dominated a delta publish. While a publish streams,
a `HotBuilder` copies the new bytes into RAM buffers as they pass (reused
from the version before, via a BufferPool); when the publish commits as the
current version they become its `HotVersion`, and the next publish reads its
base from them. A version larger than the budget, one resumed from tensors
staged by an earlier attempt, or one published any other way (a rollback, a
directory) is not held: the next publish reads its base from disk as before.
Buffers go back to the pool only when the HotVersion is unreachable (no
publish still reads it: Python's reference counting decides, through
weakref.finalize). Knows nothing of gRPC, files or formats.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator

import numpy as np

from astra.weights.pool import BufferPool


def _recycle(arrays: dict[str, np.ndarray], pool: BufferPool) -> None:
    for array in arrays.values():
        pool.put(array)
    arrays.clear()


class HotVersion:
    """A committed version's tensors in RAM (name -> uint8 array); never written again."""

    def __init__(self, identity: str, arrays: dict[str, np.ndarray], pool: BufferPool) -> None:
        self.identity, self._arrays = identity, arrays
        self.nbytes = sum(a.nbytes for a in arrays.values())
        weakref.finalize(self, _recycle, arrays, pool)

    def get(self, name: str, size: int) -> np.ndarray | None:
        """The tensor's bytes, None when it is not held or has another size."""
        array = self._arrays.get(name)
        return array if array is not None and array.nbytes == size else None


class HotBuilder:
    """Collects a publish's new tensor bytes as they pass, up to `max_bytes` in all.

    A tensor's buffer is its sink's from `begin` until `end`: when the version
    is dropped meanwhile (it does not fit, a tensor failed), a buffer still in
    use goes back to the pool only at its `end`, so no other publish is handed
    memory a sink still writes, hashes or stages from.
    """

    def __init__(self, pool: BufferPool, max_bytes: int) -> None:
        self.pool, self.max_bytes = pool, max_bytes
        self.arrays: dict[str, np.ndarray] = {}
        self.nbytes, self.dropped = 0, False
        self._busy: dict[str, np.ndarray] = {}  # begun, not ended
        self._lock = threading.Lock()

    def begin(self, name: str, size: int) -> np.ndarray | None:
        """A buffer for the tensor's bytes, None once the version does not fit (then all go)."""
        with self._lock:
            if self.dropped:
                return None
            if self.nbytes + size > self.max_bytes or name in self.arrays:
                self._drop()
                return None
            self.nbytes += size
        array = self.pool.alloc(size)
        with self._lock:
            if self.dropped:
                self.pool.put(array)
                return None
            self.arrays[name] = self._busy[name] = array
        return array

    def end(self, name: str) -> None:
        """The sink is done with the tensor's buffer (finished or failed); a second call is a no-op."""
        with self._lock:
            array = self._busy.pop(name, None)
            if array is not None and self.dropped and self.arrays.get(name) is not array:
                self.pool.put(array)  # its version was dropped while the sink used it

    def forget(self, name: str) -> None:
        """A tensor that failed: the version cannot be held whole any more."""
        with self._lock:
            if name in self.arrays:
                self._drop()

    def _drop(self) -> None:
        self.dropped = True
        for name, array in self.arrays.items():
            if self._busy.get(name) is not array:
                self.pool.put(array)
        self.arrays.clear()  # a busy buffer goes back at its `end`
        self.nbytes = 0

    def finish(self, identity: str, names: Iterable[str]) -> HotVersion | None:
        """The version, when every one of `names` passed through this builder; else None."""
        with self._lock:
            if self.dropped or self.arrays.keys() != set(names):
                self._drop()
                return None
            arrays, self.arrays = self.arrays, {}
            self._busy.clear()  # the version's now, whatever a sink says later
            self.dropped = True  # handed over
        return HotVersion(identity, arrays, self.pool)

    def close(self) -> None:
        """Gives back whatever was not handed over."""
        with self._lock:
            self._drop()


class BufferCursor:
    """A buffer taken front to back in pieces of any size (the shape of tensor_files.RangeCursor)."""

    def __init__(self, data: np.ndarray) -> None:
        self._view, self._at = memoryview(data).cast("B"), 0

    def take(self, n: int) -> Iterator[memoryview]:
        if self._at + n > len(self._view):
            raise ValueError(f"{n} bytes asked, {len(self._view) - self._at} left")
        yield self._view[self._at : self._at + n]
        self._at += n

    def close(self) -> None:
        self._view = memoryview(b"")
