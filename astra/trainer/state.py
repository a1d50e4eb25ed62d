"""A `Trainer`'s state: checkpoints (save, load, on request, every N steps) and statistics.

Saving is collective under FSDP (every rank gathers the full model and
optimiser state; rank 0 writes, astra.trainer.checkpoint), so rank 0 first
broadcasts a "checkpoint" plan to its followers. Requests from the
TrainerService are idempotent by request id and served between steps (or
at once when no step is running). A checkpoint holds step, version and fetch
attempt, so a resumed run asks Dataflow for the same request ids and, with
fixed seeds, takes the same next step as an uninterrupted one.

A checkpoint is never ahead of the published versions: it is written (staged)
between two steps and renamed into place once its version is published and
announced. One taken every N steps does that rename beside the next steps
(`committed` waits for it), so the loop does not wait for the publish queue;
one asked for (SaveCheckpoint, the end of training) is answered once renamed.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
from pathlib import Path
from typing import Any

from astra.damage import Damaged
from astra.trainer import lora
from astra.trainer.checkpoint import (
    commit_checkpoint,
    read_checkpoint,
    restore_rng,
    stage_checkpoint,
)
from astra.trainer.ckpt_verify import newest_good, verify
from astra.trainer.parallel import (
    barrier,
    broadcast_object,
    full_optimizer_state,
    full_state,
    load_full_state,
    load_optimizer_state,
    load_partial_state,
)

log = logging.getLogger(__name__)
MAX_REMEMBERED = 1024


class StateMixin:
    """Mixed into Trainer; uses its model, optimizer, step, version, attempt and counters."""

    config: Any
    model: Any
    optimizer: Any
    hf_config: dict[str, Any]
    rank: int
    world_size: int
    step: int
    version: int
    attempt: int
    counters: Any
    timings: Any
    last: Any
    initialized: bool
    publisher: Any
    adapter: Any
    _compute: Any

    def _init_checkpoints(self) -> None:
        self.last_checkpoint: Path | None = None
        self.refused_checkpoints: list[str] = []  # damaged ones skipped by the last resume
        self._checkpointed_step: int | None = None  # the step of the last checkpoint written
        self.last_checkpoint_time: datetime.datetime | None = None
        self._requests: dict[str, asyncio.Future[tuple[Path, int]]] = {}
        self._checkpoint_lock = asyncio.Lock()  # one checkpoint written at a time
        self._idle = asyncio.Event()  # set while no step is in progress
        self._idle.set()
        # The commit of the last checkpoint staged between steps, which waits (beside the next
        # steps) for its version to be published and announced; one at a time.
        self._commit: asyncio.Task[tuple[Path, int]] | None = None

    def _root(self, path: str | Path | None) -> Path:
        root = path or self.config.checkpoint.dir
        if root is None:
            raise ValueError("no checkpoint directory: set checkpoint.dir or pass a path")
        return Path(root)

    def _write_checkpoint(self, root: str | Path, *, stage_only: bool = False) -> Path | None:
        """Every rank: gather the full state; rank 0 writes it. Returns the path on rank 0:
        the checkpoint, or with `stage_only` its staged directory, for `_finish_checkpoint`."""
        model_state = full_state(self.model, keep=lora.keep(self.adapter))  # LoRA: the adapter
        optim_state = full_optimizer_state(self.model, self.optimizer)
        path = None
        if self.rank == 0:
            trainer_state = {
                "version": self.version,
                "attempt": self.attempt,
                "policy_id": self.config.policy_id,
                "world_size": self.world_size,
                "counters": dict(self.counters),
            }
            path = stage_checkpoint(
                root,
                self.step,
                model_state,
                self.hf_config,
                optim_state,
                trainer_state,
                files=lora.adapter_files(self.adapter),
            )
            if not stage_only:
                path = self._finish_checkpoint(path, self.step)
        barrier()
        return path

    def _finish_checkpoint(self, staged: Path, step: int) -> Path:
        """Renames a staged checkpoint into place (rank 0)."""
        path = commit_checkpoint(staged, keep_last=self.config.checkpoint.keep_last)
        self.last_checkpoint = path
        self._checkpointed_step = step
        self.last_checkpoint_time = datetime.datetime.now(datetime.UTC)
        self.counters["checkpoints_written"] += 1
        log.info("checkpoint %s written", path)
        return path

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Writes `<path or checkpoint.dir>/step-N` now (between steps); returns it."""
        root = self._root(path)
        loop = getattr(self, "_sync_loop", None)
        if self.rank == 0 and loop is not None and getattr(self, "publisher", None) is not None:
            # Never ahead of what is published (as _checkpoint_now): the sync API's steps
            # leave their publishes, and the commit of a checkpoint, running on its loop.
            loop.run_until_complete(self.committed())
            loop.run_until_complete(self.publisher.drain())
        if self.world_size > 1:
            broadcast_object({"kind": "checkpoint", "root": str(root)})
        written = self._write_checkpoint(root)
        assert written is not None
        return written

    def load_checkpoint(self, path: str | Path | None = None) -> None:
        """Restores model, optimiser, RNG, step, version; `path` is a checkpoint or a root.
        Under a root, the newest checkpoint that verifies (astra.trainer.ckpt_verify): the
        damaged ones after it are logged and counted `checkpoints_refused`. Damaged when
        `path` is a damaged checkpoint, or a root whose checkpoints are all damaged."""
        target = self._root(path)
        if (target / "trainer.json").is_file():
            verify(target)
        else:
            found = newest_good(target, self._refused)
            if found is None:
                log.info("no checkpoint under %s: starting fresh", target)
                return
            target = found
        lora.check_checkpoint(target, self.adapter)  # another base, adapter or kind: refused
        ckpt = read_checkpoint(target)
        if self.adapter is not None:
            load_partial_state(self.model, ckpt.model)  # the adapter; the base is the model's
        else:
            load_full_state(self.model, ckpt.model)
        load_optimizer_state(self.model, self.optimizer, ckpt.optimizer)
        self._apply_optim_config()
        restore_rng(ckpt.rng)
        self.step, self.version = int(ckpt.trainer["step"]), int(ckpt.trainer["version"])
        self.attempt = int(ckpt.trainer.get("attempt", 0))
        self.counters.update(ckpt.trainer.get("counters", {}))
        self.last_checkpoint, self._checkpointed_step = target, self.step
        log.info("resumed from %s at step %d, version %d", target, self.step, self.version)

    def _refused(self, exc: Damaged) -> None:
        self.counters["checkpoints_refused"] += 1
        self.refused_checkpoints.append(str(exc))
        log.error("checkpoint refused, trying the one before: %s", exc)

    def _apply_optim_config(self) -> None:
        """The configured hyper-parameters over the checkpoint's (its moments and step counts
        stay): lowering `optim.lr` and resuming is how an unstable run is calmed."""
        o = self.config.optim
        want = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
        for group in self.optimizer.param_groups:
            changed = {k: (group[k], v) for k, v in want.items() if tuple_or(group[k]) != v}
            if changed:
                log.info("optimiser settings from the config over the checkpoint's: %s", changed)
            group.update(want)

    async def _checkpoint_now(self, *, wait: bool = True) -> tuple[Path, int]:
        """Stages the checkpoint of this step at once (the state as it is between steps);
        it is renamed into place once its version is published and announced, never before:
        a resume continues from a version Dataflow and the WeightService have (see
        setup.agree_version). `wait`: return only then; else that commit goes on beside the
        next steps (`committed` waits for it). Returns (path, step) once committed; without
        `wait`, the staged path (rank 0; other ranks: None)."""
        await self.committed()  # one staged checkpoint at a time
        root, step, version = self._root(None), self.step, self.version
        if self.world_size > 1:
            await self._compute(broadcast_object, {"kind": "checkpoint", "root": str(root)})
        staged = await self._compute(
            functools.partial(self._write_checkpoint, root, stage_only=True)
        )
        if self.rank != 0:
            return staged, step
        self._commit = asyncio.create_task(self._commit_when_published(staged, step, version))
        if wait:
            return await self.committed() or (staged, step)
        return staged, step

    async def _commit_when_published(
        self, staged: Path, step: int, version: int
    ) -> tuple[Path, int]:
        if getattr(self, "publisher", None) is not None:
            await self.publisher.wait_handled(version)
        return await asyncio.to_thread(self._finish_checkpoint, staged, step), step

    async def committed(self) -> tuple[Path, int] | None:
        """Waits for the commit of the checkpoint staged last, if any is pending; raises its
        failure (a version that could not be published: no checkpoint ahead of it)."""
        task, self._commit = self._commit, None
        if task is None:
            return None
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self._commit = task  # this waiter was cancelled, the commit goes on
            raise

    async def checkpoint_at_end(self) -> None:
        """A checkpoint of the last step when it has none yet (the steps are done): so a
        supervisor reads "finished" from the checkpoints, and a resume trains nothing again."""
        await self.committed()
        if self.config.checkpoint.dir and self._checkpointed_step != self.step:
            await self._checkpoint_now()

    @property
    def step_in_progress(self) -> bool:
        return not self._idle.is_set()

    async def checkpoint_async(self, request_id: str) -> tuple[Path, int]:
        """(path, step) of the checkpoint for `request_id`; a repeat returns the first answer."""
        fut = self._requests.get(request_id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._requests[request_id] = fut
            while len(self._requests) > MAX_REMEMBERED:
                self._requests.pop(next(iter(self._requests)))
            if not self.step_in_progress:
                await self._serve_checkpoint_requests()
        return await asyncio.shield(fut)

    async def _serve_checkpoint_requests(self) -> None:
        """Writes one checkpoint for every request waiting; one writer at a time (a request
        that comes in while a checkpoint is written gets the next one, never a second answer)."""
        async with self._checkpoint_lock:
            pending = [f for f in self._requests.values() if not f.done()]
            if not pending:
                return
            try:
                result = await self._checkpoint_now()
            except Exception as exc:
                for f in pending:
                    if not f.done():
                        f.set_exception(exc)
                return
            for f in pending:
                if not f.done():
                    f.set_result(result)

    async def _after_step(self, applied: bool) -> None:
        if self._commit is not None and self._commit.done():
            await self.committed()  # raises a commit's failure at the step after it
        every = self.config.checkpoint.every_steps
        if applied and every and self.config.checkpoint.dir and self.step % every == 0:
            # Staged now; committed beside the next steps once its version is published.
            await self._checkpoint_now(wait=False)
        await self._serve_checkpoint_requests()

    def get_statistics(self) -> dict[str, Any]:
        """Step, version, counters (fetches, rejections by reason, NaN steps, acks), timings,
        the fraction of step time blocked on publishing, publisher figures, last metrics."""
        total = self.timings["total_s"]
        stats: dict[str, Any] = {
            "policy_id": self.config.policy_id,
            "step": self.step,
            "version": self.version,
            "world_size": self.world_size,
            "counters": dict(self.counters),
            "timings_s": dict(self.timings),
            "publish_blocked_fraction": self.timings["publish_blocked_s"] / total if total else 0.0,
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "refused_checkpoints": list(self.refused_checkpoints),
            "last_step": dict(self.last.metrics) if self.last is not None else {},
        }
        if self.rank == 0 and self.initialized:
            stats["publisher"] = vars(self.publisher.stats)
        return stats


def tuple_or(value: Any) -> Any:
    """A list (betas as JSON gives them back) as a tuple, anything else as it is."""
    return tuple(value) if isinstance(value, list) else value
