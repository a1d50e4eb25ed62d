"""A checkpoint taken every N steps is written (staged) between two steps and renamed into place
once its version is published and announced: the step goes on without waiting for the publish
queue, and no checkpoint is ever ahead of the versions Dataflow and the WeightService have."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from astra.trainer.checkpoint import TMP_PREFIX, list_checkpoints
from astra.trainer.config import TrainerConfig
from astra.trainer.loop import Trainer
from astra.trainer.synthetic import MemorySink, SyntheticSource


class HeldSink(MemorySink):
    """Publishes only while `open` is set; `fail` makes every publish fail for good."""

    def __init__(self) -> None:
        super().__init__()
        self.open = asyncio.Event()
        self.fail = False

    async def publish(self, version: int, identity: str, tensors: Any) -> None:
        await self.open.wait()
        if self.fail:
            raise ValueError(f"version {version}: refused for good")
        await super().publish(version, identity, tensors)


def config(root: Path) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "policy_id": "p",
            "port": None,
            "optim": {"lr": 1e-3},
            "batch": {"num_groups": 2, "max_tokens_per_microbatch": 48},
            "checkpoint": {"dir": str(root), "every_steps": 1, "keep_last": 5},
        }
    )


async def started(root: Path) -> tuple[Trainer, SyntheticSource, HeldSink]:
    source, sink = SyntheticSource("p", vocab_size=100, max_lag=1), HeldSink()
    t = Trainer(config(root), source=source, sink=sink)
    sink.open.set()
    await t.initialize()
    await t.publisher.drain()  # version 0 out
    sink.open.clear()
    return t, source, sink


def staged(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(TMP_PREFIX))


def test_a_step_does_not_wait_for_its_checkpoints_version_to_be_published(tmp_path):
    async def scenario() -> None:
        t, source, sink = await started(tmp_path)
        r = await t.train_step_async()  # checkpoints step 1 while version 1 cannot be published
        assert r.step == 1 and r.version == 1
        assert list_checkpoints(tmp_path) == [] and staged(tmp_path) == [".tmp-step-000000001"]
        assert [v for v, _ in source.announced] == [0] and t.last_checkpoint is None
        sink.open.set()
        path, step = await t.committed()
        assert step == 1 and path == tmp_path / "step-000000001" == t.last_checkpoint
        assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000001"]
        assert [v for v, _ in source.announced] == [0, 1] and staged(tmp_path) == []
        await t.train_step_async()
        await t.shutdown()  # publishes what is queued, then commits the checkpoint staged last
        assert [p.name for p in list_checkpoints(tmp_path)][-1] == "step-000000002"
        assert [v for v, _ in source.announced] == [0, 1, 2]

    asyncio.run(scenario())


def test_a_version_that_cannot_be_published_leaves_its_checkpoint_staged_and_says_why(tmp_path):
    async def scenario() -> None:
        t, _, sink = await started(tmp_path)
        await t.train_step_async()
        sink.fail = True
        sink.open.set()
        with pytest.raises(RuntimeError, match="refused for good"):
            await t.committed()
        assert list_checkpoints(tmp_path) == [] and staged(tmp_path) == [".tmp-step-000000001"]
        with pytest.raises(RuntimeError, match="publishing failed"):
            await t.shutdown()  # as ever: what could not be published is said at the end too
        assert list_checkpoints(tmp_path) == []

    asyncio.run(scenario())
