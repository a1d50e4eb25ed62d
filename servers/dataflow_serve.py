"""Starts a Dataflow process's servers: the gRPC DataflowService and the metrics endpoint.

`start_dataflow` builds the coordinator (astra.dataflow.coordinator) over the RaaS connector,
serves it, starts its loops and settles the garbage collector; `astra serve dataflow` and the
tests call it. Wiring only: no request is handled here.
"""

from __future__ import annotations

import gc

from astra.dataflow.coordinator import Dataflow
from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as pb_grpc
from astra.servers.dataflow import DataflowServicer

GC_GEN0_THRESHOLD = 10_000


def _settle_gc() -> None:
    """Keeps Python's cyclic GC off the batch path.

    A full (gen2) collection walks every tracked object: here the buffered groups plus
    everything imported at start-up (gRPC, protobuf, pydantic, numpy), and it ran every few
    seconds under full ingest, pausing the event loop for 50-110 ms. Start-up objects are
    frozen (never walked again; they live for the whole process anyway), and young
    collections run less often, so fewer buffered objects are promoted into gen2.
    """
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), gen1, gen2)


async def start_dataflow(config, connector=None):
    """Builds and starts a Dataflow server; returns (GrpcServer, Dataflow, metrics server)."""
    from astra.clients.rollout_port import connect
    from astra.dataflow.metrics import serve_metrics
    from astra.servers.runtime import GrpcServer, with_raw_responses

    vocab = {p.id: p.vocab_size for p in config.policies if p.vocab_size is not None}
    df = Dataflow(config, connector or connect(config.pool.call_timeout_s, vocab))
    server = GrpcServer(
        config.host, config.port, max_message_bytes=config.max_message_bytes, grace_s=config.grace_s
    )
    name = pb.DESCRIPTOR.services_by_name["DataflowService"].full_name
    # FetchBatch answers chunks serialized ahead (from the stored trajectory bytes) as they are.
    add = with_raw_responses(pb_grpc.add_DataflowServiceServicer_to_server, name, ("FetchBatch",))
    server.add_service(add, DataflowServicer(df), name)
    await server.start()
    await df.start()
    _settle_gc()
    metrics = None
    if config.metrics_port is not None:
        metrics, bound = serve_metrics(df.status, config.host, config.metrics_port)
        metrics.also(server.roles.metrics)
        df.metrics_port = bound
    return server, df, metrics
