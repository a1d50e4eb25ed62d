"""Typed client of astra.weights.v1.WeightService (unary RPCs).

Publishing and fetching are bidirectional streams with their own resume
protocol; their drivers belong to the WeightService issue and use `stub`.
"""

from __future__ import annotations

from astra.clients.channel import BaseClient
from astra.weights.v1 import weight_service_pb2 as pb
from astra.weights.v1 import weight_service_pb2_grpc as pb_grpc


class WeightClient(BaseClient):
    SERVICE = "astra.weights.v1.WeightService"
    IDEMPOTENT = ("ListVersions", "GetVersion", "RollbackVersion", "GetStatus", "GetCapabilities")

    def __init__(self, address: str, *, timeout_s: float = 30.0) -> None:
        super().__init__(address, timeout_s=timeout_s)
        self.stub = pb_grpc.WeightServiceStub(self.channel)

    async def list_versions(
        self,
        policy_id: str,
        *,
        page_size: int = 100,
        page_token: str = "",
        timeout_s: float | None = None,
    ) -> pb.ListVersionsResponse:
        req = pb.ListVersionsRequest(
            policy_id=policy_id, page_size=page_size, page_token=page_token
        )
        return await self.stub.ListVersions(req, timeout=self._timeout(timeout_s))

    async def get_version(
        self, policy_id: str, version_id: str, *, timeout_s: float | None = None
    ) -> pb.GetVersionResponse:
        req = pb.GetVersionRequest(policy_id=policy_id, version_id=version_id)
        return await self.stub.GetVersion(req, timeout=self._timeout(timeout_s))

    async def rollback_version(
        self, request: pb.RollbackVersionRequest, *, timeout_s: float | None = None
    ) -> pb.RollbackVersionResponse:
        return await self.stub.RollbackVersion(request, timeout=self._timeout(timeout_s))

    async def get_status(self, *, timeout_s: float | None = None) -> pb.GetStatusResponse:
        return await self.stub.GetStatus(pb.GetStatusRequest(), timeout=self._timeout(timeout_s))

    async def get_capabilities(
        self, *, timeout_s: float | None = None
    ) -> pb.GetCapabilitiesResponse:
        return await self.stub.GetCapabilities(
            pb.GetCapabilitiesRequest(), timeout=self._timeout(timeout_s)
        )
