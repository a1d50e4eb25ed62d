"""The trainer with `lora:`: start-up refusals, adapter-only training, versions in a real
WeightService, checkpoints and resume (base digest checked), the merged export, two ranks."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner

from astra.cli import main
from astra.clients.trainer_sources import GRPC
from astra.clients.weights_stream import Receiver
from astra.config import ConfigError, load_config
from astra.engine.tiny import TINY_CONFIG, load_model, random_model, save_model, tiny_model
from astra.engine.torch_weights import load_state
from astra.lora.format import ADAPTER_FILE, AdapterConfig, AdapterError, base_digest
from astra.servers.weights_serve import start_weights
from astra.trainer import lora
from astra.trainer.checkpoint import read_checkpoint
from astra.trainer.config import TrainerConfig
from astra.trainer.loop import Trainer
from astra.trainer.parallel import full_state
from astra.trainer.synthetic import MemorySink, SyntheticSource
from astra.weights.store import StoreConfig

T = 90  # seconds: every async test body is bounded
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def config(**over) -> TrainerConfig:
    raw = {
        "policy_id": "p",
        "port": None,
        "optim": {"lr": 1e-2},
        "batch": {"num_groups": 2, "max_tokens_per_microbatch": 48},
        "lora": LORA,
    }
    raw.update(over)
    return TrainerConfig.model_validate(raw)


class FixedSource(SyntheticSource):
    """Every fetch returns the same groups: repeated steps on one batch lower its loss."""

    async def fetch(self, request_id, num_groups, trainer_version=0):
        return await super().fetch("fixed", num_groups, trainer_version)


def source() -> SyntheticSource:
    return SyntheticSource("p", vocab_size=100, max_lag=1)


def adapter_names(trainer: Trainer) -> set[str]:
    return {n for n, p in trainer.model.named_parameters() if p.requires_grad}


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, T))


def init(cfg: TrainerConfig) -> None:
    async def body() -> None:
        t = Trainer(cfg, source=source(), sink=MemorySink())
        try:
            await t.initialize()
        finally:
            await t.shutdown()

    run(body())


def test_bad_lora_settings_fail_at_start_up_naming_the_key():
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        load_config(
            TrainerConfig, env_prefix="X", overrides={"policy_id": "p", "lora": {"rank": 0}}
        )
    with pytest.raises(ConfigError, match=r"lora\.target_modules"):
        load_config(
            TrainerConfig,
            env_prefix="X",
            overrides={"policy_id": "p", "lora": {"target_modules": ["q proj"]}},
        )
    with pytest.raises(ConfigError, match=r"trainer\.lora\.target_modules: \['qkv_proj'\].*q_proj"):
        init(config(lora={**LORA, "target_modules": ["q_proj", "qkv_proj"]}))
    with pytest.raises(ConfigError, match=r"trainer\.lora\.target_modules: \['embed_tokens'\]"):
        init(config(lora={**LORA, "target_modules": ["embed_tokens"]}))
    with pytest.raises(ConfigError, match=r"trainer\.lora\.target_modules: .*tied lm_head"):
        init(config(lora={**LORA, "target_modules": ["lm_head"]}))
    with pytest.raises(ConfigError, match=r"trainer\.lora\.rank: 65 .*at most 64"):
        init(config(lora={**LORA, "rank": 65}))


def test_the_trainer_command_says_a_bad_target_in_one_line(tmp_path: Path):
    env = {**os.environ, "ASTRA_TRAINER__LORA__TARGET_MODULES": "[qkv_proj]"}
    proc = subprocess.run(
        [sys.executable, "-m", "astra.trainer", "--policy=p", "--port=0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "trainer.lora.target_modules" in last and "qkv_proj" in last and "q_proj" in last


def test_lora_training_lowers_the_loss_and_changes_only_the_adapter():
    t = Trainer(config(), source=FixedSource("p", vocab_size=100), sink=MemorySink())
    results = []
    for r in t.run_training(6):
        if not results:
            before = full_state(t.model)  # after step 1 too: compare what later steps change
        results.append(r)
    losses = [r.training_result.loss for r in results]
    assert losses[-1] < losses[0] - 0.05, losses
    after = full_state(t.model)
    trained = adapter_names(t)
    assert trained == {
        f"model.layers.{i}.{m}.lora_{ab}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
        for ab in "AB"
    }
    assert {id(p) for g in t.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in t.model.parameters() if p.requires_grad
    }
    for name, value in after.items():
        if name in trained:
            assert not torch.equal(value, before[name]), name
        else:
            assert torch.equal(value, before[name]), name
    base = tiny_model().hf_state_dict()
    for name, value in base.items():  # the base is the one loaded, bit for bit
        assert torch.equal(after[name], value), name
    assert all(r.metrics["grad_norm"] > 0 for r in results)
    t.close()


def test_clipping_holds_the_adapter_gradient_norm():
    t = Trainer(
        config(optim={"lr": 1e-2, "max_grad_norm": 1e-3}),
        source=FixedSource("p", vocab_size=100),
        sink=MemorySink(),
    )
    (r,) = list(t.run_training(1))
    assert r.metrics["grad_norm"] > 1e-3  # reported before clipping
    state = t.optimizer.state
    assert state and all(float(s["step"]) == 1.0 for s in state.values())
    t.close()


def test_published_versions_hold_only_the_adapter_and_its_file(tmp_path: Path):
    async def body() -> None:
        store = StoreConfig(durable=False, full_every=2)  # versions 1 and 3 are xor deltas
        service = await start_weights(tmp_path / "store", config=store, grace_s=0)
        cfg = config(weights=service.address, publish={"max_pending": 1})
        trainer = Trainer(cfg, source=source(), connect=GRPC)
        await trainer.initialize()
        keep = lora.keep(trainer.adapter)
        expected = {0: full_state(trainer.model, keep=keep)}
        async for result in trainer.run_training_async(3):
            expected[result.version] = full_state(trainer.model, keep=keep)
        receiver = Receiver(service.address, "p", tmp_path / "rx", durable=False, keep_versions=8)
        digest = base_digest(tiny_model().hf_state_dict())
        for version, state in expected.items():
            fetched = await receiver.fetch(str(version))
            got = load_state(fetched.path)
            assert set(got) == set(state) == adapter_names(trainer)
            for name, value in state.items():
                assert got[name].view(torch.uint8).equal(value.view(torch.uint8)), name
            files = {p.name for p in fetched.path.iterdir() if not p.name.endswith(".safetensors")}
            assert ADAPTER_FILE in files and "config.json" not in files
            saved = AdapterConfig.from_json((fetched.path / ADAPTER_FILE).read_bytes())
            assert (saved.rank, saved.alpha, saved.base_digest) == (4, 8.0, digest)
            assert saved.targets == ("q_proj", "v_proj", "down_proj")
        full_bytes = sum(v.nbytes for v in tiny_model().hf_state_dict().values())
        assert trainer.publisher.stats.bytes_published < full_bytes * 4 / 10
        await receiver.close()
        await trainer.shutdown()
        await service.stop(0)

    run(body())


def test_a_checkpoint_holds_the_adapter_and_a_resume_continues_it_exactly(tmp_path: Path):
    root = tmp_path / "a"
    whole = Trainer(config(checkpoint={"dir": str(tmp_path / "w")}), source=source(), sink=None)
    losses = [r.training_result.loss for r in whole.run_training(3)]
    final = full_state(whole.model)
    whole.close()

    first = Trainer(config(checkpoint={"dir": str(root)}), source=source(), sink=None)
    head = [r.training_result.loss for r in first.run_training(2)]
    path = first.save_checkpoint()
    first.close()
    ckpt = read_checkpoint(path)
    assert set(ckpt.model) == adapter_names(first)  # the adapter only
    assert set(ckpt.optimizer["state"]) == adapter_names(first)
    saved = AdapterConfig.from_json((path / "model" / ADAPTER_FILE).read_bytes())
    assert saved.base_digest == first.adapter.config.base_digest

    second = Trainer(
        config(checkpoint={"dir": str(root), "resume": True}), source=source(), sink=None
    )
    tail = [r.training_result.loss for r in second.run_training(1)]
    assert head + tail == losses  # bit-identical: same adapter, moments and batches
    resumed = full_state(second.model)
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name
    second.close()


def test_a_resume_refuses_another_base_another_adapter_or_full_fine_tuning(tmp_path: Path):
    root = tmp_path / "ckpt"
    first = Trainer(config(checkpoint={"dir": str(root)}), source=source(), sink=None)
    list(first.run_training(1))
    first.save_checkpoint()
    first.close()
    other = tmp_path / "other"
    save_model(other, random_model(TINY_CONFIG, 7), TINY_CONFIG)
    resume = {"dir": str(root), "resume": True}
    with pytest.raises(AdapterError) as e:
        init(config(model=str(other), checkpoint=resume))
    assert e.value.field == "base_digest" and "base_digest" in str(e.value)
    with pytest.raises(ConfigError, match=r"trainer\.lora\.rank: .* 4"):
        init(config(checkpoint=resume, lora={**LORA, "rank": 2}))
    with pytest.raises(ConfigError, match=r"trainer\.lora: .*holds a LoRA adapter"):
        init(config(checkpoint=resume, lora=None))


def test_the_merged_export_computes_the_adapted_models_logits(tmp_path: Path):
    t = Trainer(config(checkpoint={"dir": str(tmp_path / "ckpt")}), source=source(), sink=None)
    list(t.run_training(3))
    ckpt = t.save_checkpoint()
    path = lora.export_merged(
        tmp_path / "merged", full_state(t.model), t.hf_config, t.adapter.config
    )
    out = tmp_path / "from-cli"
    cli = CliRunner().invoke(
        main, ["trainer", "merge-lora", str(ckpt), "--model=tiny", f"--out={out}"]
    )
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.output)["out"] == str(out.resolve())
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        adapted = t.model.eval()(ids)
        base = tiny_model()(ids)
        merged = load_model(path)[0](ids)
        from_checkpoint = load_model(out)[0](ids)
    assert not torch.allclose(adapted, base, atol=1e-4)  # training moved the adapter
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_checkpoint, adapted, rtol=1e-5, atol=1e-5)
    assert "merged_from" in json.loads((path / lora.MERGE_FILE).read_text())
    other = tmp_path / "other"
    save_model(other, random_model(TINY_CONFIG, 7), TINY_CONFIG)
    refused = CliRunner().invoke(
        main, ["trainer", "merge-lora", str(ckpt), f"--model={other}", f"--out={tmp_path / 'x'}"]
    )
    assert refused.exit_code == 1 and "base_digest" in refused.output
    t.close()


STEPS = 2
DEADLINE_S = 90.0


def _fsdp_config(root: Path) -> TrainerConfig:
    batch = {"num_groups": 2, "max_tokens_per_microbatch": 24}
    return config(batch=batch, optim={"lr": 1e-3}, checkpoint={"dir": str(root)})


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    cfg = _fsdp_config(Path(out) / "ckpt")
    if rank == 0:
        sink = MemorySink()
        trainer = Trainer(cfg, source=source(), sink=sink)

        async def lead() -> None:
            losses = [r.training_result.loss async for r in trainer.run_training_async(STEPS)]
            path = trainer.save_checkpoint()
            published = {k: bytes(b) for k, (_, _, b) in sink.versions[STEPS].items()}
            torch.save({"losses": losses, "published": published, "ckpt": str(path)},
                       Path(out) / "r.pt")  # fmt: skip
            await trainer.shutdown()

        asyncio.run(lead())
    else:
        trainer = Trainer(cfg)

        async def follow() -> None:
            await trainer.run_follower()
            await trainer.shutdown()

        asyncio.run(follow())
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_fsdp_ranks_train_the_adapter_as_one_rank(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.spawn(_worker, args=(2, port, str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"2-rank run did not finish in {DEADLINE_S}s")
    two = torch.load(tmp_path / "r.pt", weights_only=True)
    alone = Trainer(_fsdp_config(tmp_path / "alone"), source=source(), sink=MemorySink())
    losses = [r.training_result.loss for r in alone.run_training(STEPS)]
    # Losses near 0: the sum over ranks differs from one process in the last bits.
    assert two["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    mine = alone.sink.versions[STEPS]
    assert set(two["published"]) == set(mine) == adapter_names(alone)
    for name, (_, shape, raw) in mine.items():
        ours = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)
        theirs = torch.frombuffer(bytearray(two["published"][name]), dtype=torch.float32)
        # Adam's first steps are nearly sign(g) (A's gradient is ~0 while B starts at 0), so
        # last-bit differences of the summed gradients move an element by a part of lr (1e-3).
        torch.testing.assert_close(theirs.reshape(shape), ours, atol=1e-4, rtol=1e-3)
    ckpt = read_checkpoint(two["ckpt"])  # written by two ranks: the adapter only
    assert set(ckpt.model) == adapter_names(alone)
    alone.close()


def test_a_recipes_trainer_lora_reaches_the_trainer_config(tmp_path: Path):
    from astra.run import layout
    from astra.run.recipe import load_recipe

    r = load_recipe(None, ["trainer.lora={rank: 8, target_modules: [q_proj]}"])
    rd = layout.RunDir(tmp_path / "run")
    cfg = layout.trainer_config(r, r.policies[0], rd, dataflow="h:1", weights="h:2", resume=False)
    assert cfg.lora is not None and (cfg.lora.rank, cfg.lora.target_modules) == (8, ["q_proj"])
    assert cfg.lora.alpha == 32.0  # the trainer's default
    plain = load_recipe(None, [])
    cfg = layout.trainer_config(
        plain, plain.policies[0], rd, dataflow="h:1", weights="h:2", resume=False
    )
    assert cfg.lora is None
