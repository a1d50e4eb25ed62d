"""FSDP2 on CPU (gloo): two ranks train the same steps as one rank, within float tolerance.

Rank 0 runs the Trainer loop (fetch, broadcast, step, publish, checkpoint);
rank 1 follows. The losses, the published weights and a checkpoint written
by the two ranks match a one-process run of the same batches.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from astra.trainer.config import TrainerConfig
from astra.trainer.loop import Trainer
from astra.trainer.parallel import full_state
from astra.trainer.synthetic import MemorySink, SyntheticSource

STEPS = 2
DEADLINE_S = 60.0


def _config(root: Path) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "policy_id": "p",
            "port": None,
            "optim": {"lr": 1e-3},
            "batch": {"num_groups": 2, "max_tokens_per_microbatch": 24},
            "checkpoint": {"dir": str(root)},
        }
    )


def _source() -> SyntheticSource:
    return SyntheticSource("p", vocab_size=100, max_lag=1, seed=7)


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    cfg = _config(Path(out) / "ckpt")
    if rank == 0:
        sink = MemorySink()
        trainer = Trainer(cfg, source=_source(), sink=sink)

        async def lead() -> None:
            losses = [r.training_result.loss async for r in trainer.run_training_async(STEPS)]
            path = trainer.save_checkpoint()
            state = {k: torch.frombuffer(bytearray(b), dtype=torch.float32).reshape(s)
                     for k, (_, s, b) in sink.versions[STEPS].items()}  # fmt: skip
            torch.save(
                {"losses": losses, "published": state, "ckpt": str(path)}, Path(out) / "r.pt"
            )
            await trainer.shutdown()

        asyncio.run(lead())
    else:
        trainer = Trainer(cfg)

        async def follow() -> None:
            await trainer.run_follower()
            await trainer.shutdown()

        asyncio.run(follow())
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_take_the_same_steps_as_one(tmp_path: Path) -> None:
    ctx = mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"2-rank run did not finish in {DEADLINE_S}s")
    two = torch.load(tmp_path / "r.pt", weights_only=True)

    alone = Trainer(_config(tmp_path / "alone"), source=_source(), sink=MemorySink())
    losses = [r.training_result.loss for r in alone.run_training(STEPS)]
    assert two["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    mine = full_state(alone.model)
    assert set(two["published"]) == set(mine)
    for name, value in mine.items():
        torch.testing.assert_close(two["published"][name], value, atol=2e-5, rtol=1e-4)
    alone.close()

    async def reload() -> None:
        resumed = Trainer(_config(tmp_path / "alone"), source=_source(), sink=MemorySink())
        await resumed.initialize()
        resumed.load_checkpoint(two["ckpt"])  # written by two ranks, read by one
        assert resumed.step == STEPS and resumed.version == STEPS
        for name, value in full_state(resumed.model).items():
            assert torch.equal(value, two["published"][name])
        await resumed.shutdown()

    asyncio.run(reload())
