"""Typed client of astra.trainer.v1.TrainerService."""

from __future__ import annotations

from astra.clients.channel import BaseClient
from astra.trainer.v1 import trainer_service_pb2 as pb
from astra.trainer.v1 import trainer_service_pb2_grpc as pb_grpc


class TrainerClient(BaseClient):
    SERVICE = "astra.trainer.v1.TrainerService"
    IDEMPOTENT = ("GetStatus", "SaveCheckpoint", "GetCapabilities", "Pause", "Resume")
    STUB = pb_grpc.TrainerServiceStub
    PB = pb

    async def save_checkpoint(
        self, request_id: str, *, timeout_s: float | None = None
    ) -> pb.SaveCheckpointResponse:
        return await self.stub.SaveCheckpoint(
            pb.SaveCheckpointRequest(request_id=request_id), timeout=self._timeout(timeout_s)
        )

    async def pause(
        self, reason: str = "", *, wait: bool = False, timeout_s: float | None = None
    ) -> pb.PauseResponse:
        return await self.stub.Pause(
            pb.PauseRequest(reason=reason, wait=wait), timeout=self._timeout(timeout_s)
        )

    async def resume(self, *, timeout_s: float | None = None) -> pb.ResumeResponse:
        return await self.stub.Resume(pb.ResumeRequest(), timeout=self._timeout(timeout_s))
