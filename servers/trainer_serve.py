"""Starts a trainer's TrainerService: rank 0 serves it, other ranks follow (astra.trainer.serving).

`start_trainer` serves a servicer over a started training run; `serve_trainer` is `astra
trainer`'s process: the run, its signals and the server's shutdown. Wiring only: requests are
the servicer's (servers/trainer.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from typing import Any

from astra import stop_deadline
from astra.clients.trainer_sources import GRPC
from astra.servers.runtime import GrpcServer, dump_on_sigusr1
from astra.servers.trainer import SERVICE_NAME, TrainerServicer
from astra.trainer.config import TrainerConfig
from astra.trainer.loop import Trainer
from astra.trainer.serving import follow, train_steps
from astra.trainer.serving import train_steps as _train  # noqa: F401 (tests import it here)
from astra.trainer.v1 import trainer_service_pb2_grpc as pb_grpc

log = logging.getLogger("astra.servers.trainer")


async def start_trainer(
    config: TrainerConfig, *, source: Any = None, sink: Any = None, grace_s: float = 5.0
) -> tuple[GrpcServer | None, Trainer]:
    """Starts the TrainerService (unless port is None), then loads the model; SERVING after."""
    trainer = Trainer(config, source=source, sink=sink, connect=GRPC)
    server = None
    if config.port is not None:
        server = GrpcServer(config.host, config.port, grace_s=grace_s)
        server.add_service(
            pb_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(trainer), SERVICE_NAME
        )
        await server.start(serving=False)
    try:
        await trainer.initialize()
    except BaseException:  # damaged checkpoints, say: the server goes with the trainer
        if server is not None:
            await server.stop()
        raise
    if server is not None:
        await server.set_serving(True)
    return server, trainer


async def serve_trainer(config: TrainerConfig) -> None:
    """`astra serve trainer`: train `num_steps` (0: until SIGTERM/SIGINT), serving status."""
    if int(os.environ.get("RANK", "0")) > 0:
        await follow(config)
        return
    server, trainer = await start_trainer(config)
    address = server.address if server is not None else None
    metrics = None
    if config.metrics_port is not None:
        from astra.trainer.metrics import TrainerMetrics

        metrics = TrainerMetrics(trainer)
        if server is not None:
            metrics.also(server.roles.metrics)
        metrics.serve(config.host, config.metrics_port)
    line: dict[str, object] = {"service": "trainer", "address": address}
    line["metrics_port"] = metrics.port if metrics is not None else None
    print(json.dumps(line), flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    dump_on_sigusr1(loop)
    training = asyncio.create_task(train_steps(trainer, config.num_steps, metrics))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({training, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stopper.done():
            # The step and its checkpoint, the publishing left and the checkpoint's commit
            # each get stop_timeout_s (astra.trainer.loop); then the deadline's own margin.
            bound = 3 * config.checkpoint.stop_timeout_s + stop_deadline.STOP_DEADLINE_S
            stop_deadline.arm(bound, "trainer")
        if stopper.done() and not training.done():
            await trainer.stop(training, config.checkpoint.stop_timeout_s)
    finally:
        for task in (training, stopper):
            task.cancel()
        outcome, _ = await asyncio.gather(training, stopper, return_exceptions=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if server is not None:
            await server.stop()
        if metrics is not None:
            metrics.shutdown()
        # Stopped by a signal: what is left to publish gets a bounded time (Dataflow or the
        # WeightService may be gone with the supervisor), then the trainer exits anyway.
        await trainer.shutdown(
            drain_timeout_s=config.checkpoint.stop_timeout_s if stopper.done() else None
        )
    log.info("trainer stopped at step %d, version %d", trainer.step, trainer.version)
    if isinstance(outcome, Exception):
        raise outcome
