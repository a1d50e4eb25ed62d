"""DataflowService servicer: proto -> domain call on `Dataflow` -> proto.

Validation of request shapes happens here (field names are wire names);
every decision is the coordinator's. Errors are raised as domain errors and
mapped to statuses by the server's interceptor.
"""

from __future__ import annotations

import gc
import re
from collections.abc import AsyncIterator

from google.protobuf import json_format

from astra import __version__
from astra.common.v1 import capabilities_pb2
from astra.dataflow.coordinator import Dataflow
from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as pb_grpc
from astra.errors import invalid_field
from astra.protowire import varint
from astra.servers.convert import MAX_ID_CHARS, check_id, trajectories_parts
from astra.servers.weights_convert import identity

CONTRACT_VERSION = "1.0.0"
MAX_LIST = 256
MAX_LABEL_VALUE = 1024
MAX_UNTRAINED_REASON = 64
UNTRAINED_REASON = re.compile(rf"[A-Za-z0-9_]{{0,{MAX_UNTRAINED_REASON}}}")
CHUNK_BYTES = 8 << 20


def _check_list(values, field: str) -> None:
    if len(values) > MAX_LIST:
        raise invalid_field(field, f"more than {MAX_LIST} entries")
    for i, v in enumerate(values):
        check_id(v, f"{field}[{i}]")


def _versions(items) -> tuple[dict[str, int], dict[str, str]]:
    """(counter, identity) per policy claimed: an empty identity is the counter's decimal
    form (the default identity), except with version 0, where it is the weights the
    instance was started with (RegisterInstanceRequest.loaded_versions)."""
    if len(items) > MAX_LIST:
        raise invalid_field("loaded_versions", f"more than {MAX_LIST} entries")
    counters, ids = {}, {}
    for i, v in enumerate(items):
        check_id(v.policy_id, f"loaded_versions[{i}].policy_id")
        identity(v.version_id, f"loaded_versions[{i}].version_id", required=False)
        if v.version < 0:
            raise invalid_field(f"loaded_versions[{i}].version", "must be >= 0")
        counters[v.policy_id] = v.version
        ids[v.policy_id] = v.version_id or (str(v.version) if v.version else "")
    return counters, ids


class DataflowServicer(pb_grpc.DataflowServiceServicer):
    def __init__(self, dataflow: Dataflow) -> None:
        self.df = dataflow

    def _interval(self, resp) -> None:
        resp.heartbeat_interval.FromNanoseconds(int(self.df.config.pool.heartbeat_interval_s * 1e9))
        resp.dataflow_id = self.df.dataflow_id

    async def RegisterInstance(self, request: pb.RegisterInstanceRequest, context):
        check_id(request.instance_id, "instance_id")
        check_id(request.address, "address")
        if request.capacity < 1:
            raise invalid_field("capacity", "must be >= 1")
        if not request.policy_ids:
            raise invalid_field("policy_ids", "at least one policy is required")
        _check_list(request.policy_ids, "policy_ids")
        if not request.workflows:
            raise invalid_field("workflows", "at least one workflow is required")
        _check_list(request.workflows, "workflows")
        if len(request.labels) > MAX_LIST:
            raise invalid_field("labels", f"more than {MAX_LIST} labels")
        for key, value in request.labels.items():
            check_id(key, "labels")
            if len(value) > MAX_LABEL_VALUE:
                raise invalid_field(f"labels[{key}]", f"longer than {MAX_LABEL_VALUE} characters")
        if len(request.contract_version) > MAX_ID_CHARS:
            raise invalid_field("contract_version", f"longer than {MAX_ID_CHARS} characters")
        if len(request.incarnation) > MAX_ID_CHARS:
            raise invalid_field("incarnation", f"longer than {MAX_ID_CHARS} characters")
        counters, ids = _versions(request.loaded_versions)
        already = await self.df.register(
            request.instance_id,
            request.address,
            request.capacity,
            list(request.policy_ids),
            list(request.workflows),
            dict(request.labels),
            counters,
            request.incarnation,
            loaded_ids=ids,
        )
        resp = pb.RegisterInstanceResponse(already_registered=already)
        self._interval(resp)
        return resp

    async def HeartbeatInstance(self, request: pb.HeartbeatInstanceRequest, context):
        check_id(request.instance_id, "instance_id")
        if request.free_slots < 0:
            raise invalid_field("free_slots", "must be >= 0")
        if request.pending_results < 0:
            raise invalid_field("pending_results", "must be >= 0")
        counters, ids = _versions(request.loaded_versions)
        self.df.heartbeat(
            request.instance_id, request.free_slots, counters, request.pending_results, ids
        )
        resp = pb.HeartbeatInstanceResponse()
        self._interval(resp)
        return resp

    async def DeregisterInstance(self, request: pb.DeregisterInstanceRequest, context):
        check_id(request.instance_id, "instance_id")
        return pb.DeregisterInstanceResponse(
            requeued_groups=self.df.deregister(request.instance_id)
        )

    async def FetchBatch(
        self, request: pb.FetchBatchRequest, context
    ) -> AsyncIterator[pb.FetchBatchResponse]:
        check_id(request.policy_id, "policy_id")
        max_wait = request.max_wait.ToNanoseconds() / 1e9 if request.HasField("max_wait") else 10.0
        if max_wait < 0:
            raise invalid_field("max_wait", "must not be negative")
        if request.trainer_version < 0:
            raise invalid_field("trainer_version", "must not be negative")
        if len(request.trainer_id) > MAX_ID_CHARS:
            raise invalid_field("trainer_id", f"longer than {MAX_ID_CHARS} characters")
        # Ingest yields to the trainer from the start when the batch is there to take; if
        # the fetch has to wait for data, not while it waits.
        turn = self.df.trainer_turn()
        try:
            if self.df.batch_ready(request.policy_id, request.num_groups):
                turn.hold()
            batch = await self.df.batches.fetch(
                request.policy_id,
                request.num_groups,
                request.request_id,
                request.trainer_id,
                max_wait,
                on_wait=turn.release,
                trainer_version=request.trainer_version,
            )
            turn.hold()
            header = pb.BatchHeader(
                batch_id=batch.batch_id,
                policy_id=batch.policy_id,
                num_groups=len(batch.groups),
                num_trajectories=batch.num_trajectories,
                policy_version=batch.policy_version,
            )
            header.lease_expire_time.FromNanoseconds(int(batch.lease_expire * 1e9))
            yield pb.FetchBatchResponse(header=header)
            pending: list[tuple[bytes, float]] = []
            size = 0
            max_staleness = 0
            for g in batch.groups:
                max_staleness = max(max_staleness, g.staleness(batch.policy_version))
                group_size = sum(len(t.payload) for t in g.trajectories)
                if pending and size + group_size > CHUNK_BYTES:
                    # Whole groups per message, at most CHUNK_BYTES unless one group is larger
                    # (then alone: at most a CollectResults message, within every default limit).
                    yield _chunk(pending)
                    pending, size = [], 0
                # Stamped by the buffer (and stored with the batch): never made up here.
                for t, adv in zip(g.trajectories, g.advantages, strict=True):
                    pending.append((t.payload, adv))
                size += group_size
            if pending:
                yield _chunk(pending)
            yield pb.FetchBatchResponse(
                footer=pb.BatchFooter(
                    batch_id=batch.batch_id,
                    num_trajectories=batch.num_trajectories,
                    max_staleness=max_staleness,
                    num_replay_groups=sum(1 for g in batch.groups if g.replay),
                )
            )
        finally:
            turn.release()

    async def AckBatch(self, request: pb.AckBatchRequest, context):
        check_id(request.batch_id, "batch_id")
        if not UNTRAINED_REASON.fullmatch(request.untrained_reason):
            raise invalid_field(
                "untrained_reason",
                f"at most {MAX_UNTRAINED_REASON} letters, digits and underscores",
            )
        consumed = self.df.batches.ack(request.batch_id, untrained=request.untrained_reason)
        return pb.AckBatchResponse(consumed_groups=consumed)

    async def ExtendBatchLease(self, request: pb.ExtendBatchLeaseRequest, context):
        check_id(request.batch_id, "batch_id")
        resp = pb.ExtendBatchLeaseResponse()
        expire = self.df.batches.extend(request.batch_id)
        resp.lease_expire_time.FromNanoseconds(int(expire * 1e9))
        return resp

    async def AnnounceVersion(self, request: pb.AnnounceVersionRequest, context):
        v = request.version
        check_id(v.policy_id, "version.policy_id")
        identity(v.version_id, "version.version_id", required=False)  # the RaaS loads it
        check_id(request.weights_address, "weights_address")
        if len(request.trainer_id) > MAX_ID_CHARS:
            raise invalid_field("trainer_id", f"longer than {MAX_ID_CHARS} characters")
        if request.resumed_from_version < 0:
            raise invalid_field("resumed_from_version", "must be >= 0")
        resumed_from = (
            request.resumed_from_version if request.HasField("resumed_from_version") else None
        )
        repeat = self.df.announce(
            v.policy_id,
            v.version,
            v.version_id,
            request.weights_address,
            resumed=request.resumed,
            resumed_from=resumed_from,
        )
        return pb.AnnounceVersionResponse(
            current_version=self.df.versions.current(v.policy_id), already_announced=repeat
        )

    async def GetStatus(self, request: pb.GetStatusRequest, context):
        return json_format.ParseDict(self.df.status(), pb.GetStatusResponse())

    async def GetCapabilities(self, request: pb.GetCapabilitiesRequest, context):
        return pb.GetCapabilitiesResponse(
            capabilities=capabilities_pb2.Capabilities(
                contract_version=CONTRACT_VERSION,
                features=["parquet_datasets", "replay_buffer", "version_barrier"],
                implementation="astra-dataflow",
                implementation_version=__version__,
            )
        )


def _chunk(pending: list[tuple[bytes, float]]) -> bytes:
    """A serialized FetchBatchResponse{trajectories} built from stored bytes, never parsed:
    one copy of the payloads, into the message."""
    parts, size = trajectories_parts(pending)
    return b"".join([_TRAJECTORIES_TAG, varint(size), *parts])


_TRAJECTORIES_TAG = bytes([(2 << 3) | 2])  # FetchBatchResponse.trajectories


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


GC_GEN0_THRESHOLD = 10_000


async def start_dataflow(config, connector=None):
    """Builds and starts a Dataflow server; returns (GrpcServer, Dataflow, metrics server)."""
    from astra.dataflow.metrics import serve_metrics
    from astra.servers.rollout_port import connect
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
