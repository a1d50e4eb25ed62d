"""Typed client of astra.weights.v1.WeightService: unary RPCs, error decoding, publishing.

`publish_version` drives the PublishVersion stream: raw tensors with their
Adler-32 computed once, chunks as zero-copy slices, the tensors the service
already holds for the identity skipped, and on UNAVAILABLE a new stream,
which resumes. A TensorAck with a non-OK status is the service refusing the
publish: the client stops sending and reports that status (grpc.aio may
report INTERNAL for the call itself when a write races its end). The fetch
driver, `Receiver`, is in clients/weights_stream.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from astra import errors
from astra.clients.channel import BaseClient
from astra.weights.checksum import adler32_hex
from astra.weights.malloc import keep_freed_memory
from astra.weights.v1 import weight_service_pb2 as pb
from astra.weights.v1 import weight_service_pb2_grpc as pb_grpc
from astra.weights.wire import chunk_message, serialize

log = logging.getLogger(__name__)
# Just under 4 MiB (gRPC's default receive limit; the contract allows 8 MiB): chunks go out as
# wire bytes built with one copy (astra.weights.wire), so larger ones only save per-message work.
CHUNK_BYTES = 4 * (1 << 20) - (64 << 10)


class WeightClient(BaseClient):
    SERVICE = "astra.weights.v1.WeightService"
    IDEMPOTENT = ("ListVersions", "GetVersion", "RollbackVersion", "GetStatus", "GetCapabilities")
    STUB = pb_grpc.WeightServiceStub
    PB = pb

    def __init__(self, address: str, *, timeout_s: float = 30.0) -> None:
        super().__init__(address, timeout_s=timeout_s)

    async def list_versions(
        self,
        policy_id: str,
        *,
        page_size: int = 100,
        page_token: str = "",
        timeout_s: float | None = None,
    ) -> pb.ListVersionsResponse:
        req = pb.ListVersionsRequest(
            policy_id=policy_id, page_size=page_size, page_token=page_token
        )
        return await self.stub.ListVersions(req, timeout=self._timeout(timeout_s))

    async def get_version(
        self, policy_id: str, version_id: str, *, timeout_s: float | None = None
    ) -> pb.GetVersionResponse:
        req = pb.GetVersionRequest(policy_id=policy_id, version_id=version_id)
        return await self.stub.GetVersion(req, timeout=self._timeout(timeout_s))

    async def rollback_version(
        self, request: pb.RollbackVersionRequest, *, timeout_s: float | None = None
    ) -> pb.RollbackVersionResponse:
        return await self.stub.RollbackVersion(request, timeout=self._timeout(timeout_s))


_ERRORS = {
    cls.code: cls
    for cls in (
        errors.InvalidArgument,
        errors.NotFound,
        errors.AlreadyExists,
        errors.FailedPrecondition,
        errors.ResourceExhausted,
        errors.Unavailable,
        errors.DataLoss,
    )
}


def error_from_status(status: status_pb2.Status) -> errors.AstraError:
    """The domain error a google.rpc.Status describes (code, message, ErrorInfo)."""
    code = grpc.StatusCode(
        next((c.value for c in grpc.StatusCode if c.value[0] == status.code), (2, "unknown"))
    ).name
    reason, metadata = code, {}
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
    cls = _ERRORS.get(code, errors.AstraError)
    err = cls(status.message or code, reason=reason, metadata=metadata)
    if cls is errors.AstraError:
        err.code = code
    return err


def domain_error(exc: grpc.aio.AioRpcError) -> errors.AstraError:
    """The domain error a failed call carries: its rich status when sent, else the bare code."""
    raw = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
    if raw:
        return error_from_status(status_pb2.Status.FromString(raw))
    return error_from_status(
        status_pb2.Status(code=exc.code().value[0], message=exc.details() or "")
    )


@dataclass
class PublishResult:
    version: pb.VersionInfo
    already_existed: bool
    tensors_sent: int
    tensors_skipped: int
    attempts: int


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


async def _publish_once(call, header, tensors, adlers, files, chunk_bytes) -> PublishResult:
    await call.write(pb.PublishVersionRequest(header=header))
    first = await call.read()
    if first is grpc.aio.EOF or not first.HasField("accepted"):
        raise errors.InvalidArgument("publish was not accepted", reason="NO_ACCEPT")
    held = set(first.accepted.held_tensors)
    answers = _Answers(call)

    async def send(raw: bytes | None = None, **part: Any) -> None:
        if answers.refusal is not None or answers.task.done():
            raise asyncio.InvalidStateError("the service ended the publish")
        await call.write(raw if raw is not None else pb.PublishVersionRequest(**part))

    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        for name in sorted(n for n in tensors if n not in held):
            dtype, shape, view = tensors[name]
            h = pb.TensorHeader(name=name, dtype=dtype, shape=list(shape), adler32=adlers[name])
            h.encoding = pb.TENSOR_ENCODING_RAW
            h.size_bytes = h.encoded_size_bytes = view.nbytes
            await send(tensor=h)
            for pos in range(0, view.nbytes, chunk_bytes):
                await send(chunk_message(pos, view[pos : pos + chunk_bytes]))
        for name, content in sorted(files.items()):
            await send(file=pb.VersionFile(name=name, content=content))
        await send(commit=pb.PublishCommit(num_tensors=len(tensors)))
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await call.done_writing()
    committed = await answers.task
    sent = len(tensors) - len(held)
    return PublishResult(committed.version, committed.already_existed, sent, len(held), 0)


async def publish_version(
    address: str,
    policy: str,
    identity: str,
    version: int,
    tensors: Mapping[str, tuple[str, Any, Any]],
    files: Mapping[str, bytes] | None = None,
    *,
    metadata: Mapping[str, str] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    max_attempts: int = 5,
    backoff_s: float = 0.2,
    timeout_s: float = 3600.0,
) -> PublishResult:
    """Publishes raw (dtype, shape, bytes) tensors as `identity`; resumes and retries UNAVAILABLE."""
    views = {n: (d, tuple(s), memoryview(b).cast("B")) for n, (d, s, b) in tensors.items()}
    adlers = await asyncio.to_thread(lambda: {n: adler32_hex(v[2]) for n, v in views.items()})
    header = pb.PublishHeader(policy_id=policy, version_id=identity, version=version)
    header.num_tensors = len(views)
    header.metadata.update(dict(metadata or {}))
    keep_freed_memory()  # chunk buffers come back from the heap, not as fresh pages
    async with WeightClient(address, timeout_s=timeout_s) as client:
        # PublishVersion taking chunks as wire bytes (astra.weights.wire), other parts as messages.
        publish = client.channel.stream_stream(
            "/astra.weights.v1.WeightService/PublishVersion",
            request_serializer=serialize,
            response_deserializer=pb.PublishVersionResponse.FromString,
        )
        for attempt in range(1, max_attempts + 1):
            call = publish(timeout=timeout_s)
            try:
                result = await _publish_once(
                    call, header, views, adlers, dict(files or {}), chunk_bytes
                )
                result.attempts = attempt
                return result
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == max_attempts:
                    raise domain_error(exc) from exc
                log.info("publish %s: %s; retrying", identity, exc.details())
            finally:
                call.cancel()
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")
