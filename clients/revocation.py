"""Client calls refused when the server shows a revoked certificate (astra.tls_peer).

A channel whose TLS material holds a revocation list that names any serial gets
`revocation_interceptors`: before each call of any shape it awaits the address's PeerCheck (a
handshake of its own once in RECHECK_S; free in between) and, when the server's certificate is
listed, fails the call with UNAUTHENTICATED, ErrorInfo reason SERVER_CERTIFICATE_REVOKED
(domain astra.tls, metadata serial and address), before anything is sent. A client whose
call writes its requests (`call.write`) awaits `check_server` before it opens the call.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from astra.tls_material import TlsMaterial
from astra.tls_peer import PeerCheck, RevokedPeer

DOMAIN = "astra.tls"
REASON = "SERVER_CERTIFICATE_REVOKED"


def refusal(exc: RevokedPeer) -> grpc.aio.AioRpcError:
    """The error a call to a revoked server ends with, as a server's refusal would read."""
    info = error_details_pb2.ErrorInfo(
        reason=REASON, domain=DOMAIN, metadata={"serial": f"{exc.serial:x}", "address": exc.address}
    )
    packed = any_pb2.Any()
    packed.Pack(info)
    status = status_pb2.Status(code=code_pb2.UNAUTHENTICATED, message=str(exc), details=[packed])
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), trailing, details=str(exc)
    )


def peer_check(address: str, tls: TlsMaterial | None) -> PeerCheck | None:
    """The check of the server at `address` under `tls`; None where there is nothing to look
    up (plaintext, or a list that names nobody)."""
    return PeerCheck(address, tls) if tls is not None and tls.revoked else None


async def check_server(check: PeerCheck | None) -> None:
    """Raises the refusal (an AioRpcError) when the server is revoked. A call that writes its
    requests (`call.write`) needs this before it opens: gRPC turns an interceptor's error
    into InvalidStateError at the first write, and the reason is lost."""
    if check is None:
        return
    try:
        await check.check()
    except RevokedPeer as exc:
        raise refusal(exc) from None


class _Guard:
    def __init__(self, check: PeerCheck) -> None:
        self.check = check


class _UnaryUnary(_Guard, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request) -> Any:
        await check_server(self.check)
        return await continuation(client_call_details, request)


class _UnaryStream(_Guard, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request) -> Any:
        await check_server(self.check)
        return await continuation(client_call_details, request)


class _StreamUnary(_Guard, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation, client_call_details, request_iterator
    ) -> Any:
        await check_server(self.check)
        return await continuation(client_call_details, request_iterator)


class _StreamStream(_Guard, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation, client_call_details, request_iterator
    ) -> Any:
        await check_server(self.check)
        return await continuation(client_call_details, request_iterator)


def revocation_interceptors(check: PeerCheck) -> list[_Guard]:
    """One interceptor per call shape (a grpc.aio channel files each under one shape only),
    all asking `check`."""
    return [cls(check) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
