"""A fetch in progress on the receiver: each tensor decoded, verified and recorded as it lands.

Raw tensors are written to a file as their chunks arrive; xor+zstd tensors
are collected (their frames are small) and decoded against the base straight
into a mapped file. Either way the Adler-32 of the new bytes is checked
before the tensor is recorded in tensors.jsonl; only recorded tensors are
acknowledged and skipped on resume. Staged tensors are target bytes whatever
the plan was, so a resume with another base still uses them. Never touches
gRPC.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
from pathlib import Path
from typing import Any

from astra.errors import DataLoss
from astra.weights.checksum import adler32, format_adler32
from astra.weights.delta import DeltaError, decode_xor_zstd_into
from astra.weights.layout import ChecksumMismatch, Tensor, Version
from astra.weights.safetensors_io import FormatError, tensor_nbytes

MANIFEST = "tensors.jsonl"


class Incoming:
    """One tensor's bytes arriving in order; `finish` verifies and records it."""

    def __init__(self, stage: FetchStage, header: dict[str, Any], base: Version | None) -> None:
        self.stage, self.h, self.base = stage, header, base
        self.name = header["name"]
        if header["encoding"] not in ("raw", "xor_zstd"):
            raise FormatError(f"unknown encoding {header['encoding']!r}", tensor=self.name)
        size = tensor_nbytes(header["dtype"], header["shape"])
        if size != header["size_bytes"]:
            raise FormatError(f"header size {header['size_bytes']} != {size}", tensor=self.name)
        self.encoded = header["encoded_size_bytes"]
        self.received, self._adler = 0, 1
        self.file = f"t-{len(stage.entries):06d}.bin"
        self._part = stage.path / (self.file + ".part")
        self._out = open(self._part, "w+b")  # noqa: SIM115
        self._frame = bytearray() if header["encoding"] == "xor_zstd" else None
        if self._frame is not None:
            entry = base.entries.get(self.name) if base is not None else None
            if entry is None or (entry.info.dtype, list(entry.info.shape)) != (
                header["dtype"],
                list(header["shape"]),
            ):
                self.abort()
                raise FormatError(
                    "delta tensor does not fit the base (wrong base)", tensor=self.name
                )

    @property
    def complete(self) -> bool:
        return self.received == self.encoded

    def write(self, offset: int, data: bytes) -> None:
        if offset != self.received or self.received + len(data) > self.encoded:
            raise DataLoss(
                f"{self.name}: chunk at {offset} (+{len(data)}) after {self.received} of {self.encoded}",
                reason="BAD_CHUNK",
                metadata={"tensor": self.name},
            )
        if self._frame is not None:
            self._frame += data
        else:
            self._out.write(data)
            self._adler = adler32(data, self._adler)
        self.received += len(data)

    def finish(self) -> None:
        size = self.h["size_bytes"]
        try:
            if self._frame is not None:
                self._out.truncate(size)
                self._out.flush()
                if size:
                    self._adler = self._decode(size)
        except DeltaError as exc:
            self.abort()
            raise FormatError(str(exc), tensor=self.name, reason="CORRUPT_DELTA") from exc
        got = format_adler32(self._adler)
        if got != self.h["adler32"]:
            self.abort()
            raise ChecksumMismatch(
                f"received bytes hash to {got}, the header says {self.h['adler32']}",
                path=None,
                tensor=self.name,
            )
        if self.stage.durable:
            os.fsync(self._out.fileno())
        self._out.close()
        os.replace(self._part, self.stage.path / self.file)
        self.stage.record(self.name, {**self.h, "file": self.file})

    def _decode(self, size: int) -> int:
        """Decodes the frame against the base straight into the mapped output file."""
        mm = mmap.mmap(self._out.fileno(), size)
        view = self.base.view(self.name)
        try:
            value = decode_xor_zstd_into(bytes(self._frame), view, mm)
            mm.flush()
            return value
        finally:
            view.release()
            with contextlib.suppress(BufferError):  # a failed decode's traceback may hold a view
                mm.close()

    def abort(self) -> None:
        self._out.close()
        self._part.unlink(missing_ok=True)


class FetchStage:
    """The staged tensors and files of one target version."""

    def __init__(self, path: Path, target: str, *, durable: bool = True) -> None:
        self.path, self.target, self.durable = path, target, durable
        self.entries: dict[str, dict[str, Any]] = {}
        (path / "files").mkdir(parents=True, exist_ok=True)
        for part in path.glob("*.part"):
            part.unlink()
        if (path / MANIFEST).is_file():
            for line in (path / MANIFEST).read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    break  # a torn last line
                if (path / entry["file"]).is_file():
                    self.entries[entry["name"]] = entry

    @property
    def acknowledged(self) -> list[str]:
        return sorted(self.entries)

    def receive(self, header: dict[str, Any], base: Version | None) -> Incoming:
        return Incoming(self, header, base)

    def record(self, name: str, entry: dict[str, Any]) -> None:
        with open(self.path / MANIFEST, "a") as f:
            f.write(json.dumps({**entry, "name": name}) + "\n")
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        self.entries[name] = entry

    def add_file(self, name: str, content: bytes) -> None:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise DataLoss(f"file name {name!r} is not allowed", reason="INVALID_FILE")
        (self.path / "files" / name).write_bytes(content)

    def files(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted((self.path / "files").iterdir())}

    def tensors(self) -> dict[str, Tensor]:
        out = {}
        for name, e in self.entries.items():
            data: Any = b""
            if e["size_bytes"]:
                with open(self.path / e["file"], "rb") as f:
                    data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            out[name] = Tensor(e["dtype"], tuple(e["shape"]), data)
        return out

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
