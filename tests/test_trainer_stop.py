"""A trainer process stopped by SIGTERM (the supervisor's stop on Ctrl-C) checkpoints its last
step before it exits, so `--resume` retakes nothing: no acknowledged batch is discarded.

`python -m astra.trainer` as a real process against a WeightService, a Dataflow and a scripted
RaaS in process (tests.conftest.scripted_system); a real signal."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from astra.trainer.checkpoint import latest_checkpoint
from tests.conftest import save_tiny_trainer_model, scripted_system

STOPPED = re.compile(r"trainer stopped at step (\d+), version (\d+)")


async def start_trainer(df: str, weights: str, tmp_path: Path, *more: str):
    args = ["--dataflow", df, "--weights", weights, "--policy", "policy"]
    args += ["--model", str(tmp_path / "model"), "--port", "0"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), *more]
    env = {**os.environ, "ASTRA_TRAINER__BATCH__NUM_GROUPS": "2"}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "astra.trainer", *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip


async def version(client) -> int:
    (policy,) = (await client.get_status()).policies
    return policy.current_version


@pytest.mark.slow
def test_a_sigterm_checkpoints_the_last_step_and_a_resume_retakes_nothing(
    tmp_path: Path, dataset: Path
) -> None:
    """A SIGTERM cancelled the training task and exited: no checkpoint of the steps since the
    last one (checkpoint.every_steps 0: none at all), so a resume took them again."""
    save_tiny_trainer_model(tmp_path / "model")

    async def body() -> tuple[dict[str, int], str]:
        async with scripted_system(tmp_path, dataset) as (df_server, client, weights):
            proc = await start_trainer(
                df_server.address, weights.address, tmp_path, "--num-steps", "0"
            )
            try:
                while await version(client) < 3:
                    assert proc.returncode is None
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                _, err = await asyncio.wait_for(proc.communicate(), 30)
            finally:
                if proc.returncode is None:
                    proc.kill()
            log = err.decode()
            assert proc.returncode == 0, log[-3000:]
            step, last = map(int, STOPPED.findall(log)[-1])
            ckpt = latest_checkpoint(tmp_path / "ckpt")
            assert ckpt is not None, log[-3000:]
            saved = json.loads((ckpt / "trainer.json").read_text())
            assert (saved["step"], saved["version"]) == (step, last)
            assert await version(client) == last  # every step it took is published
            again = await start_trainer(
                df_server.address, weights.address, tmp_path, "--resume", "--num-steps", "1"
            )
            try:
                _, err = await asyncio.wait_for(again.communicate(), 40)
            finally:
                if again.returncode is None:
                    again.kill()
            assert again.returncode == 0, err.decode()[-3000:]
            return dict((await client.get_status()).counters), log

    counters, log = asyncio.run(asyncio.wait_for(body(), 100))
    assert counters.get("groups_discarded.trainer_restart", 0) == 0, log[-2000:]
    assert counters["consumed_groups"] == counters["trained_groups.policy"]


@pytest.mark.slow
def test_a_sigterm_to_a_two_rank_trainer_checkpoints_its_last_step(
    tmp_path: Path, dataset: Path
) -> None:
    """With --nproc 2 a SIGTERM (torchrun passes it to both ranks) wrote no checkpoint: the
    followers stopped at once, so rank 0 could not gather the state. Now they follow rank 0's
    checkpoint plan first."""
    from tests.conftest import start_two_rank_trainer

    model = save_tiny_trainer_model(tmp_path / "model")
    env = {**os.environ, "ASTRA_TRAINER__BATCH__NUM_GROUPS": "2"}

    async def body() -> tuple[str, int]:
        async with scripted_system(tmp_path, dataset) as (df_server, client, weights):
            proc = await start_two_rank_trainer(
                df_server, weights, model,
                *("--num-steps", "0", "--checkpoint-dir", str(tmp_path / "ckpt")),
                stderr=asyncio.subprocess.PIPE, env=env,
            )  # fmt: skip
            try:
                while await version(client) < 2:
                    assert proc.returncode is None
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                _, err = await asyncio.wait_for(proc.communicate(), 60)
            finally:
                if proc.returncode is None:
                    proc.kill()
            return err.decode(), await version(client)

    log, last = asyncio.run(asyncio.wait_for(body(), 120))
    step, stopped_at = map(int, STOPPED.findall(log)[-1])
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None, log[-3000:]
    saved = json.loads((ckpt / "trainer.json").read_text())
    assert (saved["step"], saved["version"], saved["world_size"]) == (step, stopped_at, 2)
    assert stopped_at == last  # every step it took is published
