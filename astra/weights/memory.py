"""A receiver's versions held in memory, for a process that serves them from RAM (an engine).

The same roles as astra.weights.local, without a disk round trip: a fetch
stages each tensor in a fresh buffer (raw chunks copied in at their offsets;
an xor+zstd frame decoded against the held base's bytes), checks the
Adler-32 of the new bytes before the tensor counts as received, and keeps
the staged tensors across attempts, so a fetch resumes after the last
acknowledged tensor. `install` builds the new version from the staged
tensors plus the base's unchanged ones (shared, never copied: buffers are
never written once a version holds them) and replaces `current` in one
reference assignment, so a reader holds the old version or the new, never a
mix. Nothing survives the process: a restarted receiver fetches a full copy.

Buffers are reused: a tensor buffer of a pruned version that nothing else
references any more (no reader holds the version, the tensor or its bytes:
checked by reference count) goes to a pool the next fetch allocates from,
so steady-state deltas write into memory that is already faulted in instead
of asking the kernel for a fresh zeroed gigabyte per version (on a VM a
first touch costs more than the decode). Never touches gRPC.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astra.errors import DataLoss
from astra.weights.checksum import adler32
from astra.weights.delta import DeltaError, decode_xor_zstd_into
from astra.weights.pool import BufferPool
from astra.weights.receive_stage import checked_adler32, checked_sizes
from astra.weights.safetensors_io import FormatError


@dataclass(frozen=True)
class HeldTensor:
    """One verified tensor: safetensors dtype name, shape, raw bytes (uint8), Adler-32 hex."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    adler32: str


@dataclass(frozen=True)
class MemoryVersion(Mapping[str, HeldTensor]):
    """A verified version in memory; read as a mapping tensor name -> HeldTensor."""

    identity: str
    version: int
    tensors: Mapping[str, HeldTensor]
    files: Mapping[str, bytes] = field(default_factory=dict)

    def __getitem__(self, name: str) -> HeldTensor:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    @property
    def nbytes(self) -> int:
        return sum(t.data.nbytes for t in self.tensors.values())

    def close(self) -> None:
        """Nothing to release (the same call as a disk version opened as a base)."""


class MemoryIncoming:
    """One tensor arriving in order; `finish` decodes it if needed and checks its Adler-32."""

    syncs = False  # finishing writes nothing to disk (astra.clients.weights_pipeline)

    def __init__(
        self, stage: MemoryStage, header: dict[str, Any], base: MemoryVersion | None
    ) -> None:
        self.stage, self.h, self.name = stage, header, header["name"]
        size, self.encoded = checked_sizes(header)
        self.size = size
        self.base: HeldTensor | None = None
        self._frame: bytearray | None = None
        if header["encoding"] == "xor_zstd":
            held = base.tensors.get(self.name) if base is not None else None
            if held is None or (held.dtype, list(held.shape)) != (
                header["dtype"],
                list(header["shape"]),
            ):
                raise FormatError(
                    "delta tensor does not fit the base (wrong base)", tensor=self.name
                )
            self.base, self._frame = held, bytearray()
        elif self.encoded != size:
            raise FormatError(
                f"raw tensor of {size} bytes sent as {self.encoded}", tensor=self.name
            )
        self.out: np.ndarray | None = stage.alloc(size)
        self.queued = self.received = 0
        self._adler = 1

    @property
    def complete(self) -> bool:
        return self.queued == self.encoded

    def _bad_chunk(self, offset: int, nbytes: int, after: int) -> DataLoss:
        return DataLoss(
            f"{self.name}: chunk at {offset} (+{nbytes}) after {after} of {self.encoded}",
            reason="BAD_CHUNK",
            metadata={"tensor": self.name},
        )

    def queue(self, offset: int, nbytes: int) -> None:
        if offset != self.queued or self.queued + nbytes > self.encoded:
            raise self._bad_chunk(offset, nbytes, self.queued)
        self.queued += nbytes

    def write(self, offset: int, data: Any) -> None:
        n = len(data)
        if offset != self.received or self.received + n > self.encoded or self.out is None:
            raise self._bad_chunk(offset, n, self.received)
        if self._frame is not None:
            self._frame += data
        else:
            piece = self.out[offset : offset + n]
            piece[:] = np.frombuffer(data, dtype=np.uint8)
            self._adler = adler32(piece, self._adler)
        self.received += n

    def finish(self) -> None:
        if self.received != self.encoded or self.out is None:
            raise DataLoss(
                f"{self.name}: {self.received} of {self.encoded} bytes",
                reason="TRUNCATED_TENSOR",
                metadata={"tensor": self.name},
            )
        if self._frame is not None:
            try:
                self._adler = (
                    decode_xor_zstd_into(bytes(self._frame), self.base.data, self.out)
                    if self.size
                    else 1
                )
            except DeltaError as exc:
                self.abort()
                raise FormatError(str(exc), tensor=self.name, reason="CORRUPT_DELTA") from exc
            self._frame = None
        got = checked_adler32(self.name, self._adler, self.h["adler32"], self.abort)
        shape = tuple(int(d) for d in self.h["shape"])
        self.stage.record(self.name, HeldTensor(self.h["dtype"], shape, self.out, got))
        self.out = None

    def abort(self) -> None:
        self._frame, self.out = None, None


class MemoryStage:
    """The verified tensors and files of one target version, kept across attempts."""

    def __init__(self, target: str, pool: BufferPool | None = None) -> None:
        self.target, self.pool = target, pool
        self.entries: dict[str, HeldTensor] = {}
        self._files: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def acknowledged(self) -> list[str]:
        with self._lock:
            return sorted(self.entries)

    def alloc(self, size: int) -> np.ndarray:
        """A buffer of `size` bytes: a reused one when the pool has it, else a new one."""
        return self.pool.alloc(size) if self.pool is not None else np.empty(size, np.uint8)

    def receive(self, header: dict[str, Any], base: MemoryVersion | None) -> MemoryIncoming:
        return MemoryIncoming(self, header, base)

    def record(self, name: str, tensor: HeldTensor) -> None:
        with self._lock:
            self.entries[name] = tensor

    def add_file(self, name: str, content: bytes) -> None:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise DataLoss(f"file name {name!r} is not allowed", reason="INVALID_FILE")
        self._files[name] = bytes(content)

    def files(self) -> dict[str, bytes]:
        return dict(sorted(self._files.items()))


def _sole_owner(held: HeldTensor, refs_to_held: int) -> bool:
    """True when nothing but the receiver's own references reaches the tensor or its bytes.

    `refs_to_held` counts the references the caller knows of (the parameter
    and getrefcount's argument add two more). A reader holding the tensor,
    the array, a view of it or an export of its buffer (torch.frombuffer,
    memoryview) raises one of these counts, and the buffer is left alone.
    """
    return sys.getrefcount(held) <= refs_to_held + 2 and sys.getrefcount(held.data) <= 2


class MemoryVersions:
    """The versions one receiver holds in memory: `current` and up to `keep` in all."""

    def __init__(self, receiver_id: str, *, pool_bytes: int | None = None) -> None:
        """pool_bytes: spare buffers kept for reuse (default: as much as the current version)."""
        self.receiver_id = receiver_id
        self.pool_bytes = pool_bytes
        self.pool = BufferPool(pool_bytes or 0)
        self._versions: dict[str, MemoryVersion] = {}
        self._current: MemoryVersion | None = None
        self._stage: MemoryStage | None = None
        self._lock = threading.Lock()

    @property
    def current(self) -> MemoryVersion | None:
        return self._current

    @property
    def current_path(self) -> None:
        return None

    def held(self) -> dict[str, MemoryVersion]:
        with self._lock:
            return dict(self._versions)

    @staticmethod
    def open(handle: MemoryVersion) -> MemoryVersion:
        """A held version as the base of a fetch (already open: it is in memory)."""
        return handle

    def stage(self, target: str) -> MemoryStage:
        """The stage of `target`: the one of an earlier attempt (resume), else a new one."""
        with self._lock:
            if self._stage is None or self._stage.target != target:
                self._stage = MemoryStage(target, self.pool)
            return self._stage

    def install(
        self, stage: MemoryStage, base: MemoryVersion | None, num_tensors: int, *, version: int
    ) -> MemoryVersion:
        """The staged tensors plus the base's unchanged ones, made current in one assignment."""
        with self._lock:
            done = self._versions.get(stage.target)
        if done is not None:
            return self.adopt(done, stage.target)
        staged = dict(stage.entries)
        # A full copy is exactly the plan; a delta at least the plan's changed tensors (what is
        # missing would otherwise be taken from the base: a mix of two versions).
        if len(staged) < num_tensors or (base is None and len(staged) != num_tensors):
            raise DataLoss(
                f"{len(staged)} tensors staged, the plan has {num_tensors}",
                reason="INCOMPLETE_FETCH",
            )
        tensors = dict(base.tensors) if base is not None else {}
        unknown = sorted(set(staged) - set(tensors)) if base is not None else []
        if unknown:
            raise DataLoss(
                f"{unknown[0]}: not in the base {base.identity!r}",
                reason="INCOMPLETE_FETCH",
                metadata={"tensor": unknown[0]},
            )
        tensors.update(staged)
        held = MemoryVersion(stage.target, version, tensors, stage.files())
        return self.adopt(held, stage.target)

    def adopt(self, held: MemoryVersion, identity: str) -> MemoryVersion:
        """Makes a held version current (a fetch of what the receiver already holds)."""
        with self._lock:
            self._versions[identity] = held
            self._current = held
            if self._stage is not None and self._stage.target == identity:
                self._stage = None
        return held

    def prune(self, keep: int = 2) -> list[str]:
        """Drops all but the current version and the newest others, `keep` in all."""
        with self._lock:
            current = self._current
            order = [i for i in self._versions if current is None or i != current.identity]
            dropped = order[: max(0, len(order) - max(0, keep - 1))]
            gone = [self._versions.pop(identity) for identity in dropped]
            if current is not None and self.pool_bytes is None:
                self.pool.max_bytes = current.nbytes
            kept = {id(t) for v in self._versions.values() for t in v.tensors.values()}
            if self._stage is not None:
                kept |= {id(t) for t in self._stage.entries.values()}
        del current
        while gone:
            version = gone.pop()
            # Only this name and getrefcount's argument reach it: no reader holds the version.
            if sys.getrefcount(version) > 2:
                continue
            tensors = dict(version.tensors)
            del version
            for name in list(tensors):
                held = tensors.pop(name)
                # This name only: the dropped version, and its dict, are gone.
                if id(held) not in kept and _sole_owner(held, 1):
                    self.pool.put(held.data)
                del held
        return dropped
