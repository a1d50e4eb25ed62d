"""One tensor of a publish as its bytes stream in: checked, hashed, staged, encoded or decoded.

Raw bytes are written to the tensor's single-tensor shard as they arrive,
with their Adler-32, their content digest (astra.weights.digest, on its own
thread) and, given a base, their xor+zstd frame against it (on another)
computed in the same pass. A sender's xor+zstd frame is collected and, at
`finish`, decoded against the base (from RAM when the store holds it there,
else from its file) into the shard, with the same hashes, and kept as the
tensor's delta. Either way the new bytes also land in the store's RAM copy
of the version being built (astra.weights.hot; a frame is decoded straight
into it), and the tensor is handed to its PublishStage only once its
Adler-32 matches. Never touches gRPC.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from astra.errors import DataLoss, InvalidArgument
from astra.weights.checksum import adler32, format_adler32, is_adler32_hex
from astra.weights.delta import DeltaError, XorZstdChunks, XorZstdEncoder, frame_content_size
from astra.weights.digest import DEFAULT, finish, hasher, kind_of
from astra.weights.hot import HotBuilder
from astra.weights.layout import Version
from astra.weights.records import TensorRecord, disk_full
from astra.weights.safetensors_io import METADATA_KEY, tensor_nbytes
from astra.weights.tensor_files import ALIGN, INLINE_BYTES, ShardWriter, tensor_header

log = logging.getLogger(__name__)
_HASHERS = ThreadPoolExecutor(2, thread_name_prefix="publish-digest")


class Stage(Protocol):
    """What a TensorSink needs of the publish it belongs to (astra.weights.publish_stage)."""

    path: Path
    expected: dict[str, TensorRecord] | None
    base: Version | None
    base_suspect: bool
    frames: dict[str, tuple[bytes, int] | None]
    held: dict[str, tuple[str, TensorRecord]]
    received: dict[str, tuple[str, TensorRecord]]
    hot_new: HotBuilder | None
    lock: threading.Lock

    def base_bytes(self, name: str, size: int) -> Any: ...
    def encoder(
        self, name: str, dtype: str, shape: tuple[int, ...], size: int
    ) -> XorZstdEncoder | None: ...
    def next_file(self) -> str: ...
    def reserve_ram(self, size: int) -> bool: ...
    def release_ram(self, size: int) -> None: ...
    def accept(self, sink: TensorSink, record: TensorRecord) -> None: ...


_ENCODERS = ThreadPoolExecutor(2, thread_name_prefix="publish-encode")
MAX_TENSOR_NAME_CHARS = 1024


def _bad_tensor(name: str, detail: str) -> InvalidArgument:
    return InvalidArgument(f"{name}: {detail}", reason="INVALID_TENSOR", metadata={"tensor": name})


class _RamShard:
    """A small tensor's bytes held in RAM (the stage writes them with the other small ones
    at the commit): what TensorSink uses of a ShardWriter."""

    def __init__(self, size: int) -> None:
        self.buf, self.written = bytearray(size), 0

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self.buf[self.written : self.written + view.nbytes] = view
        self.written += view.nbytes

    def rewrite_head(self, head: bytes) -> None:
        """The checksum goes into the packed shard's header when it is written."""

    def close(self, *, durable: bool) -> None:
        """Nothing to close: the bytes stay in RAM."""

    def abort(self) -> None:
        self.buf = bytearray()


class TensorSink:
    """Receives one tensor's bytes in order; `finish` verifies them and records the tensor."""

    def __init__(
        self,
        stage: Stage,
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
        # Compared against an existing identity's record: hashed as that record was.
        expected = stage.expected.get(name) if stage.expected is not None else None
        self._kind = kind_of(expected.digest) if expected is not None else DEFAULT
        self.received, self._adler, self._hash = 0, 1, hasher(self._kind)
        self._hash_pending: Future[None] | None = None
        self._encoder_pending: Future[None] | None = None
        self.synced: Future[None] | None = None  # set once accepted: done when durable and listed
        self.file = stage.next_file()
        self._out: ShardWriter | _RamShard | None = None
        self.ram: bytearray | None = None  # the bytes, when held in RAM until the commit
        self._ram_reserved = 0
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
        if stage.expected is None and self.small and stage.reserve_ram(self.size):
            self._ram_reserved = self.size
            self._out = _RamShard(self.size)
        elif stage.expected is None:
            # A complete single-tensor shard: the store links it in, never rewrites it.
            head = tensor_header(name, dtype, shape, self.size, adler or "0" * 8, align=ALIGN)
            try:
                self._out = ShardWriter(stage.path / (self.file + ".part"), head, self.size)
            except OSError as exc:
                self.abort()
                raise disk_full(exc, f"cannot stage {name}") from exc
            self.offset = len(head)
        if stage.expected is None:
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

    @property
    def small(self) -> bool:
        """Below INLINE_BYTES on the stream and at rest: hashed and encoded on the caller's
        thread, and written and finished there by the stream (astra.weights.publish_stream)."""
        return max(self.size, self.expected_bytes) < INLINE_BYTES

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
        # The digest, the dearest pass, runs on its own thread beside the rest (it releases the
        # GIL); one update in flight per tensor keeps them in order.
        inline = self.small
        self._wait_hash()
        if inline:
            self._hash.update(view)
        else:
            self._hash_pending = _HASHERS.submit(self._hash.update, view)
        self._adler = adler32(view, self._adler)
        if self._hot is not None:
            self._hot[offset : offset + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
        if self._out is not None:
            try:
                if (
                    self._encoder is not None
                ):  # XOR + zstd beside the copy (numpy, zstd free the GIL)
                    self._wait_encoder()
                    if inline:
                        self._encoder.update(view)
                    else:
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
        self._wait_hash()
        self._wait_encoder()
        got = format_adler32(self._adler)
        if self.adler is None:
            self.adler = got
            if self._out is not None:
                head = tensor_header(self.name, self.dtype, self.shape, self.size, got, align=ALIGN)
                self._out.rewrite_head(head)
        if got != self.adler:
            if self.encoded is not None:  # decoded against our base: ours may be what is wrong
                self.stage.base_suspect = True
            self.abort()
            raise DataLoss(
                f"{self.name}: bytes hash to {got}, header says {self.adler}",
                reason="CHECKSUM_MISMATCH",
                metadata={"tensor": self.name},
            )
        digest = finish(self._kind, self._hash)
        record = TensorRecord(self.dtype, self.shape, self.size, got, digest)
        self.stage.accept(self, record)
        self._release_hot()
        return record

    def _release_hot(self) -> None:
        """Nothing of this sink reads or writes the RAM copy's buffer from here on."""
        if self._hot is not None and self.stage.hot_new is not None:
            self.stage.hot_new.end(self.name)
        self._hot = None

    def _decode(self) -> None:
        """Decodes the sender's frame against the base into the shard: Adler-32 and digest of
        the new bytes computed on the way (the digest on its own thread), the frame kept as this
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
            # Decoded straight into the RAM copy when it is kept, else a chunk at a time.
            chunks = XorZstdChunks(frame, pieces, self.size, out=self._hot if self.size else None)
            inline = self.small  # a thread hop costs more than hashing a small tensor here
            for chunk in chunks:
                self._wait_hash()  # the buffer the next chunk is decoded into is hashed by now
                if inline:
                    self._hash.update(chunk)
                else:
                    self._hash_pending = _HASHERS.submit(self._hash.update, chunk)
                self._adler = adler32(chunk, self._adler)
                self._out.write(chunk)
            self._wait_hash()
        except DeltaError as exc:
            raise self._corrupt(exc) from exc
        except OSError as exc:
            self.abort()
            raise disk_full(exc, f"cannot stage {self.name}") from exc
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()
        with self.stage.lock:
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

    def _wait_hash(self) -> None:
        if self._hash_pending is not None:
            pending, self._hash_pending = self._hash_pending, None
            pending.result()

    def close_file(self) -> Path | None:
        """Completes the shard file (synced later, by the stage)."""
        if self._out is None:
            return None
        final: Path | None = None
        if isinstance(self._out, _RamShard):
            self.ram, self._out = self._out.buf, None
        else:
            try:
                self._out.close(durable=False)
            except OSError as exc:
                self.abort()
                raise disk_full(exc, f"cannot stage {self.name}") from exc
            self._out = None
            final = self.stage.path / self.file
            os.replace(self.stage.path / (self.file + ".part"), final)
        if self._encoder is not None:
            encoder, self._encoder = self._encoder, None
            try:
                frame = encoder.finish(self._adler)
            except DeltaError as exc:  # the RAM copy of the base is wrong: no frame from it
                log.warning("%s: %s; encoded from disk at the commit", self.name, exc)
                self.stage.base_suspect = True
            else:
                with self.stage.lock:
                    self.stage.frames[self.name] = frame
        return final

    def abort(self) -> None:
        if self._hot is not None and self.stage.hot_new is not None:
            self.stage.hot_new.forget(self.name)
        with contextlib.suppress(Exception):
            self._wait_hash()  # the hasher and the encoder may still read the caller's buffer
        with contextlib.suppress(Exception):
            self._wait_encoder()
        self._release_hot()  # only now may the pool hand the buffer to another publish
        if self._encoder is not None:
            self._encoder.close()
            self._encoder = None
        if self._ram_reserved:
            self.stage.release_ram(self._ram_reserved)
            self._ram_reserved = 0
        self.ram = None
        if self._out is not None:
            ram = isinstance(self._out, _RamShard)
            self._out.abort()
            self._out = None
            if not ram:
                (self.stage.path / (self.file + ".part")).unlink(missing_ok=True)
