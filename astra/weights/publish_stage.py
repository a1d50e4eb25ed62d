"""The staged tensors of one in-progress publish, kept across restarts so a publish resumes.

A stage is a directory per identity: header.json (what is being published),
one single-tensor shard per verified tensor (header, its Adler-32
included, then the bytes) and tensors.jsonl, a line per tensor
appended only after its file is complete, checked and (when durable)
fsynced. Small tensors (below INLINE_BYTES, up to `ram_bytes` in all) are
held in RAM instead and written together, at the commit, as one shard
(packed.bin, each tensor's Adler-32 in its header): a file, an fsync and a
manifest line each cost more than such a tensor, and an interrupted
publish sends them again. Each tensor arrives through a TensorSink
(astra.weights.publish_sink), which hashes it and computes (or decodes) its xor+zstd frame against the base
in the same pass, so nothing is read or encoded twice: the commit writes those
frames as the version's delta. Shards are written with
O_DIRECT where the file system allows (astra.weights.tensor_files). A stage
for an identity that already exists only compares (nothing is written).
Never touches gRPC.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from astra.durable import fsync_path, make_dirs
from astra.errors import AlreadyExists
from astra.weights.delta import XorZstdEncoder
from astra.weights.hot import BufferCursor, HotBuilder, HotVersion
from astra.weights.layout import Tensor, Version
from astra.weights.publish_sink import TensorSink
from astra.weights.records import TensorRecord, disk_full
from astra.weights.tensor_files import (
    BUFFERS,
    RangeCursor,
    read_range,
    write_packed_shard,
)

_SYNCERS = ThreadPoolExecutor(4, thread_name_prefix="publish-sync")
MANIFEST = "tensors.jsonl"
HEADER = "header.json"
PACKED = "packed.bin"  # the small tensors held in RAM, written at the commit


def content_mismatch(identity: str, detail: str, tensor: str | None = None) -> AlreadyExists:
    meta = {"identity": identity, **({"tensor": tensor} if tensor else {})}
    return AlreadyExists(
        f"identity {identity!r} exists with other content: {detail}",
        reason="VERSION_CONTENT_MISMATCH",
        metadata=meta,
    )


class PublishStage:
    """Staged tensors of one identity. `expected` set: the identity exists; compare only."""

    def __init__(
        self,
        path: Path,
        header: dict[str, Any],
        *,
        expected: dict[str, TensorRecord] | None = None,
        durable: bool = True,
        base: Version | None = None,
        base_identity: str = "",
        level: int = 1,
        hot_base: HotVersion | None = None,
        hot_new: HotBuilder | None = None,
        restart: bool = False,
        ram_bytes: int = 0,
    ) -> None:
        """restart: drop what an earlier attempt staged here instead of resuming it.
        ram_bytes: the most bytes of small tensors held in RAM until the commit (0: none)."""
        self.path, self.header, self.expected, self.durable = path, header, expected, durable
        # The version the frames are encoded against (the current one when the stage opened),
        # read from RAM when the store holds it there (hot_base); hot_new collects the new bytes.
        self.base, self.base_identity, self.level = base, base_identity, level
        self.hot_base, self.hot_new = hot_base, hot_new
        # A sender's frame decoded against the base failed its checksum: the sender's copy of
        # the base or ours differs, and ours (the RAM copy) is not trusted any more.
        self.base_suspect = False
        # xor+zstd frame against the base and Adler-32 of each tensor received in this
        # session (None: identical to the base); tensors held from an earlier session have none.
        self.frames: dict[str, tuple[bytes, int] | None] = {}
        self.lock = threading.Lock()  # tensors of one stage may be received on several threads
        self._next = 0
        self._pending: list[Future[None]] = []
        self.held: dict[str, tuple[str, TensorRecord]] = {}
        self.received: dict[str, tuple[str, TensorRecord]] = {}
        self.files: dict[str, bytes] = {}
        self.offsets: dict[str, int] = {}  # where each staged tensor's bytes start (0: bare bytes)
        self.ram_bytes = ram_bytes
        self.in_ram: dict[str, bytearray] = {}  # small tensors accepted, until `pack`
        self._ram_reserved = 0
        if expected is not None:
            return
        if not restart and path.is_dir() and self._read_header() == header:
            self._load()
        else:
            shutil.rmtree(path, ignore_errors=True)
            make_dirs(path, durable=durable)
            (path / HEADER).write_text(json.dumps(header, sort_keys=True))
            if durable:
                fsync_path(path)

    def _read_header(self) -> Any:
        try:
            return json.loads((self.path / HEADER).read_text())
        except (OSError, ValueError):
            return None

    def _load(self) -> None:
        for part in self.path.glob("*.part"):
            part.unlink()
        lines = (self.path / MANIFEST).read_text().splitlines() if self._has_manifest() else []
        for line in lines:
            try:
                e = json.loads(line)
                rec = TensorRecord.from_json(e)
            except (ValueError, KeyError, TypeError):
                break  # a torn last line: everything before it is complete
            if (self.path / e["file"]).is_file():
                self.held[e["name"]] = (e["file"], rec)
                self.offsets[e["name"]] = e.get("offset", 0)
        used = [int(p.stem[2:]) for p in self.path.glob("t-*.bin") if p.stem[2:].isdigit()]
        self._next = max(used, default=-1) + 1

    def _has_manifest(self) -> bool:
        return (self.path / MANIFEST).is_file()

    def begin_tensor(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        adler: str | None,
        *,
        encoded: int | None = None,
    ) -> TensorSink:
        if self.expected is not None:
            want = self.expected.get(name)
            if want is None or (want.dtype, want.shape) != (dtype, tuple(shape)):
                raise content_mismatch(self.header["identity"], "tensors differ", name)
        return TensorSink(self, name, dtype, tuple(shape), adler, encoded)

    def _held(self, name: str, size: int) -> Any:
        """The base tensor's bytes in the store's RAM copy, None when not held there."""
        return self.hot_base.get(name, size) if self.hot_base is not None else None

    def base_bytes(self, name: str, size: int) -> Any:
        """The base tensor's bytes as consecutive pieces (RAM when held there, else its file)."""
        held = self._held(name, size)
        if held is not None:
            return iter([held])
        entry = self.base.entries[name]
        return read_range(entry.shard.path, entry.shard.data_start + entry.info.begin, size)

    def hot_version(self, identity: str, records: dict[str, TensorRecord]) -> HotVersion | None:
        """The new version's bytes in RAM when every tensor passed through this stage."""
        return self.hot_new.finish(identity, records) if self.hot_new is not None else None

    def encoder(
        self, name: str, dtype: str, shape: tuple[int, ...], size: int
    ) -> XorZstdEncoder | None:
        """An encoder of the tensor against the base's, None when the base has no such tensor."""
        entry = self.base.entries.get(name) if self.base is not None else None
        if entry is None or (entry.info.dtype, entry.info.shape) != (dtype, shape) or not size:
            return None
        held = self._held(name, size)
        # The base's bytes (its RAM copy, or its file) are checked against what its file
        # records: a frame against damaged bytes is never made (DeltaError: the commit
        # encodes again, checking, and stores the version full if the file is damaged).
        check = entry.checksum
        if held is not None and check is not None:
            cursor: Any = BufferCursor(held)
        else:
            cursor = RangeCursor(entry.shard.path, entry.shard.data_start + entry.info.begin, size)
        scratch = BUFFERS.get()
        return XorZstdEncoder(
            cursor, size, self.level, scratch, lambda: BUFFERS.put(scratch), check=check
        )

    def reserve_ram(self, size: int) -> bool:
        """Whether a small tensor of `size` bytes is held in RAM (counted until the commit)."""
        with self.lock:
            if self.expected is not None or self._ram_reserved + size > self.ram_bytes:
                return False
            self._ram_reserved += size
            return True

    def release_ram(self, size: int) -> None:
        with self.lock:
            self._ram_reserved -= size

    def next_file(self) -> str:
        with self.lock:
            index, self._next = self._next, self._next + 1
        return f"t-{index:06d}.bin"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.flush()
        if self.hot_new is not None:
            self.hot_new.close()
        self.hot_base = None
        if self.base is not None:
            self.base.close()
            self.base = None

    def accept(self, sink: TensorSink, record: TensorRecord) -> None:
        """Holds a verified tensor; it is made durable and listed in the manifest in the background.

        A manifest line is appended only once its shard is synced, so a restart
        holds only complete shards; a line lost in a crash only means the
        tensor is sent again. `flush` waits for all of them (the commit does).
        """
        if self.expected is not None:
            if self.expected[sink.name] != record:
                raise content_mismatch(self.header["identity"], "tensor bytes differ", sink.name)
            with self.lock:
                self.received[sink.name] = ("", record)
            return
        sink.close_file()
        if sink.ram is not None:  # written with the other small ones by `pack`
            with self.lock:
                self.in_ram[sink.name] = sink.ram
                self.received[sink.name] = ("", record)
            return
        line = {"name": sink.name, "file": sink.file, "size": record.size_bytes}
        line["offset"] = sink.offset
        line.update(dtype=record.dtype, shape=list(record.shape))
        line.update(adler32=record.adler32, digest=record.digest)
        with self.lock:
            self.received[sink.name] = (sink.file, record)
            self.offsets[sink.name] = sink.offset
            sink.synced = _SYNCERS.submit(self._record, sink.file, json.dumps(line))
            self._pending.append(sink.synced)

    def _record(self, file: str, line: str) -> None:
        if self.durable:
            fsync_path(self.path / file)  # concurrent syncs share journal commits
        with self.lock, open(self.path / MANIFEST, "a") as f:
            f.write(line + "\n")

    def flush(self) -> None:
        """Until every accepted tensor is durable and in the manifest; raises the first failure."""
        while True:
            with self.lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
            for future in pending:
                future.result()

    def pack(self) -> None:
        """Writes the small tensors held in RAM as one shard (fsynced when durable), each with
        its Adler-32 in the header; from here on they are read from it like the others."""
        with self.lock:
            ram, self.in_ram = self.in_ram, {}
        if not ram:
            return
        names = sorted(ram)
        records = {n: self.received[n][1] for n in names}
        tensors = [
            (n, records[n].dtype, records[n].shape, ram[n], records[n].adler32) for n in names
        ]
        try:
            at = write_packed_shard(self.path / PACKED, tensors, durable=self.durable)
        except OSError as exc:
            with self.lock:  # sent again by the next attempt, as after an interruption
                for name in names:
                    self.received.pop(name, None)
            raise disk_full(exc, f"cannot stage {self.header['identity']!r}") from exc
        with self.lock:
            for name in names:
                self.received[name] = (PACKED, records[name])
                self.offsets[name] = at
                at += len(ram[name])

    def records(self) -> dict[str, TensorRecord]:
        return {n: r for n, (_, r) in (self.held | self.received).items()}

    def tensors(self) -> dict[str, Tensor]:
        """Zero-copy views of every staged tensor (mmap); valid while referenced."""
        out = {}
        maps: dict[str, mmap.mmap] = {}  # one mapping per file (the packed one holds several)
        for name, (file, rec) in sorted((self.held | self.received).items()):
            if rec.size_bytes == 0:
                out[name] = Tensor(rec.dtype, rec.shape, b"")
                continue
            if name in self.in_ram:
                out[name] = Tensor(rec.dtype, rec.shape, memoryview(self.in_ram[name]))
                continue
            mm = maps.get(file)
            if mm is None:
                with open(self.path / file, "rb") as f:
                    mm = maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            start = self.offsets.get(name, 0)
            out[name] = Tensor(rec.dtype, rec.shape, memoryview(mm)[start : start + rec.size_bytes])
        return out

    def shards(self) -> dict[str, Path] | None:
        """Every staged tensor's shard file (single-tensor, or the packed small ones), None
        when any is bare bytes or still in RAM (call `pack` first)."""
        staged = self.held | self.received
        if self.expected is not None or self.in_ram:
            return None
        if any(not self.offsets.get(n) for n in staged):
            return None
        return {name: self.path / file for name, (file, _) in staged.items()}

    def remove(self) -> None:
        if self.expected is None:
            shutil.rmtree(self.path, ignore_errors=True)
