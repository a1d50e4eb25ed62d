"""Typed client of astra.weights.v1.WeightService: unary RPCs and error decoding.

The stream drivers live beside it: `publish_version` in
clients/weights_publish.py, `Receiver` in clients/weights_stream.py.
"""

from __future__ import annotations

import logging

import grpc
from google.rpc import error_details_pb2, status_pb2

from astra import errors
from astra.clients.channel import BaseClient
from astra.weights.v1 import weight_service_pb2 as pb
from astra.weights.v1 import weight_service_pb2_grpc as pb_grpc
from astra.weights.wire import deserializer

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

    def _bind(self, channel: grpc.aio.Channel) -> None:
        super()._bind(channel)
        # FetchVersion with chunks read as views into the received bytes (astra.weights.wire).
        self._fetch_raw = channel.stream_stream(
            f"/{self.SERVICE}/FetchVersion",
            request_serializer=pb.FetchVersionRequest.SerializeToString,
            response_deserializer=deserializer(pb.FetchVersionResponse.FromString),
        )

    def fetch_version_raw(self, *, timeout_s: float) -> grpc.aio.StreamStreamCall:
        """Opens a FetchVersion stream whose chunk messages hold views into the received bytes
        (for the Receiver), on the channel of now (a new one after a TLS renewal)."""
        self._follow_renewal()
        return self._fetch_raw(timeout=timeout_s)

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
        errors.PermissionDenied,
    )
}


def error_from_status(status: status_pb2.Status) -> errors.AstraError:
    """The domain error a google.rpc.Status describes (code, message, ErrorInfo)."""
    code = grpc.StatusCode(
        next((c.value for c in grpc.StatusCode if c.value[0] == status.code), (2, "unknown"))
    ).name
    reason, metadata, retry_after_s = code, {}, None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
    cls = _ERRORS.get(code, errors.AstraError)
    err = cls(status.message or code, reason=reason, metadata=metadata, retry_after_s=retry_after_s)
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
