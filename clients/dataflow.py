"""Typed client of astra.dataflow.v1.DataflowService."""

from __future__ import annotations

from collections.abc import AsyncIterator

from astra.clients.channel import BaseClient
from astra.common.v1 import version_pb2
from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as pb_grpc


class DataflowClient(BaseClient):
    SERVICE = "astra.dataflow.v1.DataflowService"
    # FetchBatch is idempotent too, but its UNAVAILABLE usually means BATCH_NOT_READY,
    # which the trainer wants to see (with the reason) rather than have retried blindly.
    IDEMPOTENT = (
        "RegisterInstance",
        "HeartbeatInstance",
        "DeregisterInstance",
        "AckBatch",
        "ExtendBatchLease",
        "AnnounceVersion",
        "GetStatus",
        "GetCapabilities",
    )
    STUB = pb_grpc.DataflowServiceStub
    PB = pb

    async def register_instance(
        self, request: pb.RegisterInstanceRequest, *, timeout_s: float | None = None
    ) -> pb.RegisterInstanceResponse:
        return await self.stub.RegisterInstance(request, timeout=self._timeout(timeout_s))

    async def heartbeat_instance(
        self, request: pb.HeartbeatInstanceRequest, *, timeout_s: float | None = None
    ) -> pb.HeartbeatInstanceResponse:
        return await self.stub.HeartbeatInstance(request, timeout=self._timeout(timeout_s))

    async def deregister_instance(
        self, instance_id: str, *, timeout_s: float | None = None
    ) -> pb.DeregisterInstanceResponse:
        return await self.stub.DeregisterInstance(
            pb.DeregisterInstanceRequest(instance_id=instance_id), timeout=self._timeout(timeout_s)
        )

    def fetch_batch_stream(
        self,
        policy_id: str,
        num_groups: int,
        request_id: str,
        *,
        trainer_id: str = "",
        max_wait_s: float = 10.0,
        timeout_s: float | None = None,
        trainer_version: int = 0,
    ) -> AsyncIterator[pb.FetchBatchResponse]:
        req = pb.FetchBatchRequest(
            policy_id=policy_id, num_groups=num_groups, request_id=request_id, trainer_id=trainer_id
        )
        req.trainer_version = trainer_version
        req.max_wait.FromNanoseconds(int(max_wait_s * 1e9))
        timeout = self._timeout(timeout_s) + max_wait_s
        return self.stub.FetchBatch(req, timeout=timeout)

    async def fetch_batch(
        self, policy_id: str, num_groups: int, request_id: str, **kwargs: object
    ) -> tuple[pb.BatchHeader, list, pb.BatchFooter]:
        """The whole batch: header, trajectories, footer. Raises if the footer is missing."""
        header = footer = None
        trajectories: list = []
        async for msg in self.fetch_batch_stream(policy_id, num_groups, request_id, **kwargs):
            part = msg.WhichOneof("part")
            if part == "header":
                header = msg.header
            elif part == "trajectories":
                trajectories.extend(msg.trajectories.trajectories)
            elif part == "footer":
                footer = msg.footer
        if header is None or footer is None:
            raise ConnectionError("batch stream ended without header or footer")
        return header, trajectories, footer

    async def ack_batch(
        self, batch_id: str, *, untrained_reason: str = "", timeout_s: float | None = None
    ) -> pb.AckBatchResponse:
        """`untrained_reason`: why no step was taken on the batch (empty: it was trained)."""
        return await self.stub.AckBatch(
            pb.AckBatchRequest(batch_id=batch_id, untrained_reason=untrained_reason),
            timeout=self._timeout(timeout_s),
        )

    async def extend_batch_lease(
        self, batch_id: str, *, timeout_s: float | None = None
    ) -> pb.ExtendBatchLeaseResponse:
        return await self.stub.ExtendBatchLease(
            pb.ExtendBatchLeaseRequest(batch_id=batch_id), timeout=self._timeout(timeout_s)
        )

    async def announce_version(
        self,
        policy_id: str,
        version: int,
        weights_address: str,
        *,
        version_id: str = "",
        trainer_id: str = "",
        resumed: bool = False,
        resumed_from_version: int | None = None,
        timeout_s: float | None = None,
    ) -> pb.AnnounceVersionResponse:
        """`resumed_from_version`: with `resumed`, the version of the weights the trainer
        continues from (its checkpoint's); None leaves the field unset."""
        req = pb.AnnounceVersionRequest(
            resumed=resumed,
            resumed_from_version=resumed_from_version,
            version=version_pb2.PolicyVersion(
                policy_id=policy_id, version=version, version_id=version_id or str(version)
            ),
            weights_address=weights_address,
            trainer_id=trainer_id,
        )
        return await self.stub.AnnounceVersion(req, timeout=self._timeout(timeout_s))
