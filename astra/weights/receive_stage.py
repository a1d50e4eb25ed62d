"""A fetch in progress on the receiver: each tensor written once, where it will stay.

A large tensor is staged as a complete single-tensor shard (its header,
Adler-32 included, is known from the TensorHeader): raw chunks are written
at their final offsets as they arrive; xor+zstd tensors are collected
(their frames are small) and decoded against the base straight into the
shard. Either way the Adler-32 of the new bytes is checked before the
tensor is recorded in tensors.jsonl; only recorded tensors are skipped when
a later attempt resumes. Installing links the shards into the version
directory (astra.weights.local): nothing is rewritten or hashed again.
Staged tensors are target bytes whatever the plan was, so a resume with
another base still uses them.

A small tensor (under INLINE_BYTES, up to `ram_bytes` in all) is held in
RAM once verified and written at install with the others as one shard, each
Adler-32 in its header (`pack`): a file, an fsync and a manifest line per
norm or bias cost more than its bytes. Held in RAM, it is not recorded: an
interrupted fetch's next attempt receives it again. Thread-safe across
tensors (each tensor's writes come in order from one thread); never touches
gRPC.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astra.errors import DataLoss
from astra.weights.checksum import adler32, adler32_hex, format_adler32, is_adler32_hex
from astra.weights.delta import DeltaError, decode_xor_zstd_into, decode_xor_zstd_to_writer
from astra.weights.layout import ChecksumMismatch, Version
from astra.weights.records import disk_full
from astra.weights.safetensors_io import FormatError, tensor_nbytes
from astra.weights.tensor_files import (
    ALIGN,
    INLINE_BYTES,
    ShardWriter,
    read_range,
    tensor_header,
    write_packed_shard,
)

MANIFEST = "tensors.jsonl"
LAYOUT = "tensor-shard"  # manifest entries of this layout are complete single-tensor shards
PACKED = "packed.safetensors"  # the small tensors held in RAM, written at install (`pack`)
PACKED_LAYOUT = "packed"  # in `entries` only: never in the manifest
RAM_STAGE_BYTES = 64 << 20  # small tensors a fetch holds in RAM at most
_FILE = re.compile(r"t-(\d+)\.safetensors")


def checked_adler32(name: str, value: int, expected: str, abort: Callable[[], None]) -> str:
    """The received bytes' Adler-32 as hex; a mismatch aborts the tensor and raises."""
    got = format_adler32(value)
    if got != expected:
        abort()
        raise ChecksumMismatch(
            f"received bytes hash to {got}, the header says {expected}", path=None, tensor=name
        )
    return got


def checked_sizes(header: dict[str, Any]) -> tuple[int, int]:
    """(size, encoded size) of a received TensorHeader, FormatError naming the tensor if bad."""
    name = header["name"]
    if header["encoding"] not in ("raw", "xor_zstd"):
        raise FormatError(f"unknown encoding {header['encoding']!r}", tensor=name)
    size = tensor_nbytes(header["dtype"], header["shape"])
    if size != header["size_bytes"]:
        raise FormatError(f"header size {header['size_bytes']} != {size}", tensor=name)
    if not is_adler32_hex(header["adler32"]):
        raise FormatError(f"adler32 {header['adler32']!r} is malformed", tensor=name)
    return size, header["encoded_size_bytes"]


def checked_base(base: Version, name: str) -> str:
    """A held version's tensor's Adler-32, computed from its bytes on disk; ChecksumMismatch
    naming the version and the tensor when it differs from the one recorded (bit rot)."""
    entry = base.entries[name]
    pieces = read_range(
        entry.shard.path, entry.shard.data_start + entry.info.begin, entry.info.nbytes
    )
    value = 1
    try:
        for piece in pieces:
            value = adler32(piece, value)
    finally:
        pieces.close()
    return _as_recorded(base, name, format_adler32(value))


def checked_base_bytes(base: Version, name: str) -> tuple[bytes, str]:
    """A small held tensor's bytes and their Adler-32, read through the page cache and
    checked against the recorded one as `checked_base` does."""
    entry = base.entries[name]
    at = entry.shard.data_start + entry.info.begin
    data = read_small(entry.shard.path, at, entry.info.nbytes)
    return data, _as_recorded(base, name, adler32_hex(data))


def _as_recorded(base: Version, name: str, got: str) -> str:
    """`got`, or ChecksumMismatch naming the version and the tensor when the Adler-32
    recorded in its shard differs (bit rot)."""
    recorded = base.entries[name].checksum
    if recorded is not None and got != recorded:
        raise ChecksumMismatch(
            f"base bytes hash to {got}, its shard says {recorded}", path=base.path, tensor=name
        )
    return got


def read_small(path: Path, offset: int, size: int) -> bytes:
    """A small range of a file, read through the page cache (OSError if it ends early)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    if len(data) != size:
        raise OSError(errno.EIO, f"{path}: ends before byte {offset + size}")
    return data


class Incoming:
    """One tensor's bytes arriving in order; `finish` verifies, syncs and records it.

    `queue` (cheap, on the reader) checks each chunk's place; `write` and
    `finish` may run on worker threads, `write`s in order.
    """

    def __init__(self, stage: FetchStage, header: dict[str, Any], base: Version | None) -> None:
        self.stage, self.h, self.base = stage, header, base
        self.name = header["name"]
        size, self.encoded = checked_sizes(header)
        self.size = size
        self._frame = bytearray() if header["encoding"] == "xor_zstd" else None
        if self._frame is not None:
            entry = base.entries.get(self.name) if base is not None else None
            if entry is None or (entry.info.dtype, list(entry.info.shape)) != (
                header["dtype"],
                list(header["shape"]),
            ):
                raise FormatError(
                    "delta tensor does not fit the base (wrong base)", tensor=self.name
                )
        elif self.encoded != size:
            raise FormatError(
                f"raw tensor of {size} bytes sent as {self.encoded}", tensor=self.name
            )
        self.queued = self.received = 0
        self._adler = 1
        self._out: ShardWriter | None = None
        # Held in RAM (`FetchStage.pack`): a raw tensor's bytes as they come, a delta's decoded
        # at `finish`. None: staged in a shard file of its own.
        self._ram: bytearray | None = None
        self.file: str | None = None
        self._part: Path | None = None
        if max(size, self.encoded) < INLINE_BYTES and stage.reserve_ram(size):
            self._ram = bytearray()
            return
        head = tensor_header(
            self.name, header["dtype"], header["shape"], size, header["adler32"], align=ALIGN
        )
        self.file = stage.next_file()
        self._part = stage.path / (self.file + ".part")
        try:
            self._out = ShardWriter(self._part, head, size, direct=stage.direct)
        except OSError as exc:
            self.abort()
            raise disk_full(exc, f"cannot stage {self.name}") from exc

    @property
    def syncs(self) -> bool:
        """Finishing fsyncs a file (a durable stage's tensor that is not held in RAM)."""
        return self.stage.durable and self._ram is None

    @property
    def complete(self) -> bool:
        """Every chunk queued (the reader's view; writes may still be in flight)."""
        return self.queued == self.encoded

    def queue(self, offset: int, nbytes: int) -> None:
        """Checks a chunk's place before it is handed to `write`."""
        if offset != self.queued or self.queued + nbytes > self.encoded:
            raise DataLoss(
                f"{self.name}: chunk at {offset} (+{nbytes}) after {self.queued} of {self.encoded}",
                reason="BAD_CHUNK",
                metadata={"tensor": self.name},
            )
        self.queued += nbytes

    def write(self, offset: int, data: bytes) -> None:
        if offset != self.received or self.received + len(data) > self.encoded:
            raise DataLoss(
                f"{self.name}: chunk at {offset} (+{len(data)}) after {self.received} of {self.encoded}",
                reason="BAD_CHUNK",
                metadata={"tensor": self.name},
            )
        if self._frame is not None:
            self._frame += data
        elif self._ram is not None:
            self._adler = adler32(data, self._adler)
            self._ram += data
        else:
            self._adler = adler32(data, self._adler)
            try:
                self._out.write(data)
            except OSError as exc:
                raise disk_full(exc, f"cannot stage {self.name}") from exc
        self.received += len(data)

    def finish(self) -> None:
        if self.received != self.encoded:
            raise DataLoss(
                f"{self.name}: {self.received} of {self.encoded} bytes",
                reason="TRUNCATED_TENSOR",
                metadata={"tensor": self.name},
            )
        try:
            if self._frame is not None and self.size:
                entry = self.base.entries[self.name]
                at = entry.shard.data_start + entry.info.begin
                if self._ram is not None:
                    old = read_small(entry.shard.path, at, self.size)
                    self._ram = bytearray(self.size)
                    self._adler = decode_xor_zstd_into(bytes(self._frame), old, self._ram)
                else:
                    pieces = read_range(entry.shard.path, at, self.size)
                    try:
                        self._adler = decode_xor_zstd_to_writer(
                            bytes(self._frame), pieces, self.size, self._out
                        )
                    finally:
                        pieces.close()
        except (DeltaError, ValueError) as exc:
            self.abort()
            raise FormatError(str(exc), tensor=self.name, reason="CORRUPT_DELTA") from exc
        except OSError as exc:
            self.abort()
            raise disk_full(exc, f"cannot stage {self.name}") from exc
        decoded, self._frame = self._frame is not None and self.size > 0, None
        try:
            checked_adler32(self.name, self._adler, self.h["adler32"], self.abort)
        except DataLoss:
            if decoded:  # a base that rotted is ours, not the sender's: name the base
                checked_base(self.base, self.name)
            raise
        entry = {k: self.h[k] for k in ("dtype", "shape", "adler32", "size_bytes")}
        if self._ram is not None:
            self.stage.hold(self.name, entry, bytes(self._ram))
            self._ram = None  # the stage's now (`abort` no longer gives its room back)
            return
        try:
            self._out.close(durable=self.stage.durable)
        except OSError as exc:
            self.abort()
            raise disk_full(exc, f"cannot stage {self.name}") from exc
        self._out = None
        os.replace(self._part, self.stage.path / self.file)
        entry.update(file=self.file, layout=LAYOUT)
        self.stage.record(self.name, entry)

    def abort(self) -> None:
        """Drops an unfinished tensor (a no-op once finished)."""
        self._frame = None
        if self._ram is not None:
            self._ram = None
            self.stage.release_ram(self.size)
            return
        if self._out is not None:
            self._out.abort()
            self._out = None
        if self._part is not None:
            self._part.unlink(missing_ok=True)


class FetchStage:
    """The staged tensors and files of one target version."""

    def __init__(
        self,
        path: Path,
        target: str,
        *,
        durable: bool = True,
        direct: bool = True,
        ram_bytes: int = RAM_STAGE_BYTES,
    ) -> None:
        self.path, self.target, self.durable, self.direct = path, target, durable, direct
        self.entries: dict[str, dict[str, Any]] = {}
        # Small tensors verified and held in RAM until `pack` (name -> (entry, bytes)).
        self.in_ram: dict[str, tuple[dict[str, Any], bytes]] = {}
        self._ram_free = ram_bytes
        (path / "files").mkdir(parents=True, exist_ok=True)
        for part in path.glob("*.part"):
            part.unlink()
        if (path / MANIFEST).is_file():
            for line in (path / MANIFEST).read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    break  # a torn last line
                if entry.get("layout") == LAYOUT and (path / entry["file"]).is_file():
                    self.entries[entry["name"]] = entry
        used = [int(m.group(1)) for p in path.iterdir() if (m := _FILE.fullmatch(p.name))]
        self._next = max(used, default=-1) + 1
        self._lock = threading.Lock()  # guards _next, _pending, _queued, entries
        self._write_lock = threading.Lock()  # one manifest append at a time
        self._pending: list[str] = []
        self._queued = self._written = 0

    @property
    def acknowledged(self) -> list[str]:
        """The tensors staged on disk by an earlier attempt (a new stage's `entries`)."""
        return sorted(self.entries)

    def next_file(self) -> str:
        with self._lock:
            index, self._next = self._next, self._next + 1
        return f"t-{index:06d}.safetensors"

    def receive(self, header: dict[str, Any], base: Version | None) -> Incoming:
        return Incoming(self, header, base)

    def reserve_ram(self, nbytes: int) -> bool:
        """Room in RAM for a small tensor, if `ram_bytes` has it (given back by `release_ram`
        unless the tensor is then held)."""
        with self._lock:
            if nbytes > self._ram_free:
                return False
            self._ram_free -= nbytes
            return True

    def release_ram(self, nbytes: int) -> None:
        with self._lock:
            self._ram_free += nbytes

    def hold(self, name: str, entry: dict[str, Any], data: bytes) -> None:
        """Keeps a verified small tensor in RAM until `pack` (not in the manifest)."""
        with self._lock:
            old = self.in_ram.pop(name, None)
            if old is not None:
                self._ram_free += len(old[1])
            self.in_ram[name] = (entry, data)

    def pack(self) -> None:
        """Writes the tensors held in RAM as one shard (fsynced when durable), each Adler-32 in
        its header; from here on they are staged tensors like the others, of this stage only
        (the manifest does not name them: a later attempt receives them again)."""
        with self._lock:
            ram, self.in_ram = self.in_ram, {}
        if not ram:
            return
        names = sorted(ram)
        tensors = [
            (n, ram[n][0]["dtype"], ram[n][0]["shape"], ram[n][1], ram[n][0]["adler32"])
            for n in names
        ]
        try:
            write_packed_shard(self.path / PACKED, tensors, durable=self.durable)
        except OSError as exc:
            raise disk_full(exc, f"cannot stage the small tensors of {self.target!r}") from exc
        with self._lock:
            for name in names:
                self.entries[name] = {**ram[name][0], "file": PACKED, "layout": PACKED_LAYOUT}

    def record(self, name: str, entry: dict[str, Any]) -> None:
        """Appends the tensor to the manifest; concurrent records share one fsync (group commit)."""
        with self._lock:
            self._pending.append(json.dumps({**entry, "name": name}) + "\n")
            self._queued += 1
            mine = self._queued
        with self._write_lock:
            if self._written < mine:
                with self._lock:
                    batch, self._pending, upto = self._pending, [], self._queued
                with open(self.path / MANIFEST, "a") as f:
                    f.write("".join(batch))
                    if self.durable:
                        f.flush()
                        os.fsync(f.fileno())
                self._written = upto
        with self._lock:
            self.entries[name] = entry

    def add_file(self, name: str, content: bytes) -> None:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise DataLoss(f"file name {name!r} is not allowed", reason="INVALID_FILE")
        (self.path / "files" / name).write_bytes(content)

    def files(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted((self.path / "files").iterdir())}

    def shard(self, name: str) -> Path:
        """The staged single-tensor shard of a recorded tensor."""
        return self.path / self.entries[name]["file"]

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
