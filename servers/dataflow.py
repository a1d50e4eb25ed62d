"""DataflowService servicer: proto -> domain call on `Dataflow` -> proto.

Request shapes are checked by their wire names first (servers/dataflow_checks.py); every
decision is the coordinator's. Errors are raised as domain errors and mapped to statuses by
the server's interceptor. A batch is streamed as servers/dataflow_batch.py shapes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from google.protobuf import json_format

from astra import __version__
from astra.common.v1 import capabilities_pb2
from astra.dataflow.coordinator import Dataflow
from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as pb_grpc
from astra.servers import dataflow_checks as checks
from astra.servers.checks import check_id
from astra.servers.dataflow_batch import batch_messages

CONTRACT_VERSION = "1.0.0"


class DataflowServicer(pb_grpc.DataflowServiceServicer):
    def __init__(self, dataflow: Dataflow) -> None:
        self.df = dataflow

    def _interval(self, resp) -> None:
        resp.heartbeat_interval.FromNanoseconds(int(self.df.config.pool.heartbeat_interval_s * 1e9))
        resp.dataflow_id = self.df.dataflow_id

    async def RegisterInstance(self, request: pb.RegisterInstanceRequest, context):
        checks.check_register(request)
        counters, ids = checks.versions(request.loaded_versions)
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
        checks.check_heartbeat(request)
        counters, ids = checks.versions(request.loaded_versions)
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

    async def FetchBatch(self, request: pb.FetchBatchRequest, context) -> AsyncIterator:
        max_wait = checks.check_fetch(request)
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
            for message in batch_messages(batch):
                yield message
        finally:
            turn.release()

    async def AckBatch(self, request: pb.AckBatchRequest, context):
        checks.check_ack(request)
        consumed = self.df.batches.ack(request.batch_id, untrained=request.untrained_reason)
        return pb.AckBatchResponse(consumed_groups=consumed)

    async def ExtendBatchLease(self, request: pb.ExtendBatchLeaseRequest, context):
        check_id(request.batch_id, "batch_id")
        resp = pb.ExtendBatchLeaseResponse()
        expire = self.df.batches.extend(request.batch_id)
        resp.lease_expire_time.FromNanoseconds(int(expire * 1e9))
        return resp

    async def AnnounceVersion(self, request: pb.AnnounceVersionRequest, context):
        resumed_from = checks.check_announce(request)
        v = request.version
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
