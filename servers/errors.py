"""One place where domain errors become gRPC statuses.

`ErrorInterceptor` wraps every handler of a server: an `AstraError` becomes
its canonical code with a google.rpc.ErrorInfo (domain = the proto package),
BadRequest field violations and RetryInfo; any other exception becomes
INTERNAL with reason INTERNAL_ERROR and is logged, so a bug in one call
never takes the server down.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from astra.errors import AstraError

log = logging.getLogger(__name__)


def status_for(exc: AstraError, domain: str) -> grpc.Status:
    details = []
    info = error_details_pb2.ErrorInfo(reason=exc.reason, domain=domain, metadata=exc.metadata)
    details.append(info)
    if exc.field_violations:
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                    for f, d in exc.field_violations
                ]
            )
        )
    if exc.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(exc.retry_after_s * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    proto = status_pb2.Status(
        code=code_pb2.Code.Value(exc.code), message=exc.message, details=packed
    )
    return rpc_status.to_status(proto)


def _internal(domain: str, exc: BaseException) -> grpc.Status:
    err = AstraError(f"internal error: {type(exc).__name__}: {exc}", reason="INTERNAL_ERROR")
    return status_for(err, domain)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by handlers to statuses, for all four RPC shapes."""

    def __init__(self, domain_of: Callable[[str], str]) -> None:
        self._domain_of = domain_of

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        domain = self._domain_of(handler_call_details.method)

        async def fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
            if isinstance(exc, AstraError):
                await context.abort_with_status(status_for(exc, domain))
            log.exception("unhandled error in %s", handler_call_details.method)
            await context.abort_with_status(_internal(domain, exc))

        def wrap_unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behavior(request, context)
                except Exception as exc:
                    if _is_abort(exc):
                        raise
                    await fail(context, exc)

            return run

        def wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in behavior(request, context):
                        yield item
                except Exception as exc:
                    if _is_abort(exc):
                        raise
                    await fail(context, exc)

            return run

        h = handler
        if h.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(h.unary_unary), h.request_deserializer, h.response_serializer
            )
        if h.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(h.unary_stream), h.request_deserializer, h.response_serializer
            )
        if h.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(h.stream_unary), h.request_deserializer, h.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            wrap_stream(h.stream_stream), h.request_deserializer, h.response_serializer
        )


def _is_abort(exc: BaseException) -> bool:
    # context.abort() raises AbortError; it has already set the status.
    return isinstance(exc, grpc.aio.AbortError) or type(exc).__name__ == "AbortError"


def domain_from_method(method: str) -> str:
    """'/astra.dataflow.v1.DataflowService/GetStatus' -> 'astra.dataflow.v1'."""
    service = method.lstrip("/").split("/", 1)[0]
    return service.rsplit(".", 1)[0]
