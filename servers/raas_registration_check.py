"""The checking DataflowService of `astra raas check --as-dataflow`: what a RaaS registers.

A real gRPC DataflowService that a RaaS under test registers with, as it would with
Dataflow. It answers RegisterInstance (heartbeat interval `Recording.interval_s`),
HeartbeatInstance (NOT_FOUND, reason INSTANCE_NOT_REGISTERED, for an instance it does not
know or was told to forget) and DeregisterInstance, records every call in an
astra.raas.registration_record.Recording, and refuses the rest (UNIMPLEMENTED). It never
dispatches work: the rules are judged by astra.clients.raas_check_registration.
"""

from __future__ import annotations

from google.protobuf import duration_pb2

from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as pb_grpc
from astra.errors import NotFound
from astra.raas.registration_record import Recording
from astra.servers.runtime import GrpcServer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DataflowService"].full_name
DATAFLOW_ID = "astra-raas-check"


class CheckingDataflow(pb_grpc.DataflowServiceServicer):
    def __init__(self, recording: Recording) -> None:
        self.recording = recording

    def _interval(self) -> duration_pb2.Duration:
        out = duration_pb2.Duration()
        out.FromNanoseconds(int(self.recording.interval_s * 1e9))
        return out

    async def RegisterInstance(self, request: pb.RegisterInstanceRequest, context):
        self.recording.register(request)
        return pb.RegisterInstanceResponse(
            heartbeat_interval=self._interval(), dataflow_id=DATAFLOW_ID
        )

    async def HeartbeatInstance(self, request: pb.HeartbeatInstanceRequest, context):
        if self.recording.heartbeat(request):
            raise NotFound(
                f"instance {request.instance_id!r} is not registered",
                reason="INSTANCE_NOT_REGISTERED",
                metadata={"field": "instance_id"},
            )
        return pb.HeartbeatInstanceResponse(
            heartbeat_interval=self._interval(), dataflow_id=DATAFLOW_ID
        )

    async def DeregisterInstance(self, request: pb.DeregisterInstanceRequest, context):
        self.recording.deregister(request)
        return pb.DeregisterInstanceResponse()


async def start_checking_dataflow(
    recording: Recording, host: str = "127.0.0.1", port: int = 0
) -> GrpcServer:
    server = GrpcServer(host, port, grace_s=0)
    servicer = CheckingDataflow(recording)
    server.add_service(pb_grpc.add_DataflowServiceServicer_to_server, servicer, SERVICE_NAME)
    await server.start(serving=True)
    return server
