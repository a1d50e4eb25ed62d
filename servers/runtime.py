"""Runs a grpc.aio server the way every Astra service needs it.

Health (grpc.health.v1) and reflection are always registered; message-size
limits are explicit; errors are mapped by one interceptor; SIGTERM and SIGINT
mark the server NOT_SERVING, drain in-flight RPCs for a grace period and
return, so the process exits 0. The port is mutual TLS when the process's
environment names the run's credentials (astra.tls): only clients with a
certificate of the run's CA get through the handshake.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from astra import stop_deadline
from astra.logs import dump_stacks_on, dump_tasks
from astra.servers.authz import RoleGuard
from astra.servers.errors import ErrorInterceptor, domain_from_method
from astra.servers.reflection import Reflection
from astra.tls import TlsFiles, tls_files
from astra.tls_material import TlsMaterial
from astra.waits import cancel_and_wait


class PortUnavailable(OSError):
    """The address cannot be listened on (in use, or not this machine's); one line says so."""

    def __init__(self, where: str) -> None:
        super().__init__(
            f"cannot listen on {where}: the port is in use (or the host is not this machine's). "
            f"Stop what holds it (ss -ltnp | grep :{where.rsplit(':', 1)[-1]}), or give "
            "another --port (0: any free one)."
        )


def _in_use(host: str, port: int) -> bool:
    """Whether binding `host:port` fails with EADDRINUSE (probed as gRPC binds: SO_REUSEADDR,
    no SO_REUSEPORT); other failures are left for gRPC to report."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
    except OSError:
        return False
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Mutual TLS whose certificate and CA follow `files`: gRPC asks before each handshake,
    and gets a new configuration once the files changed into a usable set (astra.tls)."""

    def config(m: TlsMaterial) -> Any:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.ca)

    material = files.material
    assert material is not None
    served = [material]

    def fetch() -> Any:
        try:
            now = files.refresh()
            if now is None or now is served[0]:
                return None  # no change: gRPC keeps the configuration it has
            served[0] = now
            return config(now)
        except Exception:  # called from gRPC's threads: never raise into them
            log.exception("reading the TLS files again failed; the credentials in use stay")
            return None

    return grpc.dynamic_ssl_server_credentials(
        config(material), fetch, require_client_authentication=True
    )


def install_event_loop_policy() -> None:
    """Use uvloop where it is installed; the default loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def passthrough(message: Any) -> bytes:
    """A response serializer: bytes (a message serialized ahead) go out as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def with_raw_responses(
    add_fn: Callable[[Any, Any], None], full_name: str, methods: tuple[str, ...]
) -> Callable[[Any, grpc.aio.Server], None]:
    """`add_fn` (a generated add_*Servicer_to_server) whose `methods` (unary or
    server-streaming) may return or yield the wire bytes of their response messages
    instead of messages."""

    def add(servicer: Any, server: grpc.aio.Server) -> None:
        class _Capture:
            def add_generic_rpc_handlers(self, handlers) -> None:
                pass

            def add_registered_method_handlers(self, service, handlers) -> None:
                self.handlers = handlers

        capture = _Capture()
        add_fn(servicer, capture)
        handlers = dict(capture.handlers)
        for method in methods:
            h = handlers[method]
            handlers[method] = (
                grpc.unary_stream_rpc_method_handler(
                    h.unary_stream, h.request_deserializer, passthrough
                )
                if h.response_streaming
                else grpc.unary_unary_rpc_method_handler(
                    h.unary_unary, h.request_deserializer, passthrough
                )
            )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(full_name, handlers),)
        )
        server.add_registered_method_handlers(full_name, handlers)

    return add


class GrpcServer:
    """A grpc.aio server with health, reflection and error mapping."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        grace_s: float = 10.0,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.grace_s = grace_s
        self.port = 0
        self.tls = False
        self._services: list[str] = []
        self.roles = RoleGuard()  # on with mutual TLS: callers confined to their roles
        self._server = grpc.aio.server(
            interceptors=[ErrorInterceptor(domain_from_method, self.roles.guard)],
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    def add_service(
        self, add_fn: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str
    ) -> None:
        add_fn(servicer, self._server)
        self._services.append(full_name)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._services]:
            await self.health.set(name, status)

    async def start(self, *, serving: bool = True) -> int:
        # v1 and v1alpha, from the protos with their comments (servers/reflection.py)
        served = Reflection([*self._services, health.SERVICE_NAME])
        self._server.add_generic_rpc_handlers(served.handlers())
        where = f"{self.host}:{self.requested_port}"
        if self.requested_port and _in_use(self.host, self.requested_port):
            raise PortUnavailable(where)  # before gRPC's core logs its own lines about it
        files = tls_files()
        try:
            if files is None:
                self.port = self._server.add_insecure_port(where)
            else:
                self.port = self._server.add_secure_port(where, server_credentials(files))
                source = files.material.source if files.material is not None else ""
                log.info("mutual TLS on %s (%s)", where, source)
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            raise PortUnavailable(where) from exc
        self.tls = files is not None
        self.roles.enable(files)
        if self.port == 0:
            raise PortUnavailable(where)
        await self._server.start()
        await self.set_serving(serving)
        return self.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        await self._server.stop(self.grace_s if grace_s is None else grace_s)

    async def wait(self) -> None:
        await self._server.wait_for_termination()


async def serve_until_signal(
    server: GrpcServer,
    *,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    deadline_s: float | None = None,
) -> None:
    """Wait for SIGTERM/SIGINT, then drain in-flight RPCs and stop. With `deadline_s` (a
    service's own process: `astra serve`), a stop still going `deadline_s` past the drain
    period ends the process (astra.stop_deadline)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    dump_on_sigusr1(loop)
    waiter = asyncio.create_task(server.wait())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping: draining in-flight RPCs for up to %.1fs", server.grace_s)
    if deadline_s is not None:
        served = [name.rsplit(".", 1)[-1] for name in server._services]
        stop_deadline.arm(server.grace_s + deadline_s, ", ".join(served) or "server")
    await server.stop()
    if on_stop is not None:
        await on_stop()
    for t in (waiter, stopper):
        await cancel_and_wait(t)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


def dump_on_sigusr1(loop: asyncio.AbstractEventLoop) -> None:
    """`kill -USR1`: every thread's stack at once (C, even with the loop blocked), then every
    task's from the loop (astra.logs), to stderr. For as long as the process lives: a stop
    that hangs is when it is needed."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None:
        return
    faulthandler.unregister(usr1)  # astra.logs's, installed first, would be left behind
    loop.add_signal_handler(usr1, dump_tasks, sys.stderr)
    dump_stacks_on(sys.stderr, chain=True)
