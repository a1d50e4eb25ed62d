"""How a trainer process runs outside its RPCs: rank 0's training steps, a follower's life.

`train_steps` trains until a number of optimiser steps is done (logging one
line per step, observing metrics), then publishes what is queued and
checkpoints the end. `follow` is a rank > 0 under torchrun: it follows rank
0's broadcasts until rank 0 sends "stop", and on SIGTERM/SIGINT exits
anyway once rank 0 has had its bound. Plain Python: no gRPC; the servicer
module (astra.servers.trainer) serves rank 0's status around these.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from astra.trainer.config import TrainerConfig
from astra.trainer.loop import Trainer

# The logger of the process that runs these: astra.run.observe reads the step lines by this name.
log = logging.getLogger("astra.servers.trainer")
FOLLOWER_GRACE_S = 10.0  # beyond checkpoint.stop_timeout_s, for rank 0's "stop" plan


async def train_steps(trainer: Trainer, num_steps: int, metrics: Any = None) -> None:
    """Trains until `num_steps` optimiser steps are done (0: no end). Iterations whose batch
    was rejected or whose loss was not finite take no step and do not count."""
    if not trainer.initialized:
        await trainer.initialize()
    target = trainer.step + num_steps if num_steps else None
    steps = trainer.run_training_async(None)
    try:
        async for result in steps:
            if metrics is not None:
                metrics.observe_step(result)
            # astra.run.observe reads this line: one metrics.jsonl row per step, with the
            # step's accuracy even when no poll saw that step
            acc = next((k for k in ("accuracy", "reward_mean") if k in result.metrics), None)
            log.info(
                "step %d version %d loss %s %s%s",
                result.step,
                result.version,
                result.metrics.get("loss"),
                result.skipped,
                f" {acc}={result.metrics[acc]}" if acc else "",
            )
            if target is not None and trainer.step >= target:
                break
    finally:
        await steps.aclose()
    await trainer.publisher.drain()
    await trainer.checkpoint_at_end()  # `astra run` reads "finished" from the checkpoints


async def follow(config: TrainerConfig) -> None:
    """A rank > 0: follows rank 0 until its "stop" (or the bound after a signal)."""
    follower = Trainer(config)
    loop = asyncio.get_running_loop()
    bound = config.checkpoint.stop_timeout_s + FOLLOWER_GRACE_S

    exit_at: list[asyncio.TimerHandle] = []

    def stopping() -> None:
        # torchrun passes its SIGTERM to every rank: a follower goes on following rank 0,
        # whose stop checkpoints the last step (a collective) and then sends "stop"; past
        # the bound (rank 0 gone quiet) it exits anyway. A second signal changes nothing.
        if exit_at:
            return
        log.info("rank %s: stopping; following rank 0 to its final checkpoint (%.0f s at "
                 "most)", os.environ.get("RANK"), bound)  # fmt: skip
        exit_at.append(loop.call_later(bound, os._exit, 128 + signal.SIGTERM))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping)
    try:
        await follower.run_follower()
    finally:
        await follower.shutdown()
