"""Driver of WeightService's PublishVersion stream: `publish_version`.

Tensors go out as raw bytes, or, given the version this sender published
last (`base`), as xor+zstd frames against it: the sender's own host copy of
that version, so a publish moves the change, not the model. Each tensor is
prepared (Adler-32 of the new bytes; the frame) on worker threads a few
tensors ahead of the stream, once per publish whatever the attempts; chunks
go out as zero-copy slices; the tensors the service already holds for the
identity are skipped, and on UNAVAILABLE a new stream resumes. A TensorAck
with a non-OK status is the service refusing the publish: the client stops
sending and reports that status (grpc.aio may report INTERNAL for the call
itself when a write races its end). When the service refuses the frames
(the base is no longer its current version, or a frame does not decode to
its checksum: the sender's copy differs) the version is published again as
raw tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from astra import errors
from astra.clients.weights import CHUNK_BYTES, WeightClient, domain_error, error_from_status
from astra.weights.checksum import adler32_hex, format_adler32
from astra.weights.delta import encode_if_changed, encode_xor_zstd
from astra.weights.malloc import keep_freed_memory
from astra.weights.records import sha256_bytes
from astra.weights.safetensors_io import safetensors_dtype
from astra.weights.tensor_files import INLINE_BYTES  # smaller tensors: prepared when sent
from astra.weights.v1 import weight_service_pb2 as pb
from astra.weights.wire import chunk_message, serialize

log = logging.getLogger(__name__)
LOOKAHEAD = 4  # tensors prepared ahead of the one being sent
_WORKERS = ThreadPoolExecutor(2, thread_name_prefix="publish-prepare")  # zstd, numpy free the GIL
# The service refusing a delta publish: send the version again as raw tensors.
DELTA_REFUSALS = {
    "PUBLISH_BASE_NOT_CURRENT",
    "CHECKSUM_MISMATCH",
    "CORRUPT_DELTA",
    "FILE_NOT_IN_BASE",
}

Tensors = Mapping[str, tuple[str, Any, Any]]


@dataclass
class PublishResult:
    version: pb.VersionInfo
    already_existed: bool
    tensors_sent: int
    tensors_skipped: int
    attempts: int
    bytes_sent: int = 0  # tensor bytes on the stream (frames or raw), over all attempts
    delta_base: str = ""  # the version the frames were encoded against; "" when sent raw


@dataclass(frozen=True)
class _Prepared:
    encoding: int
    adler32: str
    payload: memoryview


def _prepare(view: memoryview, base: memoryview | None) -> _Prepared:
    if base is None:
        return _Prepared(pb.TENSOR_ENCODING_RAW, adler32_hex(view), view)
    encoded = encode_if_changed(view, base)
    if encoded is None:  # unchanged: a frame of zeros, a few bytes per MiB
        return _Prepared(pb.TENSOR_ENCODING_XOR_ZSTD, adler32_hex(view), memoryview(
            encode_xor_zstd(view, base)
        ))  # fmt: skip
    frame, adler = encoded
    return _Prepared(pb.TENSOR_ENCODING_XOR_ZSTD, format_adler32(adler), memoryview(frame))


class _Preparer:
    """Prepares tensors on worker threads, in send order, `LOOKAHEAD` ahead; each once."""

    def __init__(self, tensors: dict[str, tuple[str, tuple, memoryview]], base: dict | None):
        self.tensors, self.base = tensors, base or {}
        self._futures: dict[str, Future[_Prepared]] = {}

    def _args(self, name: str) -> tuple[memoryview, memoryview | None]:
        dtype, shape, view = self.tensors[name]
        b = self.base.get(name)
        fits = b is not None and (b[0], tuple(b[1]), b[2].nbytes) == (dtype, shape, view.nbytes)
        return view, b[2] if fits else None

    def _submit(self, name: str) -> None:
        if name not in self._futures and self.tensors[name][2].nbytes >= INLINE_BYTES:
            self._futures[name] = _WORKERS.submit(_prepare, *self._args(name))

    async def get(self, order: list[str], i: int) -> _Prepared:
        for name in order[i : i + LOOKAHEAD + 1]:
            self._submit(name)
        future = self._futures.get(order[i])
        if future is None:
            return _prepare(*self._args(order[i]))
        return await asyncio.wrap_future(future)

    def cancel(self) -> None:
        for future in self._futures.values():
            future.cancel()


def _transport_failed(exc: grpc.aio.AioRpcError) -> bool:
    """The stream broke (the service went away): resume on a new one. gRPC reports a write on
    a connection the peer just reset as INTERNAL "Internal error from Core", not UNAVAILABLE."""
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return True
    return exc.code() == grpc.StatusCode.INTERNAL and "from Core" in (exc.details() or "")


class _StaleStage(Exception):
    """The service holds tensors of this identity, staged by an earlier publisher, that differ
    from ours (a trainer that restarted and produced other content for the same identity)."""


def _stale_held(
    accepted: pb.PublishAccepted, tensors: dict[str, tuple[str, tuple, memoryview]]
) -> str:
    """The first held tensor that is not ours byte for byte (by Adler-32), "" when all are.
    A service that predates `held` sends names only: those are trusted, as before."""
    for h in accepted.held:
        ours = tensors.get(h.name)
        if ours is None:
            return h.name
        dtype, shape, view = ours
        mine = (safetensors_dtype(dtype), tuple(shape), view.nbytes)
        if mine != (safetensors_dtype(h.dtype), tuple(h.shape), h.size_bytes):
            return h.name
        if adler32_hex(view) != h.adler32:
            return h.name
    return ""


class _Answers:
    """Reads a publish stream's answers; a refusing TensorAck carries the stream's error."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.refusal: errors.AstraError | None = None
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> pb.PublishCommitted:
        while True:
            try:
                resp = await self.call.read()
            except grpc.aio.AioRpcError:
                if self.refusal is not None:
                    raise self.refusal from None
                raise
            if resp is grpc.aio.EOF:
                raise errors.InvalidArgument("publish ended uncommitted", reason="NO_COMMIT")
            if resp.HasField("tensor_ack") and resp.tensor_ack.status.code:
                self.refusal = self.refusal or error_from_status(resp.tensor_ack.status)
            elif resp.HasField("committed"):
                return resp.committed


async def _publish_once(
    call: Any,
    header: pb.PublishHeader,
    tensors: dict[str, tuple[str, tuple, memoryview]],
    prepared: _Preparer,
    files: dict[str, bytes],
    chunk_bytes: int,
    sent: list[int],
    unchanged: frozenset[str] = frozenset(),
) -> PublishResult:
    await call.write(pb.PublishVersionRequest(header=header))
    first = await call.read()
    if first is grpc.aio.EOF or not first.HasField("accepted"):
        raise errors.InvalidArgument("publish was not accepted", reason="NO_ACCEPT")
    held = set(first.accepted.held_tensors)
    if header.restart:
        header.restart = False  # done: a later attempt resumes what this one stages
    elif held and (stale := await asyncio.to_thread(_stale_held, first.accepted, tensors)):
        raise _StaleStage(stale)
    answers = _Answers(call)

    async def send(raw: bytes | None = None, **part: Any) -> None:
        if answers.refusal is not None or answers.task.done():
            raise asyncio.InvalidStateError("the service ended the publish")
        await call.write(raw if raw is not None else pb.PublishVersionRequest(**part))

    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        order = sorted(n for n in tensors if n not in held)
        for i, name in enumerate(order):
            dtype, shape, view = tensors[name]
            p = await prepared.get(order, i)
            h = pb.TensorHeader(name=name, dtype=dtype, shape=list(shape), adler32=p.adler32)
            h.encoding, h.size_bytes, h.encoded_size_bytes = (
                p.encoding,
                view.nbytes,
                p.payload.nbytes,
            )
            await send(tensor=h)
            for pos in range(0, p.payload.nbytes, chunk_bytes):
                piece = p.payload[pos : pos + chunk_bytes]
                await send(chunk_message(pos, piece))
                sent[0] += piece.nbytes
        for name, content in sorted(files.items()):
            if name in unchanged and header.base_version_id:  # the base's: by digest only
                digest = sha256_bytes(content)
                await send(file=pb.VersionFile(name=name, same_as_base=True, sha256=digest))
            else:
                await send(file=pb.VersionFile(name=name, content=content))
        await send(commit=pb.PublishCommit(num_tensors=len(tensors)))
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await call.done_writing()
    committed = await answers.task
    n = len(tensors) - len(held)
    return PublishResult(committed.version, committed.already_existed, n, len(held), 0)


async def publish_version(
    address: str,
    policy: str,
    identity: str,
    version: int,
    tensors: Tensors,
    files: Mapping[str, bytes] | None = None,
    *,
    metadata: Mapping[str, str] | None = None,
    base: tuple[str, Tensors] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    max_attempts: int = 5,
    backoff_s: float = 0.2,
    timeout_s: float = 3600.0,
    client: WeightClient | None = None,
    unchanged_files: Iterable[str] = (),
) -> PublishResult:
    """Publishes (dtype, shape, bytes) tensors as `identity`; resumes and retries UNAVAILABLE.

    base: (identity, tensors) of the version this sender published last. Tensors
    of the same dtype and shape go out as xor+zstd frames against it; if the
    service refuses them (DELTA_REFUSALS) the version goes out again raw.
    client: an open WeightClient of `address` to publish through (a sender publishing every
    step keeps one: a channel per publish costs a connection each); left open.
    unchanged_files: names in `files` whose content equals the base's: with `base` they go
    by name and SHA-256 (VersionFile.same_as_base), not their bytes; refused
    (FILE_NOT_IN_BASE), the version goes out again raw, every file with its content.
    """
    attempt = functools.partial(
        _publish, address, policy, identity, version, _views(tensors), files, metadata,
        chunk_bytes=chunk_bytes, max_attempts=max_attempts, backoff_s=backoff_s,
        timeout_s=timeout_s, client=client,
    )  # fmt: skip
    if base is not None:
        try:
            return await attempt((base[0], _views(base[1])), frozenset(unchanged_files))
        except (errors.FailedPrecondition, errors.DataLoss, errors.InvalidArgument) as exc:
            # A service older than base_version_id refuses the encoding itself.
            older = exc.metadata.get("field") == "tensor.encoding"
            if exc.reason not in DELTA_REFUSALS and not older:
                raise
            log.info("publish %s against %s refused (%s); sending raw tensors", identity,
                     base[0], exc.message)  # fmt: skip
    return await attempt(None)


def _views(tensors: Tensors) -> dict[str, tuple[str, tuple, memoryview]]:
    return {n: (d, tuple(s), memoryview(b).cast("B")) for n, (d, s, b) in tensors.items()}


async def _publish(
    address: str,
    policy: str,
    identity: str,
    version: int,
    views: dict[str, tuple[str, tuple, memoryview]],
    files: Mapping[str, bytes] | None,
    metadata: Mapping[str, str] | None,
    base: tuple[str, dict] | None,
    unchanged: frozenset[str] = frozenset(),
    *,
    chunk_bytes: int,
    max_attempts: int,
    backoff_s: float,
    timeout_s: float,
    client: WeightClient | None = None,
) -> PublishResult:
    header = pb.PublishHeader(policy_id=policy, version_id=identity, version=version)
    header.num_tensors = len(views)
    header.metadata.update(dict(metadata or {}))
    if base is not None:
        header.base_version_id = base[0]
    prepared = _Preparer(views, base[1] if base is not None else None)
    sent = [0]
    keep_freed_memory()  # chunk buffers come back from the heap, not as fresh pages
    try:
        opened = contextlib.nullcontext(client) if client is not None else None
        async with opened or WeightClient(address, timeout_s=timeout_s) as client:
            # PublishVersion taking chunks as wire bytes (astra.weights.wire), other parts as
            # messages.
            publish = client.channel.stream_stream(
                "/astra.weights.v1.WeightService/PublishVersion",
                request_serializer=serialize,
                response_deserializer=pb.PublishVersionResponse.FromString,
            )
            restarted, attempt = False, 0
            while attempt < max_attempts:
                attempt += 1
                call = publish(timeout=timeout_s)
                try:
                    await client.check_server()  # a revoked server: refused before a write
                    result = await _publish_once(
                        call, header, views, prepared, dict(files or {}), chunk_bytes, sent,
                        unchanged,
                    )  # fmt: skip
                    result.attempts, result.bytes_sent = attempt, sent[0]
                    result.delta_base = base[0] if base is not None else ""
                    return result
                except _StaleStage as exc:
                    if restarted:  # restart sent, yet other content held: a concurrent sender
                        raise errors.Unavailable(
                            f"{identity!r}: tensor {exc} staged by another sender",
                            reason="PUBLISH_IN_PROGRESS",
                            metadata={"identity": identity, "tensor": str(exc)},
                        ) from None
                    log.warning("publish %s: the service holds another attempt's %s; "
                                "starting over", identity, exc)  # fmt: skip
                    restarted = header.restart = True
                    attempt -= 1  # not a failed attempt: the same one, from the start
                except grpc.aio.AioRpcError as exc:
                    if not _transport_failed(exc) or attempt == max_attempts:
                        raise domain_error(exc) from exc
                    log.info("publish %s: %s; retrying", identity, exc.details())
                finally:
                    call.cancel()
                await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
    finally:
        prepared.cancel()
    raise AssertionError("unreachable")
