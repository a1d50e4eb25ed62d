"""Starts a WeightService: the servicer over an open store, its bulk streams passed as bytes.

`start_weights` opens (recovers) the store and serves it; `serve_weights` is `astra serve
weights` (until SIGTERM, with a metrics endpoint when asked); `add_weight_service` registers
the generated handlers with FetchVersion's chunks and PublishVersion's chunk requests kept as
wire bytes (astra.weights.wire). Wiring only: every request is the servicer's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import grpc

from astra.servers.runtime import GrpcServer
from astra.servers.weights import SERVICE_NAME, WeightServicer
from astra.servers.weights_fetch import StreamSettings
from astra.weights.malloc import keep_freed_memory
from astra.weights.store import Store, StoreConfig
from astra.weights.v1 import weight_service_pb2 as pb
from astra.weights.v1 import weight_service_pb2_grpc as pb_grpc
from astra.weights.wire import deserializer, serialize

log = logging.getLogger("astra.servers.weights")


def add_weight_service(servicer: WeightServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with the two streams' bulk messages passed as wire bytes.

    FetchVersion's responses may be wire bytes (chunks) and PublishVersion's
    chunk requests arrive as WireChunk views; the rest is protobuf.
    """

    class Capture:
        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
            self.name, self.handlers = name, dict(handlers)

    capture = Capture()
    pb_grpc.add_WeightServiceServicer_to_server(servicer, capture)
    handlers = capture.handlers
    handlers["FetchVersion"] = grpc.stream_stream_rpc_method_handler(
        servicer.FetchVersion,
        request_deserializer=pb.FetchVersionRequest.FromString,
        response_serializer=serialize,
    )
    handlers["PublishVersion"] = grpc.stream_stream_rpc_method_handler(
        servicer.PublishVersion,
        request_deserializer=deserializer(pb.PublishVersionRequest.FromString),
        response_serializer=pb.PublishVersionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.name, handlers),))
    server.add_registered_method_handlers(capture.name, handlers)


class WeightServer(GrpcServer):
    """A GrpcServer running WeightService over one store."""

    store: Store
    servicer: WeightServicer


async def start_weights(
    store_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    config: StoreConfig | None = None,
    settings: StreamSettings | None = None,
    store: Store | None = None,
    grace_s: float = 5.0,
) -> WeightServer:
    """Opens the store (recovering it), then serves; health is SERVING once the store is open."""
    keep_freed_memory()  # chunk buffers come back from the heap, not as fresh pages
    server = WeightServer(host, port, grace_s=grace_s)
    server.store = store if store is not None else await asyncio.to_thread(Store, store_dir, config)
    server.servicer = WeightServicer(server.store, settings)
    server.add_service(add_weight_service, server.servicer, SERVICE_NAME)
    await server.start(serving=True)
    return server


async def serve_weights(
    store_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 50052,
    *,
    config: StoreConfig | None = None,
    settings: StreamSettings | None = None,
    metrics_port: int | None = None,
) -> None:
    """`astra serve weights`: serves until SIGTERM/SIGINT; prints one JSON line with the address
    (and the Prometheus port when `metrics_port` is not None)."""
    from astra.servers.runtime import serve_until_signal
    from astra.stop_deadline import STOP_DEADLINE_S

    server = await start_weights(store_dir, host, port, config=config, settings=settings)
    metrics = None
    if metrics_port is not None:
        from astra.weights.metrics import WeightMetrics

        metrics = server.servicer.metrics = WeightMetrics(server.servicer)
        metrics.also(server.roles.metrics)
        metrics.serve(host, metrics_port)
    line: dict[str, object] = {"service": "weights", "address": server.address}
    line["metrics_port"] = metrics.port if metrics is not None else None
    print(json.dumps(line), flush=True)
    log.info("weights serving %s on %s", store_dir, server.address)
    try:
        await serve_until_signal(server, deadline_s=STOP_DEADLINE_S)
    finally:
        if metrics is not None:
            metrics.shutdown()
    log.info("weights stopped")
