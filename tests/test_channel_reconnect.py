"""A client's new channel connects at once to a server that is up, whatever another channel
of the process went through at that address before (clients.channel: a local subchannel pool).

gRPC shares connections process-wide by address and channel settings; a new channel would then
inherit an older channel's reconnect backoff and answer "connection refused" from a server that
is up, for as long as that backoff lasts (up to 120 s). A CI run failed so: a weight publish to an
in-process WeightService whose port an earlier test's server had held.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astra.clients.raas import RolloutClient
from astra.servers.runtime import GrpcServer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _refused_then_served(port: int, first, second) -> tuple[grpc.StatusCode, object]:
    """`first` is refused (nothing listens on `port`), a server starts at once there (its
    health SERVING for RolloutService), and `second` asks it: the status `first` got, and what
    `second` got (its answer or error)."""
    try:
        await first()
        refused = grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        refused = exc.code()
    server = GrpcServer("127.0.0.1", port)
    await server.start(serving=True)
    await server.health.set(RolloutClient.SERVICE, health_pb2.HealthCheckResponse.SERVING)
    try:
        try:
            return refused, await second()
        except grpc.aio.AioRpcError as exc:
            return refused, exc.code()
    finally:
        await server.stop(0)


def test_a_new_client_channel_does_not_inherit_a_refused_ones_backoff():
    port = _free_port()
    where = f"127.0.0.1:{port}"

    async def body():
        old, new = RolloutClient(where, timeout_s=5.0), RolloutClient(where, timeout_s=5.0)
        try:
            return await _refused_then_served(
                port,
                lambda: old.check_health(timeout_s=2.0),
                lambda: new.check_health(timeout_s=2.0),
            )
        finally:
            await old.close(0)
            await new.close(0)

    refused, answer = asyncio.run(body())
    assert refused == grpc.StatusCode.UNAVAILABLE  # the old channel found nothing there
    assert answer is True  # the new one reached the server on its first call


def test_shared_channels_do_inherit_it():
    """The control: two plain channels with the same settings share the connection, so the
    second is refused by a server that is up (the behaviour the option above avoids; were gRPC
    to stop sharing, this test would say so and the option could go)."""
    port = _free_port()
    where = f"127.0.0.1:{port}"
    options = [("grpc.initial_reconnect_backoff_ms", 10_000)]

    async def body():
        old = grpc.aio.insecure_channel(where, options=options)
        new = grpc.aio.insecure_channel(where, options=options)
        check = health_pb2.HealthCheckRequest()
        try:
            return await _refused_then_served(
                port,
                lambda: health_pb2_grpc.HealthStub(old).Check(check, timeout=2.0),
                lambda: health_pb2_grpc.HealthStub(new).Check(check, timeout=2.0),
            )
        finally:
            await old.close(None)
            await new.close(None)

    refused, answer = asyncio.run(body())
    assert refused == grpc.StatusCode.UNAVAILABLE
    assert answer == grpc.StatusCode.UNAVAILABLE
