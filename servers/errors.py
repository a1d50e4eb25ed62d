"""One place where domain errors become gRPC statuses.

`ErrorInterceptor` wraps every handler of a server: an `AstraError` becomes
its canonical code with a google.rpc.ErrorInfo (domain = the proto package),
BadRequest field violations and RetryInfo; any other exception becomes
INTERNAL with reason INTERNAL_ERROR and is logged, so a bug in one call
never takes the server down. A request message that does not parse (corrupt
bytes, bad UTF-8 in a string) is INVALID_ARGUMENT with reason MALFORMED_REQUEST,
in a request stream too, rather than gRPC's own UNKNOWN without details.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from astra.errors import AstraError, InvalidArgument
from astra.waits import within

log = logging.getLogger(__name__)


# Messages and dynamic values echo the request (ids, names, keys); clipped so that a status
# fits the trailers a client accepts (gRPC's default limit is 8 KiB, and grpc-message is
# percent-encoded: up to 3 characters a byte). A metadata value keeps a 1024-character ASCII
# name (a tensor's, at most 1024 characters).
MAX_MESSAGE_BYTES = 512
# A refused streaming request waits this long for the caller's first message (see `settle`).
FIRST_MESSAGE_WAIT_S = 1.0
MAX_VALUE_BYTES = 1024
MAX_FIELD_BYTES = 256


def _clip(text: str, limit: int) -> str:
    """`text` within `limit` UTF-8 bytes; its middle elided, so the start and the end (which
    says what is wrong with the value) both stay."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    half = (limit - 3) // 2
    return raw[:half].decode(errors="ignore") + "..." + raw[-half:].decode(errors="ignore")


def status_for(exc: AstraError, domain: str) -> grpc.Status:
    details = []
    metadata = {k: _clip(v, MAX_VALUE_BYTES) for k, v in exc.metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=exc.reason, domain=domain, metadata=metadata)
    details.append(info)
    if exc.field_violations:
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=_clip(f, MAX_FIELD_BYTES), description=_clip(d, MAX_MESSAGE_BYTES)
                    )
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
        code=code_pb2.Code.Value(exc.code),
        message=_clip(exc.message, MAX_MESSAGE_BYTES),
        details=packed,
    )
    return rpc_status.to_status(proto)


def _internal(domain: str, exc: BaseException) -> grpc.Status:
    err = AstraError(f"internal error: {type(exc).__name__}: {exc}", reason="INTERNAL_ERROR")
    return status_for(err, domain)


class _Undecodable:
    """What a request deserializer returned for bytes that do not parse."""

    __slots__ = ("error",)

    def __init__(self, exc: Exception) -> None:
        self.error = InvalidArgument(
            f"the request message does not parse: {type(exc).__name__}: {exc}",
            reason="MALFORMED_REQUEST",
        )


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """The deserializer, with a failure handed to the handler instead of raised inside gRPC
    (where it would end the call UNKNOWN, without ErrorInfo)."""
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:
            return _Undecodable(exc)

    return parse


def _parsed(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise request.error
    return request


class _ParsedRequests:
    """A request stream that raises INVALID_ARGUMENT at a message that did not parse.

    Iterating it again continues the same stream, as gRPC's request iterator does.
    """

    def __init__(
        self,
        requests: Any,
        first: Callable[[Any], None] | None = None,
        each: Callable[[], None] | None = None,
    ) -> None:
        self._requests = requests
        self._it: Any = None
        self._first = first  # a check of the first message (its policy scope), then none
        self._each = each  # a check before every later message (the caller still allowed)

    def __aiter__(self) -> _ParsedRequests:
        return self

    async def __anext__(self) -> Any:
        if self._it is None:
            self._it = aiter(self._requests)
        message = _parsed(await anext(self._it))
        if self._first is not None:
            check, self._first = self._first, None
            check(message)
        elif self._each is not None:
            self._each()
        return message


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by handlers to statuses, for all four RPC shapes.

    `guard_of(method)`, where given, returns a check to run on the call's context before the
    handler (servers.authz: the caller's roles), or None; what it raises is mapped the same way.
    The check may return (first, each): a check of the request (of a stream's first message:
    the caller's policy scope), run before the handler sees it, and a check run before every
    later message a stream reads or sends (the caller's certificate not revoked since), either
    None.
    """

    def __init__(
        self,
        domain_of: Callable[[str], str],
        guard_of: Callable[[str], Callable[[Any], Callable[[Any], None] | None] | None]
        | None = None,
    ) -> None:
        self._domain_of = domain_of
        self._guard_of = guard_of

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        domain = self._domain_of(handler_call_details.method)
        guard = self._guard_of(handler_call_details.method) if self._guard_of else None

        async def fail(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
            if isinstance(exc, AstraError):
                await context.abort_with_status(status_for(exc, domain))
            log.exception("unhandled error in %s", handler_call_details.method)
            await context.abort_with_status(_internal(domain, exc))

        async def settle(request: Any, stream_in: bool) -> None:
            """Before a streaming request is refused at its start, its first message is taken
            (for at most FIRST_MESSAGE_WAIT_S; the handler never sees it). A refusal that
            overtakes the caller's first write makes gRPC Python end the call with its own
            INTERNAL at the caller, and the refusal's status and reason are lost to it."""
            if stream_in:
                with contextlib.suppress(Exception):
                    await within(anext(aiter(request)), FIRST_MESSAGE_WAIT_S)

        def prepare(
            request: Any, context: grpc.aio.ServicerContext, stream_in: bool
        ) -> tuple[Any, Callable[[], None] | None]:
            """The caller's roles checked, the request parsed (and its policy scope checked:
            a stream's as its first message comes); and the check before each later message."""
            first, each = (guard(context) if guard is not None else None) or (None, None)
            if stream_in:
                return _ParsedRequests(request, first, each), each
            request = _parsed(request)
            if first is not None:
                first(request)
            return request, each

        def wrap_unary(behavior: Callable[..., Any], stream_in: bool) -> Callable[..., Any]:
            async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    parsed, _ = prepare(request, context, stream_in)
                except Exception as exc:
                    await settle(request, stream_in)
                    await fail(context, exc)
                try:
                    return await behavior(parsed, context)
                except Exception as exc:
                    if _is_abort(exc):
                        raise
                    await fail(context, exc)

            return run

        def wrap_stream(behavior: Callable[..., Any], stream_in: bool) -> Callable[..., Any]:
            async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    parsed, each = prepare(request, context, stream_in)
                except Exception as exc:
                    await settle(request, stream_in)
                    await fail(context, exc)
                try:
                    sent = False
                    async for item in behavior(parsed, context):
                        if sent and each is not None:
                            each()
                        yield item
                        sent = True
                except Exception as exc:
                    if _is_abort(exc):
                        raise
                    await fail(context, exc)

            return run

        h = handler
        parse = _tolerant(h.request_deserializer)
        if h.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(h.unary_unary, False), parse, h.response_serializer
            )
        if h.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(h.unary_stream, False), parse, h.response_serializer
            )
        if h.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(h.stream_unary, True), parse, h.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            wrap_stream(h.stream_stream, True), parse, h.response_serializer
        )


def _is_abort(exc: BaseException) -> bool:
    # context.abort() raises AbortError; it has already set the status.
    return isinstance(exc, grpc.aio.AbortError) or type(exc).__name__ == "AbortError"


def domain_from_method(method: str) -> str:
    """'/astra.dataflow.v1.DataflowService/GetStatus' -> 'astra.dataflow.v1'."""
    service = method.lstrip("/").split("/", 1)[0]
    return service.rsplit(".", 1)[0]
