"""`Trainer`: fetch a batch, take one optimiser step, hand the new version to the publisher.

Per iteration on rank 0: fetch under a stable request id (astra.trainer.feed);
a batch that fails validation is counted, acknowledged and skipped; every
rank trains its share (rank 0 broadcasts the batch); a non-finite loss
stops the step with nothing applied or published; otherwise AckBatch, copy
the full state to host memory and queue it for the background publish and
announce (astra.trainer.publisher) — the step waits only for the copy.
Version = optimiser steps, carried across restarts (setup.agree_version).
Compute runs on one worker thread, so the event loop (and a TrainerService
beside it) stays responsive. Ranks > 0 run `run_follower`. Checkpoints:
astra.trainer.state. With `lora:` the base is frozen and the optimiser, the versions
and the checkpoints hold only the adapter (astra.trainer.lora).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from astra.engine.torch_weights import torch_dtype
from astra.lora.layer import Adapter
from astra.trainer import lora, ranks, setup
from astra.trainer.batch import BatchRejected, TrainBatch
from astra.trainer.config import TrainerConfig
from astra.trainer.feed import Feed
from astra.trainer.losses import StalenessMetrics
from astra.trainer.parallel import broadcast_object, full_state, init_distributed, world
from astra.trainer.publisher import Publisher
from astra.trainer.sources import BatchSource, Connect, WeightSink, retrying
from astra.trainer.state import StateMixin
from astra.trainer.step import TrainingStepResult, train_on_batch
from astra.waits import wait_set, within

log = logging.getLogger(__name__)


IDLE_PLAN_S = 60.0  # while paused, rank 0 tells the other ranks it is alive this often


@dataclass
class StepResult:
    """One iteration (Flux's StepResult); `skipped` names why no update was applied."""

    step: int
    training_result: TrainingStepResult | None
    staleness_metrics: StalenessMetrics | None
    batch_size: int
    num_trajectories: int
    elapsed_ms: float
    metrics: dict[str, float] = field(default_factory=dict)
    version: int = 0
    skipped: str = ""


class Trainer(StateMixin):
    """Policy optimisation over a BatchSource, publishing to a WeightSink; usable without a CLI."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        source: BatchSource | None = None,
        sink: WeightSink | None = None,
        connect: Connect | None = None,
    ) -> None:
        """`connect` builds rank 0's source and sink from the config where none is given
        (astra.clients.trainer_sources.GRPC: the services the config names)."""
        self.config, self.source, self.sink, self.connect = config, source, sink, connect
        self.rank, self.world_size, self.step, self.version = 0, 1, 0, 0
        self.counters: Counter[str] = Counter()
        self.timings: Counter[str] = Counter()
        self.feed = Feed(config, self.counters, on_wait=self._serve_checkpoint_requests)
        self.last: StepResult | None = None
        self.adapter: Adapter | None = None  # trainer.lora's, once initialized
        self.initialized = False
        self.pause_reason = ""  # non-empty while paused (TrainerService.Pause)
        self.paused_s = 0.0  # in all, over finished pauses
        self._paused_at = 0.0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._fetching = False  # waiting for a batch: nothing taken yet that a stop must finish
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="astra-train")
        self._sync_loop: asyncio.AbstractEventLoop | None = None
        self._init_checkpoints()

    @property
    def attempt(self) -> int:
        return self.feed.attempt

    @attempt.setter
    def attempt(self, value: int) -> None:
        self.feed.attempt = value

    async def _compute(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def initialize(self) -> None:
        """Builds the (sharded) model and optimiser, resumes, agrees versions, publishes v0."""
        c = self.config
        torch.manual_seed(c.seed)
        random.seed(c.seed)
        mesh = await self._compute(init_distributed, c.device)
        self.rank, self.world_size = world()
        self.model_cfg, self.hf_config, initial = await asyncio.to_thread(
            setup.load_weights, c.model
        )
        self.feed.model_cfg = self.model_cfg
        # LoRA (trainer.lora): checked against the base, whose digest its versions carry.
        self.adapter = await asyncio.to_thread(lora.plan, c, self.model_cfg, initial)
        start = lora.start_state(self.adapter, initial, c.seed)
        self.model = await self._compute(
            functools.partial(setup.make_model, adapter=self.adapter),
            c,
            self.model_cfg,
            start,
            mesh,
        )
        self.ref_model = await self._compute(setup.make_reference, c, initial, mesh)
        self.optimizer = setup.make_optimizer(c, self.model)
        if c.checkpoint.resume:
            await self._compute(self.load_checkpoint, c.checkpoint.dir)
        first = False
        if self.rank == 0:
            if self.connect is not None:
                self.source = self.source or self.connect.source(c)
                files = lora.version_files(c, self.hf_config, self.adapter)
                self.sink = self.sink or self.connect.sink(c, files)
            self.feed.source = self.source
            both = self.source is not None and self.sink is not None
            announce = self.source.announce if both else None  # type: ignore[union-attr]
            self.publisher = Publisher(self.sink, announce, max_pending=c.publish.max_pending)
            self.version, held = await retrying(
                lambda: setup.agree_version(self.version, self.source, self.sink, announce=both),
                "agreeing versions with Dataflow and the WeightService",
            )
            first = not held and self.sink is not None and c.publish.publish_initial
        self.version, first = await self._compute(broadcast_object, (self.version, first))
        if first:  # collective: every rank takes part in gathering the state
            host = await self._compute(self._host_copy)
            if self.rank == 0:
                await self.publisher.submit(self.version, host)
                await self.publisher.drain()
        self.initialized = True

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Ends the trainer: what is queued is published first (within `drain_timeout_s`, when
        given: on a stop, its receivers may be gone; what is left is logged and dropped)."""
        if self.rank == 0 and self.world_size > 1 and self.initialized:
            await self._compute(broadcast_object, {"kind": "stop"})
        if self.rank == 0 and self.initialized:
            try:
                await within(self.publisher.drain(), drain_timeout_s)
                # The checkpoint staged last: its version is out now, so it is committed.
                await within(self.committed(), drain_timeout_s)
            except TimeoutError:
                log.error(
                    "stopping: publishing did not finish within %.1f s; version %d may not be "
                    "announced (a resume starts from the newest checkpoint)",
                    drain_timeout_s,
                    self.version,
                )
            finally:
                if self._commit is not None:  # left staged: the next write removes it
                    self._commit.cancel()
                await self.publisher.close()
                for part in (self.source, self.sink):
                    if part is not None:
                        await part.close()
        self._pool.shutdown(wait=True)

    def _host_copy(self) -> dict[str, torch.Tensor]:
        dtype = self.config.publish.dtype  # "model": the compute dtype, not the fp32 masters
        target = torch_dtype(self.config.dtype if dtype == "model" else dtype)
        pin = self.config.publish.pin_host_copy
        return full_state(self.model, target, pin=pin, keep=lora.keep(self.adapter))

    def _train(self, batch: TrainBatch, version: int, publish: bool) -> tuple[Any, ...]:
        """Every rank: one step on its share, then (if applied and published) the host copy."""
        result, stale = train_on_batch(
            self.model,
            self.optimizer,
            batch,
            self.config,
            version=version,
            ref_model=self.ref_model,
        )
        start = time.perf_counter()
        host = self._host_copy() if result.applied and publish else {}
        return result, stale, host, time.perf_counter() - start

    async def train_step_async(self) -> StepResult:
        """One iteration on rank 0 (see the module docstring)."""
        self._idle.clear()
        try:
            return await self._iteration()
        finally:
            self._idle.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self, reason: str = "") -> bool:
        """No new step starts until `resume`; True when no step is in progress now."""
        self.pause_reason = reason or "paused"
        if not self.paused:
            log.info("pausing after step %d: %s", self.step, self.pause_reason)
            self._paused_at = time.perf_counter()
            self._resumed.clear()
        return not self.step_in_progress

    async def wait_idle(self) -> None:
        """Returns once no step is in progress."""
        await self._idle.wait()

    def resume(self) -> None:
        if self.paused:
            log.info("resuming at step %d", self.step)
            self.paused_s += time.perf_counter() - self._paused_at
        self.pause_reason = ""
        self._resumed.set()

    async def _while_paused(self) -> None:
        """Waits for `resume`; other ranks get an idle plan every IDLE_PLAN_S so their
        collective never times out while rank 0 waits."""
        while self.paused:
            if self.world_size > 1:
                await self._compute(broadcast_object, {"kind": "idle"})
            await wait_set(self._resumed, IDLE_PLAN_S)

    async def _iteration(self) -> StepResult:
        t0 = time.perf_counter()
        self._fetching = True
        try:
            fetched = await self.feed.fetch(self.version + 1)
        finally:
            self._fetching = False
        t_fetch = time.perf_counter()
        n_traj = len(fetched.trajectories)
        async with self.feed.leased(fetched):  # a step may outlast the batch's lease
            try:
                batch = await asyncio.to_thread(self.feed.build, fetched.trajectories)
            except BatchRejected as exc:
                rejected: BatchRejected | None = exc
            else:
                rejected = None
                publish = self.sink is not None
                if self.world_size > 1:
                    plan = ranks.train_plan(fetched.trajectories, self.version, publish)
                    await self._compute(broadcast_object, plan)
                result, stale, host, copy_s = await self._compute(
                    self._train, batch, self.version, publish
                )
        if rejected is not None:
            log.warning("batch %s rejected: %s", fetched.batch_id, rejected)
            self.counters["batches_rejected"] += 1
            self.feed.consumed_without_update(rejected.reason)
            await self.feed.ack(fetched.batch_id, rejected.reason)
            ms = (time.perf_counter() - t0) * 1e3
            reason = rejected.reason
            return self._finish(
                StepResult(self.step, None, None, 0, n_traj, ms, {}, self.version, reason)
            )
        t_step = time.perf_counter()
        await self.feed.ack(fetched.batch_id, "" if result.applied else "NON_FINITE_LOSS")
        skipped, blocked = "", copy_s
        if result.applied:
            self.step, self.version, self.attempt = self.step + 1, self.version + 1, 0
            self.counters["tokens_trained"] += result.num_tokens
            if host:
                blocked += await self.publisher.submit(self.version, host)
        else:
            skipped = "NON_FINITE_LOSS"
            log.error("batch %s: loss %s, step not applied", fetched.batch_id, result.loss)
            self.feed.consumed_without_update(skipped)
        end = time.perf_counter()
        timing = {
            "fetch_s": t_fetch - t0,
            "compute_s": t_step - t_fetch - copy_s,
            "publish_blocked_s": blocked,  # the host copy, then waiting for queue room
            "host_copy_s": copy_s,
            "total_s": end - t0,
        }
        self.timings.update(timing)
        metrics = {**result.metrics, **vars(stale)}
        metrics.update({k[:-2] + "_ms": v * 1e3 for k, v in timing.items()})
        # Summed over this process's steps: two rows anywhere in a run give the share of the
        # time between them spent waiting for batches, whichever steps were observed.
        metrics["fetch_s_sum"] = self.timings["fetch_s"]
        metrics["total_s_sum"] = self.timings["total_s"]
        metrics["tokens_per_s"] = result.num_tokens / max(end - t0, 1e-9)
        rewards = [t.reward for t in fetched.trajectories]
        if rewards:
            # Rewards of the rollouts this step trained on; accuracy counts full marks.
            metrics["reward_mean"] = sum(rewards) / len(rewards)
            metrics["accuracy"] = sum(r >= 1.0 for r in rewards) / len(rewards)
        out = StepResult(
            self.step, result, stale, len(batch.sequences), n_traj, (end - t0) * 1e3,
            metrics, self.version, skipped,
        )  # fmt: skip
        await self._after_step(result.applied)
        return self._finish(out)

    def _finish(self, result: StepResult) -> StepResult:
        self.counters["iterations"] += 1
        self.last = result
        return result

    async def run_training_async(
        self, num_steps: int | None = None
    ) -> AsyncGenerator[StepResult, None]:
        """Yields one StepResult per iteration (skipped ones included); None or 0: no end."""
        if not self.initialized:
            await self.initialize()
        done = 0
        while not num_steps or done < num_steps:
            if self.paused:
                await self._while_paused()
            yield await self.train_step_async()
            done += 1
        await self.publisher.drain()
        await self.committed()  # the checkpoint staged last, now that its version is out

    def run_training(self, num_steps: int) -> Iterator[StepResult]:
        """The synchronous form, on an event loop of its own kept across calls (see `close`)."""
        if self._sync_loop is None:
            self._sync_loop = asyncio.new_event_loop()
        loop, steps = self._sync_loop, self.run_training_async(num_steps)
        while True:
            try:
                yield loop.run_until_complete(anext(steps))
            except StopAsyncIteration:
                return

    def close(self) -> None:
        """`shutdown` for users of `run_training`."""
        if self._sync_loop is not None:
            self._sync_loop.run_until_complete(self.shutdown())
            self._sync_loop.close()
            self._sync_loop = None

    async def stop(self, training: asyncio.Task, timeout_s: float) -> bool:
        """Ends `training` (the task running `run_training_async`) on a SIGTERM: no new step
        starts, the one in progress finishes (one still waiting for its batch is cancelled),
        then what is queued is published and the last step checkpointed, so a resume
        retakes nothing. All within `timeout_s`; True when that checkpoint was written."""
        deadline = time.monotonic() + timeout_s
        self.pause("stopping")
        try:
            if self._fetching:
                training.cancel()
            await within(self.wait_idle(), timeout_s)
            training.cancel()
            await asyncio.wait({training})
            if not self.initialized or self.config.checkpoint.dir is None:
                return False
            # With several ranks the followers keep following on torchrun's SIGTERM
            # (servers/trainer.py): the checkpoint is a plan they take part in.
            left = max(0.0, deadline - time.monotonic())
            await within(self.checkpoint_at_end(), left)
            return True
        except TimeoutError:
            log.error(
                "stopping: step %d and its checkpoint did not finish within %.1f s "
                "(checkpoint.stop_timeout_s); a resume retakes the steps since the last one",
                self.step,
                timeout_s,
            )
            return False

    async def run_follower(self) -> None:
        """Ranks > 0: obey rank 0's plans until it stops (astra.trainer.ranks)."""
        if not self.initialized:
            await self.initialize()
        await ranks.follow(self)
