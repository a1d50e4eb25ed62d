"""Exact accounting of acknowledged batches: every one is in the trainer's weights (its step
published) or counted discarded with a reason, in Dataflow's counters and in its SQLite rows.

Real services in process on port 0 (a WeightService, a Dataflow, a scripted RaaS) and real
trainers with checkpoints on disk; a trainer "crash" is a trainer dropped without a checkpoint
of its last steps, and its restart a new one resumed from the checkpoint it left."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from astra.clients.trainer_sources import GRPC
from astra.run.summary import build_summary, read_state
from astra.trainer.config import TrainerConfig
from astra.trainer.loop import Trainer
from tests.conftest import save_tiny_trainer_model, scripted_system

T = 90  # seconds: every test body is bounded
BATCH = 2  # groups per batch (tests.conftest.make_config's batch_groups)


def trainer_config(tmp_path: Path, df: str, weights: str, *, resume: bool) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "policy_id": "policy",
            "model": str(tmp_path / "model"),
            "port": None,
            "dataflow": df,
            "weights": weights,
            "optim": {"lr": 1e-3},
            "batch": {"num_groups": BATCH, "max_wait_s": 5.0},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "resume": resume},
        }
    )


async def steps(trainer: Trainer, n: int) -> None:
    async for result in trainer.run_training_async(n):
        assert not result.skipped, result


def batch_rows(state_dir: Path) -> list[tuple[int, str, str]]:
    """(policy_version, state, untrained_reason) of every batch, read from Dataflow's file."""
    conn = sqlite3.connect(f"file:{state_dir / 'dataflow.sqlite'}?mode=ro", uri=True)
    try:
        return conn.execute(
            "SELECT policy_version, state, untrained_reason FROM batches ORDER BY policy_version"
        ).fetchall()
    finally:
        conn.close()


@pytest.mark.slow
def test_steps_lost_by_a_trainer_restart_are_counted_discarded_not_trained(
    tmp_path: Path, dataset: Path
) -> None:
    """The trainer checkpoints at step 2, trains 3 more steps (published: versions 3-5) and dies;
    its restart continues from the checkpoint's weights. The 3 batches since were counted
    neither trained nor discarded: only groups past the newest published version were
    (`groups_untrained_at_resume`), and groups_trained was every acknowledged batch."""
    save_tiny_trainer_model(tmp_path / "model")

    async def body() -> None:
        async with scripted_system(tmp_path, dataset) as (df_server, client, weights):
            first = Trainer(
                trainer_config(tmp_path, df_server.address, weights.address, resume=False),
                connect=GRPC,
            )
            try:
                await steps(first, 2)
                await first.checkpoint_async("at-2")
                await steps(first, 3)
                await first.publisher.drain()
            finally:
                await first.shutdown()  # no checkpoint of steps 3-5: they die with it
            again = Trainer(
                trainer_config(tmp_path, df_server.address, weights.address, resume=True),
                connect=GRPC,
            )
            try:
                await steps(again, 2)
                await again.publisher.drain()
                assert again.step == 4 and again.version == 7
            finally:
                await again.shutdown()
            status = await client.get_status()
            counters = dict(status.counters)
            snapshot = {"counters": counters, "versions": {"policy": 7}}
        assert counters["consumed_groups"] == 7 * BATCH
        assert counters["groups_discarded.trainer_restart"] == 3 * BATCH
        assert counters["batches_discarded.trainer_restart"] == 3
        assert counters["discarded_groups.policy"] == 3 * BATCH
        # Dataflow's own rows: the batches of versions 2-4 (steps 3-5) are marked, once.
        rows = batch_rows(tmp_path / "df")
        assert [(v, r) for v, s, r in rows if s == "acked"] == [
            (0, ""), (1, ""), (2, "TRAINER_RESTART"), (3, "TRAINER_RESTART"),
            (4, "TRAINER_RESTART"), (5, ""), (6, ""),
        ]  # fmt: skip
        state = read_state(tmp_path / "df")
        assert state["trained_keys"] == 4 * BATCH  # the final weights' 4 steps
        assert state["discarded_keys"] == {"trainer_restart": 3 * BATCH}
        s = build_summary(
            status="completed",
            wall_seconds=1.0,
            dataflow=snapshot,
            state=state,
            history={},
            final_steps={"policy": 4},
            baseline={},
        )
        assert s["groups_trained"] == 4 * BATCH
        assert s["groups_trained_per_policy"] == {"policy": 4 * BATCH}
        assert s["groups_discarded"] == {"trainer_restart": 3 * BATCH}
        assert s["groups_trained"] + sum(s["groups_discarded"].values()) == 7 * BATCH
        assert "groups_discarded" in s["how"]
        assert s["groups_lost"] == 0
        # A last view taken before Dataflow's last outcomes (random-kills restarts it near the
        # end): the counters it wrote at its stop are the later ones, and nothing is lost.
        late = {**counters, "completed_groups": counters["completed_groups"] - BATCH}
        stale = build_summary(
            status="completed",
            wall_seconds=1.0,
            dataflow={**snapshot, "counters": late},
            state=state,
            history={},
            final_steps={"policy": 4},
            baseline={},
        )
        assert state["counters"]["completed_groups"] == counters["completed_groups"]
        assert (
            stale["groups_lost"] == 0 and stale["groups_with_outcome"] == s["groups_with_outcome"]
        )

    asyncio.run(asyncio.wait_for(body(), T))


def test_a_second_resume_from_the_same_checkpoint_counts_each_batch_once(
    tmp_path: Path, dataset: Path
) -> None:
    """Two restarts from one checkpoint: the batches the first run lost are not counted again;
    those the second run lost are counted too."""
    save_tiny_trainer_model(tmp_path / "model")

    async def body() -> dict[str, int]:
        async with scripted_system(tmp_path, dataset) as (df_server, client, weights):
            first = Trainer(
                trainer_config(tmp_path, df_server.address, weights.address, resume=False),
                connect=GRPC,
            )
            try:
                await steps(first, 1)
                await first.checkpoint_async("at-1")
                await steps(first, 2)
                await first.publisher.drain()
            finally:
                await first.shutdown()
            for n in (1, 1):
                again = Trainer(
                    trainer_config(tmp_path, df_server.address, weights.address, resume=True),
                    connect=GRPC,
                )
                try:
                    await steps(again, n)
                    await again.publisher.drain()
                finally:
                    await again.shutdown()
            return dict((await client.get_status()).counters)

    counters = asyncio.run(asyncio.wait_for(body(), T))
    # Run 1: batches of versions 0-2, 1-2 lost. Run 2 (from step 1): version 3, lost to run 3.
    assert counters["consumed_groups"] == 5 * BATCH
    assert counters["groups_discarded.trainer_restart"] == 3 * BATCH
    states = [r for _, s, r in batch_rows(tmp_path / "df") if s == "acked"]
    assert states.count("TRAINER_RESTART") == 3 and states.count("") == 2
