"""TrainerService servicer and `serve_trainer`: the training loop and its control surface.

One process (rank 0 under torchrun) runs the Trainer loop and a grpc.aio
server on the same event loop; training compute runs on the trainer's
worker thread, so status calls are answered during a step. Health is
NOT_SERVING until the model is loaded and versions are agreed, then
SERVING. Ranks > 0 only follow rank 0's broadcasts and serve nothing.
SaveCheckpoint is idempotent by request_id and served between steps. Pause
stops new steps after the one in progress (Resume lets them go on); both are
idempotent. SIGTERM/SIGINT: the step in progress finishes, what is queued is
published and the last step checkpointed (Trainer.stop, within
checkpoint.stop_timeout_s), so a resume retakes nothing. The training steps
and a follower's life are astra.trainer.serving's; here only the RPCs, the
server and the signals of rank 0.
"""

from __future__ import annotations

import logging
from typing import Any

from astra import __version__
from astra.common.v1 import capabilities_pb2
from astra.errors import FailedPrecondition, Unavailable, invalid_field
from astra.servers.checks import check_id
from astra.trainer.loop import Trainer
from astra.trainer.serving import train_steps as _train  # noqa: F401 (tests import it here)
from astra.trainer.v1 import trainer_service_pb2 as pb
from astra.trainer.v1 import trainer_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
CONTRACT_VERSION = "1.0.0"
MAX_REASON_CHARS = 256
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TrainerService"].full_name


class TrainerServicer(pb_grpc.TrainerServiceServicer):
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.GetStatusResponse:
        t = self.trainer
        resp = pb.GetStatusResponse(
            policy_id=t.config.policy_id,
            step=t.step,
            version=t.publisher.stats.last_published if t.initialized else -1,
            world_size=t.world_size,
            paused=t.paused,
            pause_reason=t.pause_reason,
            step_in_progress=t.step_in_progress,
        )
        if t.last is not None:
            resp.loss = float(t.last.metrics.get("loss", float("nan")))
            resp.metrics.update({k: float(v) for k, v in t.last.metrics.items()})
        if t.last_checkpoint is not None:
            resp.last_checkpoint_path = str(t.last_checkpoint)
        if t.last_checkpoint_time is not None:
            resp.last_checkpoint_time.FromDatetime(t.last_checkpoint_time)
        return resp

    async def SaveCheckpoint(
        self, request: pb.SaveCheckpointRequest, context: Any
    ) -> pb.SaveCheckpointResponse:
        check_id(request.request_id, "request_id")
        self._started()
        if self.trainer.config.checkpoint.dir is None:
            raise FailedPrecondition(
                "no checkpoint directory configured", reason="NO_CHECKPOINT_DIR"
            )
        path, step = await self.trainer.checkpoint_async(request.request_id)
        return pb.SaveCheckpointResponse(path=str(path), step=step)

    def _started(self) -> Trainer:
        if not self.trainer.initialized:
            raise Unavailable("the trainer is starting", reason="TRAINER_STARTING", retry_after_s=1)
        return self.trainer

    async def Pause(self, request: pb.PauseRequest, context: Any) -> pb.PauseResponse:
        if len(request.reason) > MAX_REASON_CHARS:
            raise invalid_field("reason", f"at most {MAX_REASON_CHARS} characters")
        trainer = self._started()
        idle = trainer.pause(request.reason)
        if request.wait and not idle:
            await trainer.wait_idle()  # the caller's deadline bounds this
            idle = True
        return pb.PauseResponse(step=trainer.step, idle=idle)

    async def Resume(self, request: pb.ResumeRequest, context: Any) -> pb.ResumeResponse:
        trainer = self._started()
        trainer.resume()
        return pb.ResumeResponse(step=trainer.step, paused_seconds=trainer.paused_s)

    async def GetCapabilities(
        self, request: pb.GetCapabilitiesRequest, context: Any
    ) -> pb.GetCapabilitiesResponse:
        return pb.GetCapabilitiesResponse(
            capabilities=capabilities_pb2.Capabilities(
                contract_version=CONTRACT_VERSION,
                features=["fsdp2", "ppo", "grpo", "pause"],
                implementation="astra-trainer",
                implementation_version=__version__,
            )
        )
