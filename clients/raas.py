"""Typed client of astra.raas.v1.RolloutService (what Dataflow calls)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astra.clients.channel import BaseClient
from astra.common.v1 import rollout_pb2, version_pb2
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.raas.v1 import rollout_service_pb2_grpc as pb_grpc


class RolloutClient(BaseClient):
    SERVICE = "astra.raas.v1.RolloutService"
    # Every RolloutService RPC is idempotent by contract.
    IDEMPOTENT = (
        "SubmitGroups",
        "CollectResults",
        "AckResults",
        "CollectResultBatch",
        "CancelGroups",
        "LoadWeights",
        "GetStatus",
        "GetCapabilities",
    )
    STUB = pb_grpc.RolloutServiceStub
    PB = pb

    def _bind(self, channel: grpc.aio.Channel) -> None:
        super()._bind(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._collect_raw = channel.unary_stream(
            f"/{self.SERVICE}/CollectResults",
            request_serializer=pb.CollectResultsRequest.SerializeToString,
            response_deserializer=None,
        )
        self._collect_batch_raw = channel.unary_unary(
            f"/{self.SERVICE}/CollectResultBatch",
            request_serializer=pb.CollectResultBatchRequest.SerializeToString,
            response_deserializer=None,
        )

    @property
    def health(self) -> health_pb2_grpc.HealthStub:
        self._follow_renewal()
        return self._health

    async def submit_groups(
        self, groups: Sequence[rollout_pb2.PromptGroup], *, timeout_s: float | None = None
    ) -> pb.SubmitGroupsResponse:
        return await self.stub.SubmitGroups(
            pb.SubmitGroupsRequest(groups=groups), timeout=self._timeout(timeout_s)
        )

    async def collect_results(
        self, max_groups: int, max_wait_s: float = 0.0, *, timeout_s: float | None = None
    ) -> list[rollout_pb2.GroupResult]:
        req = pb.CollectResultsRequest(max_groups=max_groups)
        req.max_wait.FromNanoseconds(int(max_wait_s * 1e9))
        call = self.stub.CollectResults(req, timeout=self._timeout(timeout_s) + max_wait_s)
        return [msg.result async for msg in call]

    async def collect_results_raw(
        self, max_groups: int, max_wait_s: float = 0.0, *, timeout_s: float | None = None
    ) -> list[bytes]:
        """Like collect_results, but each item is the serialized CollectResultsResponse.

        For receivers that keep the bytes (Dataflow stores trajectories as received).
        """
        req = pb.CollectResultsRequest(max_groups=max_groups)
        req.max_wait.FromNanoseconds(int(max_wait_s * 1e9))
        self._follow_renewal()
        call = self._collect_raw(req, timeout=self._timeout(timeout_s) + max_wait_s)
        return [msg async for msg in call]

    async def collect_result_batch_raw(
        self,
        ack_group_ids: Sequence[str],
        max_groups: int,
        max_wait_s: float = 0.0,
        *,
        timeout_s: float | None = None,
    ) -> bytes:
        """CollectResultBatch: acknowledges `ack_group_ids`, then collects; returns the
        serialized CollectResultBatchResponse (each `results` entry a GroupResult as sent)."""
        req = pb.CollectResultBatchRequest(ack_group_ids=ack_group_ids, max_groups=max_groups)
        req.max_wait.FromNanoseconds(int(max_wait_s * 1e9))
        self._follow_renewal()
        return await self._collect_batch_raw(req, timeout=self._timeout(timeout_s) + max_wait_s)

    async def ack_results(
        self, group_ids: Sequence[str], *, timeout_s: float | None = None
    ) -> pb.AckResultsResponse:
        return await self.stub.AckResults(
            pb.AckResultsRequest(group_ids=group_ids), timeout=self._timeout(timeout_s)
        )

    async def cancel_groups(
        self, group_ids: Sequence[str], *, timeout_s: float | None = None
    ) -> pb.CancelGroupsResponse:
        return await self.stub.CancelGroups(
            pb.CancelGroupsRequest(group_ids=group_ids), timeout=self._timeout(timeout_s)
        )

    async def load_weights(
        self,
        versions: Sequence[version_pb2.PolicyVersion],
        weights_address: str,
        request_id: str,
        *,
        policy_weights_addresses: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> pb.LoadWeightsResponse:
        req = pb.LoadWeightsRequest(
            versions=versions,
            weights_address=weights_address,
            request_id=request_id,
            policy_weights_addresses=policy_weights_addresses or {},
        )
        return await self.stub.LoadWeights(req, timeout=self._timeout(timeout_s))

    async def check_health(self, *, timeout_s: float | None = None) -> bool:
        """True when the instance's grpc.health.v1 answers SERVING."""
        resp = await self.health.Check(
            health_pb2.HealthCheckRequest(service=self.SERVICE), timeout=self._timeout(timeout_s)
        )
        return resp.status == health_pb2.HealthCheckResponse.SERVING
