"""`python -m astra.trainer --nproc 2` (torchrun, FSDP2 on gloo) against real Dataflow,
WeightService and a scripted rollout service: it trains, announces, checkpoints and exits 0."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from astra.trainer.checkpoint import list_checkpoints
from tests.conftest import save_tiny_trainer_model, scripted_system, start_two_rank_trainer

STEPS = 2


@pytest.mark.slow
def test_two_rank_trainer_process_trains_announces_and_checkpoints(
    tmp_path: Path, dataset: Path
) -> None:
    model = save_tiny_trainer_model(tmp_path / "model")
    env = {
        **os.environ,
        "ASTRA_TRAINER__BATCH__NUM_GROUPS": "2",
        "ASTRA_TRAINER__CHECKPOINT__EVERY_STEPS": str(STEPS),
    }

    async def body() -> None:
        async with scripted_system(tmp_path, dataset) as (df_server, client, weights):
            proc = await start_two_rank_trainer(
                df_server,
                weights,
                model,
                *("--num-steps", str(STEPS), "--checkpoint-dir", str(tmp_path / "ckpt")),
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
            try:
                out, err = await asyncio.wait_for(proc.communicate(), 80)
            finally:
                if proc.returncode is None:
                    proc.kill()
            assert proc.returncode == 0, err.decode()[-3000:]
            line = next(json.loads(x) for x in out.decode().splitlines() if x.startswith("{"))
            assert line["service"] == "trainer" and line["address"]
            (policy,) = (await client.get_status()).policies
            assert policy.current_version == STEPS and policy.leased_groups == 0

    asyncio.run(asyncio.wait_for(body(), 100))
    (ckpt,) = list_checkpoints(tmp_path / "ckpt")
    assert ckpt.name == f"step-{STEPS:09d}" and (ckpt / "model" / "config.json").is_file()
    assert json.loads((ckpt / "trainer.json").read_text())["world_size"] == 2


def test_flags_env_and_yaml_make_one_validated_config(tmp_path: Path, monkeypatch) -> None:
    from click.testing import CliRunner

    import astra.servers.trainer_serve as served
    from astra.trainer.cli import _argv, trainer_command

    seen = {}

    async def fake_serve(config) -> None:
        seen["config"] = config

    monkeypatch.setattr(served, "serve_trainer", fake_serve)
    monkeypatch.setenv("ASTRA_TRAINER__LOSS__CLIP_HIGH", "0.3")
    path = tmp_path / "t.yaml"
    path.write_text("policy_id: from-yaml\noptim:\n  lr: 0.01\ncheckpoint:\n  keep_last: 5\n")
    args = ["--config", str(path), "--policy", "p", "--checkpoint-dir", "/ck", "--resume"]
    result = CliRunner().invoke(trainer_command, args)
    assert result.exit_code == 0, result.output
    c = seen["config"]
    assert (c.policy_id, c.optim.lr, c.loss.clip_high) == ("p", 0.01, 0.3)
    assert (c.checkpoint.dir, c.checkpoint.resume, c.checkpoint.keep_last) == ("/ck", True, 5)
    bad = CliRunner().invoke(trainer_command, ["--policy", "p", "--resume"])
    assert bad.exit_code == 2 and "checkpoint.resume needs checkpoint.dir" in bad.output
    argv = _argv(str(path), "/ck", True, "info", {"policy_id": "p", "port": 0, "model": None})
    assert argv[:3] == ["--log-level=info", "--policy=p", "--port=0"]
    assert argv[3:] == [f"--config={path}", "--checkpoint-dir=/ck", "--resume"]
