"""The staged tensors of one in-progress publish, kept across restarts so a publish resumes.

A stage is a directory per identity: header.json (what is being published),
one single-tensor shard per verified tensor (header, its Adler-32
included, then the bytes) and tensors.jsonl, a line per tensor
appended only after its file is complete, checked and (when durable)
fsynced. A tensor's bytes arrive in order; their Adler-32 and SHA-256 are
computed as they arrive, and, given a base (the current version), so is the
tensor's xor+zstd frame against it, so nothing is read or encoded twice: the
commit writes those frames as the version's delta. Shards are written with
O_DIRECT where the file system allows (astra.weights.tensor_files). A stage
for an identity that already exists only compares (nothing is written).
Never touches gRPC.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from astra.errors import AlreadyExists, DataLoss, InvalidArgument
from astra.weights.checksum import adler32, format_adler32, is_adler32_hex
from astra.weights.delta import DeltaError, XorZstdChunks, XorZstdEncoder, frame_content_size
from astra.weights.hot import BufferCursor, HotBuilder, HotVersion
from astra.weights.layout import Tensor, Version
from astra.weights.records import TensorRecord, disk_full, fsync_path
from astra.weights.safetensors_io import METADATA_KEY, tensor_nbytes
from astra.weights.tensor_files import (
    ALIGN,
    BUFFERS,
    RangeCursor,
    ShardWriter,
    read_range,
    tensor_header,
)

_HASHERS = ThreadPoolExecutor(2, thread_name_prefix="publish-sha256")
_ENCODERS = ThreadPoolExecutor(2, thread_name_prefix="publish-encode")
_SYNCERS = ThreadPoolExecutor(4, thread_name_prefix="publish-sync")
MANIFEST = "tensors.jsonl"
HEADER = "header.json"
MAX_TENSOR_NAME_CHARS = 1024


def content_mismatch(identity: str, detail: str, tensor: str | None = None) -> AlreadyExists:
    meta = {"identity": identity, **({"tensor": tensor} if tensor else {})}
    return AlreadyExists(
        f"identity {identity!r} exists with other content: {detail}",
        reason="VERSION_CONTENT_MISMATCH",
        metadata=meta,
    )


def _bad_tensor(name: str, detail: str) -> InvalidArgument:
    return InvalidArgument(f"{name}: {detail}", reason="INVALID_TENSOR", metadata={"tensor": name})


class TensorSink:
    """Receives one tensor's bytes in order; `finish` verifies them and records the tensor."""

    def __init__(
        self,
        stage: PublishStage,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        adler: str | None,
        encoded: int | None = None,
    ):
        if not name or len(name) > MAX_TENSOR_NAME_CHARS or name == METADATA_KEY:
            raise _bad_tensor(name, f"name must be 1-{MAX_TENSOR_NAME_CHARS} characters")
        if name in stage.held or name in stage.received:
            raise _bad_tensor(name, "sent twice in one publish")
        try:
            self.size = tensor_nbytes(dtype, shape)
        except ValueError as exc:
            raise _bad_tensor(name, str(exc)) from exc
        if adler is not None and not is_adler32_hex(adler):
            raise _bad_tensor(name, f"adler32 {adler!r} is not 8 lowercase hex digits")
        # adler None: the caller's own bytes (an in-process publish), checksummed as they land;
        # the shard's header is written with a placeholder of the same length and fixed at the end.
        self.stage, self.name, self.dtype, self.shape, self.adler = stage, name, dtype, shape, adler
        self.received, self._adler, self._sha = 0, 1, hashlib.sha256()
        self._sha_pending: Future[None] | None = None
        self._encoder_pending: Future[None] | None = None
        self.synced: Future[None] | None = None  # set once accepted: done when durable and listed
        self.file = stage.next_file()
        self._out: ShardWriter | None = None
        self._encoder: XorZstdEncoder | None = None
        self.offset = 0
        # encoded: the sender's xor+zstd frame of this many bytes against the base's tensor,
        # collected as it streams and decoded into the shard by `finish`.
        self.encoded, self._frame = encoded, None
        self._hot: Any = None
        if encoded is not None:
            entry = stage.base.entries.get(name) if stage.base is not None else None
            if stage.expected is not None or entry is None:
                raise _bad_tensor(name, "an xor+zstd tensor the base does not have")
            if (entry.info.dtype, tuple(entry.info.shape)) != (dtype, tuple(shape)):
                raise _bad_tensor(
                    name,
                    f"an xor+zstd tensor of {dtype}{list(shape)} against "
                    f"{entry.info.dtype}{list(entry.info.shape)} in the base",
                )
            self._frame = bytearray()
        if stage.expected is None:
            # A complete single-tensor shard: the store links it in, never rewrites it.
            head = tensor_header(name, dtype, shape, self.size, adler or "0" * 8, align=ALIGN)
            try:
                self._out = ShardWriter(stage.path / (self.file + ".part"), head, self.size)
            except OSError as exc:
                self.abort()
                raise disk_full(exc, f"cannot stage {name}") from exc
            self.offset = len(head)
            if encoded is None:
                self._encoder = stage.encoder(name, dtype, tuple(shape), self.size)
            # The new bytes in RAM as they pass, for the publish after this one.
            if stage.hot_new is not None:
                self._hot = stage.hot_new.begin(name, self.size)

    @property
    def expected_bytes(self) -> int:
        """Bytes this tensor takes on the stream: its frame's, or its own."""
        return self.encoded if self.encoded is not None else self.size

    @property
    def complete(self) -> bool:
        return self.received == self.expected_bytes

    def write(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        if offset != self.received:
            raise _bad_tensor(self.name, f"chunk at offset {offset}, expected {self.received}")
        if self.received + view.nbytes > self.expected_bytes:
            raise _bad_tensor(self.name, f"more than its {self.expected_bytes} bytes")
        if self._frame is not None:
            self._frame += view
            self.received += view.nbytes
            return
        # SHA-256, the dearest pass, runs on its own thread beside the rest (hashlib releases the
        # GIL); one update in flight per tensor keeps them in order.
        if self._sha_pending is not None:
            self._sha_pending.result()
        self._sha_pending = _HASHERS.submit(self._sha.update, view)
        self._adler = adler32(view, self._adler)
        if self._hot is not None:
            self._hot[offset : offset + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
        if self._out is not None:
            try:
                if (
                    self._encoder is not None
                ):  # XOR + zstd beside the copy (numpy, zstd free the GIL)
                    self._wait_encoder()
                    self._encoder_pending = _ENCODERS.submit(self._encoder.update, view)
                self._out.write(view)
            except OSError as exc:
                raise disk_full(exc, f"cannot stage {self.name}") from exc
        self.received += view.nbytes

    def finish(self) -> TensorRecord:
        if not self.complete:
            raise _bad_tensor(self.name, f"{self.received} of {self.expected_bytes} bytes")
        if self._frame is not None:
            self._decode()
        self._wait_sha()
        self._wait_encoder()
        got = format_adler32(self._adler)
        if self.adler is None:
            self.adler = got
            if self._out is not None:
                head = tensor_header(self.name, self.dtype, self.shape, self.size, got, align=ALIGN)
                self._out.rewrite_head(head)
        if got != self.adler:
            self.abort()
            raise DataLoss(
                f"{self.name}: bytes hash to {got}, header says {self.adler}",
                reason="CHECKSUM_MISMATCH",
                metadata={"tensor": self.name},
            )
        record = TensorRecord(self.dtype, self.shape, self.size, got, self._sha.hexdigest())
        self.stage.accept(self, record)
        return record

    def _decode(self) -> None:
        """Decodes the sender's frame against the base into the shard: Adler-32 and SHA-256 of
        the new bytes computed on the way (SHA-256 on its own thread), the frame kept as this
        tensor's delta (None when it changes nothing)."""
        frame, self._frame = bytes(self._frame), None
        try:
            declared = frame_content_size(frame)
        except DeltaError as exc:
            raise self._corrupt(exc) from exc
        if declared is None:
            self.abort()
            raise _bad_tensor(self.name, "the xor+zstd frame must declare its content size")
        pieces = self.stage.base_bytes(self.name, self.size) if self.size else iter([b""])
        try:
            chunks, pos = XorZstdChunks(frame, pieces, self.size), 0
            for chunk in chunks:
                self._wait_sha()  # the buffer the next chunk is decoded into is hashed by now
                self._sha_pending = _HASHERS.submit(self._sha.update, chunk)
                self._adler = adler32(chunk, self._adler)
                if self._hot is not None:
                    self._hot[pos : pos + chunk.size] = chunk
                pos += chunk.size
                self._out.write(chunk)
            self._wait_sha()
        except DeltaError as exc:
            raise self._corrupt(exc) from exc
        except OSError as exc:
            self.abort()
            raise disk_full(exc, f"cannot stage {self.name}") from exc
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()
        with self.stage._lock:
            self.stage.frames[self.name] = (frame, self._adler) if chunks.changed else None

    def _corrupt(self, exc: DeltaError) -> DataLoss:
        self.abort()
        return DataLoss(
            f"{self.name}: {exc}", reason="CORRUPT_DELTA", metadata={"tensor": self.name}
        )

    def _wait_encoder(self) -> None:
        if self._encoder_pending is not None:
            pending, self._encoder_pending = self._encoder_pending, None
            try:
                pending.result()
            except OSError as exc:
                raise disk_full(exc, f"cannot encode {self.name}") from exc

    def _wait_sha(self) -> None:
        if self._sha_pending is not None:
            pending, self._sha_pending = self._sha_pending, None
            pending.result()

    def close_file(self) -> Path | None:
        """Completes the shard file (synced later, by the stage)."""
        if self._out is None:
            return None
        try:
            self._out.close(durable=False)
        except OSError as exc:
            self.abort()
            raise disk_full(exc, f"cannot stage {self.name}") from exc
        self._out = None
        final = self.stage.path / self.file
        os.replace(self.stage.path / (self.file + ".part"), final)
        if self._encoder is not None:
            frame = self._encoder.finish(self._adler)
            self._encoder = None
            with self.stage._lock:
                self.stage.frames[self.name] = frame
        return final

    def abort(self) -> None:
        if self._hot is not None and self.stage.hot_new is not None:
            self.stage.hot_new.forget(self.name)
            self._hot = None
        with contextlib.suppress(Exception):
            self._wait_sha()  # the hasher and the encoder may still read the caller's buffer
        with contextlib.suppress(Exception):
            self._wait_encoder()
        if self._encoder is not None:
            self._encoder.close()
            self._encoder = None
        if self._out is not None:
            self._out.abort()
            self._out = None
            (self.stage.path / (self.file + ".part")).unlink(missing_ok=True)


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
    ) -> None:
        self.path, self.header, self.expected, self.durable = path, header, expected, durable
        # The version the frames are encoded against (the current one when the stage opened),
        # read from RAM when the store holds it there (hot_base); hot_new collects the new bytes.
        self.base, self.base_identity, self.level = base, base_identity, level
        self.hot_base, self.hot_new = hot_base, hot_new
        # xor+zstd frame against the base and Adler-32 of each tensor received in this
        # session (None: identical to the base); tensors held from an earlier session have none.
        self.frames: dict[str, tuple[bytes, int] | None] = {}
        self._lock = threading.Lock()  # tensors of one stage may be received on several threads
        self._next = 0
        self._pending: list[Future[None]] = []
        self.held: dict[str, tuple[str, TensorRecord]] = {}
        self.received: dict[str, tuple[str, TensorRecord]] = {}
        self.files: dict[str, bytes] = {}
        self.offsets: dict[str, int] = {}  # where each staged tensor's bytes start (0: bare bytes)
        if expected is not None:
            return
        if path.is_dir() and self._read_header() == header:
            self._load()
        else:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
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
                rec = TensorRecord(
                    e["dtype"], tuple(e["shape"]), e["size"], e["adler32"], e["sha256"]
                )
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

    def base_bytes(self, name: str, size: int) -> Any:
        """The base tensor's bytes as consecutive pieces (RAM when held there, else its file)."""
        held = self.hot_base.get(name, size) if self.hot_base is not None else None
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
        held = self.hot_base.get(name, size) if self.hot_base is not None else None
        if held is not None:
            cursor: Any = BufferCursor(held)
        else:
            cursor = RangeCursor(entry.shard.path, entry.shard.data_start + entry.info.begin, size)
        scratch = BUFFERS.get()
        return XorZstdEncoder(cursor, size, self.level, scratch, lambda: BUFFERS.put(scratch))

    def next_file(self) -> str:
        with self._lock:
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
            with self._lock:
                self.received[sink.name] = ("", record)
            return
        sink.close_file()
        line = {"name": sink.name, "file": sink.file, "size": record.size_bytes}
        line["offset"] = sink.offset
        line.update(dtype=record.dtype, shape=list(record.shape))
        line.update(adler32=record.adler32, sha256=record.sha256)
        with self._lock:
            self.received[sink.name] = (sink.file, record)
            self.offsets[sink.name] = sink.offset
            sink.synced = _SYNCERS.submit(self._record, sink.file, json.dumps(line))
            self._pending.append(sink.synced)

    def _record(self, file: str, line: str) -> None:
        if self.durable:
            fsync_path(self.path / file)  # concurrent syncs share journal commits
        with self._lock, open(self.path / MANIFEST, "a") as f:
            f.write(line + "\n")

    def flush(self) -> None:
        """Until every accepted tensor is durable and in the manifest; raises the first failure."""
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
            for future in pending:
                future.result()

    def records(self) -> dict[str, TensorRecord]:
        return {n: r for n, (_, r) in (self.held | self.received).items()}

    def tensors(self) -> dict[str, Tensor]:
        """Zero-copy views of every staged tensor (mmap); valid while referenced."""
        out = {}
        for name, (file, rec) in sorted((self.held | self.received).items()):
            if rec.size_bytes == 0:
                out[name] = Tensor(rec.dtype, rec.shape, b"")
                continue
            with open(self.path / file, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            start = self.offsets.get(name, 0)
            out[name] = Tensor(rec.dtype, rec.shape, memoryview(mm)[start : start + rec.size_bytes])
        return out

    def shards(self) -> dict[str, Path] | None:
        """Every staged tensor's single-tensor shard file, None when any is bare bytes."""
        staged = self.held | self.received
        if self.expected is not None or any(not self.offsets.get(n) for n in staged):
            return None
        return {name: self.path / file for name, (file, _) in staged.items()}

    def remove(self) -> None:
        if self.expected is None:
            shutil.rmtree(self.path, ignore_errors=True)
