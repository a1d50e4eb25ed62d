"""The trainer against real services: TrainerService over gRPC, versions in a WeightService
bit for bit, log-probs equal to the torch engine's, and a run against Dataflow + scripted RaaS."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astra.clients.trainer import TrainerClient
from astra.clients.trainer_sources import GRPC
from astra.clients.weights_stream import Receiver
from astra.engine.api import Sampling
from astra.engine.tiny import TINY_CONFIG, load_model, random_model, save_model
from astra.engine.torch_engine import TorchEngine
from astra.engine.torch_weights import load_state
from astra.servers.trainer_serve import start_trainer
from astra.servers.weights_serve import start_weights
from astra.trainer.config import TrainerConfig
from astra.trainer.loop import Trainer
from astra.trainer.parallel import full_state
from astra.trainer.step import sequence_logprobs
from astra.trainer.synthetic import MemorySink, SyntheticSource
from astra.weights.store import StoreConfig
from tests.conftest import error_info

T = 60  # seconds: every test body is bounded


def config(**over) -> TrainerConfig:
    raw = {"policy_id": "p", "port": None, "optim": {"lr": 1e-3}, "batch": {"num_groups": 2}}
    raw.update(over)
    return TrainerConfig.model_validate(raw)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, T))


def test_trainer_service_status_checkpoint_and_capabilities(tmp_path: Path) -> None:
    async def body() -> None:
        cfg = config(port=0, checkpoint={"dir": str(tmp_path)})
        source = SyntheticSource("p", vocab_size=100)
        server, trainer = await start_trainer(cfg, source=source, sink=MemorySink(), grace_s=0)
        async with TrainerClient(server.address) as client:
            health = health_pb2_grpc.HealthStub(client.channel)
            check = await health.Check(health_pb2.HealthCheckRequest())
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            await trainer.train_step_async()
            status = await client.get_status()
            assert (status.policy_id, status.step, status.world_size) == ("p", 1, 1)
            assert status.loss == trainer.last.metrics["loss"] and "grad_norm" in status.metrics
            first = await client.save_checkpoint("ck-1")
            again = await client.save_checkpoint("ck-1")
            assert first == again and first.step == 1 and Path(first.path).is_dir()
            status = await client.get_status()
            assert status.last_checkpoint_path == first.path
            assert status.version == 1 and status.last_checkpoint_time.seconds > 0
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await client.save_checkpoint("")
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            info, _ = error_info(exc.value)
            assert info is not None and info.reason == "INVALID_FIELD"
            caps = (await client.get_capabilities()).capabilities
            assert {"fsdp2", "ppo", "grpo"} <= set(caps.features)
        await server.stop(0)
        await trainer.shutdown()

    run(body())


def test_every_published_version_decodes_to_the_trainers_weights_bit_for_bit(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        store = StoreConfig(durable=False, full_every=2)
        service = await start_weights(tmp_path / "store", config=store, grace_s=0)
        cfg = config(weights=service.address, publish={"max_pending": 1})
        trainer = Trainer(cfg, source=SyntheticSource("p", vocab_size=100), connect=GRPC)
        await trainer.initialize()
        expected = {0: full_state(trainer.model)}
        async for result in trainer.run_training_async(3):
            expected[result.version] = full_state(trainer.model)
        receiver = Receiver(service.address, "p", tmp_path / "rx", durable=False, keep_versions=8)
        for version, state in expected.items():
            fetched = await receiver.fetch(str(version))
            got = load_state(fetched.path)
            assert set(got) == set(state)
            for name, value in state.items():
                assert got[name].dtype == value.dtype
                assert got[name].view(torch.uint8).equal(value.view(torch.uint8)), name
            assert (fetched.path / "config.json").is_file()
        # The engine loads a published version like any checkpoint.
        model, _ = load_model(fetched.path)
        for name, value in model.hf_state_dict().items():
            assert torch.equal(value, expected[3][name])
        await receiver.close()
        await trainer.shutdown()
        await service.stop(0)

    run(body())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_log_probs_equal_the_engines_for_the_same_weights_and_tokens(
    temperature: float,
) -> None:
    async def body() -> None:
        trainer = Trainer(
            config(loss={"temperature": temperature}), source=SyntheticSource("p", vocab_size=100)
        )
        await trainer.initialize()
        async for _ in trainer.run_training_async(2):  # weights the engine has never seen
            pass
        state = full_state(trainer.model)
        engine_model = random_model(TINY_CONFIG, 123)
        engine_model.load_weights({**state, "lm_head.weight": state["model.embed_tokens.weight"]})
        engine = TorchEngine({"p": (engine_model, load_model("tiny")[1])})
        prompts = [[1, 5, 9, 13], [2, 4, 6, 8, 10, 12, 14]]
        sampling = Sampling(max_new_tokens=12, temperature=temperature, seed=3)
        gens = await asyncio.gather(*(engine.generate("p", p, sampling) for p in prompts))
        await engine.close()
        for prompt, gen in zip(prompts, gens, strict=True):
            ids = torch.tensor([prompt + gen.token_ids])
            mine = sequence_logprobs(trainer.model, ids, temperature)[0, len(prompt) - 1 :]
            torch.testing.assert_close(mine, torch.tensor(gen.logprobs), atol=2e-5, rtol=0)
        await trainer.shutdown()

    run(body())


def test_a_run_against_dataflow_and_a_scripted_rollout_service(tmp_path: Path, dataset) -> None:
    from astra.raas.scripted import VOCAB_SIZE
    from tests.conftest import scripted_system

    model_dir = tmp_path / "model"  # the scripted RaaS samples ids from a 32000-token vocabulary
    save_model(model_dir, random_model({**TINY_CONFIG, "vocab_size": VOCAB_SIZE}, 1), {
        **TINY_CONFIG, "vocab_size": VOCAB_SIZE
    })  # fmt: skip

    async def body() -> None:
        async with scripted_system(tmp_path, dataset) as (df_server, _, service):
            cfg = config(
                policy_id="policy",
                model=str(model_dir),
                dataflow=df_server.address,
                weights=service.address,
                batch={"num_groups": 2, "max_wait_s": 5.0},
            )
            trainer = Trainer(cfg, connect=GRPC)
            try:
                results = [r async for r in trainer.run_training_async(2)]
                assert [r.version for r in results] == [1, 2]
                assert not any(r.skipped for r in results)
                assert all(r.num_trajectories == 8 for r in results)  # 2 groups of 4
                status = await trainer.source.client.get_status()  # type: ignore[union-attr]
                (policy,) = status.policies
                assert policy.current_version == 2 and policy.leased_groups == 0
                assert trainer.counters["ack_failures"] == 0
                assert trainer.publisher.stats.last_announced == 2
            finally:
                await trainer.shutdown()

    run(body())


def test_pause_stops_new_steps_until_resume_and_checkpoints_still_work(tmp_path: Path) -> None:
    async def body() -> None:
        cfg = config(port=0, checkpoint={"dir": str(tmp_path)})
        source = SyntheticSource("p", vocab_size=100)
        server, trainer = await start_trainer(cfg, source=source, sink=MemorySink(), grace_s=0)
        steps = trainer.run_training_async(0)  # no end: only the pause stops it
        async with TrainerClient(server.address) as client:
            await anext(steps)
            first = await client.pause("operator: look at the buffer", wait=True)
            assert first.idle and first.step == 1
            again = await client.pause("second reason")  # idempotent: replaces the reason
            assert again.idle and again.step == 1
            status = await client.get_status()
            assert status.paused and status.pause_reason == "second reason"
            assert not status.step_in_progress
            nxt = asyncio.ensure_future(anext(steps))
            await asyncio.sleep(0.5)
            assert not nxt.done() and trainer.step == 1 and len(source.batches) == 1
            saved = await client.save_checkpoint("while-paused")  # served while paused
            assert saved.step == 1 and Path(saved.path).is_dir()
            resumed = await client.resume()
            assert resumed.step == 1 and resumed.paused_seconds >= 0.5
            result = await asyncio.wait_for(nxt, 10)
            assert result.step == 2 and not (await client.get_status()).paused
            assert (await client.resume()).step == 2  # resuming a running trainer: no-op
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await client.pause("x" * 257)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            info, _ = error_info(exc.value)
            assert info is not None and "reason" in exc.value.details()
            assert "pause" in (await client.get_capabilities()).capabilities.features
        await steps.aclose()
        await server.stop(0)
        await trainer.shutdown()

    run(body())
