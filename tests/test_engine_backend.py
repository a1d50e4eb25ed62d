"""EngineBackend: concurrent samples returned in order, failures counted per sample, reward
choice, the all-or-nothing weight swap, and a RolloutService serving it over a real socket."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest

from astra.clients.raas import RolloutClient
from astra.common.group_convert import incoming_group
from astra.common.v1 import rollout_pb2, version_pb2
from astra.errors import DataLoss, FailedPrecondition, InvalidArgument, Unavailable
from astra.raas.backend import VersionSpec
from astra.raas.engine_backend import EngineBackend
from astra.rewards import UnknownReward
from astra.servers.raas_serve import start_raas
from astra.workflows import WORKFLOWS, register_workflow, sample_seed
from astra.workflows.registry import UnknownWorkflow
from tests.test_workflows import ByteTokenizer, ScriptedTestEngine, make_group, run


def seed_echo(policy_id, prompt, sampling) -> str:
    return str(sampling.seed)


class FakeLoader:
    """Returns one small "tensor" per policy; fails for `fail_for` with `error`."""

    def __init__(self, fail_for: str | None = None, error: Exception | None = None) -> None:
        self.fail_for = fail_for
        self.error = error
        self.fetched: list[tuple[str, int, str]] = []
        self.cancelled: list[str] = []

    async def fetch(self, policy_id, version, weights_address):
        try:
            if policy_id == self.fail_for:
                await asyncio.sleep(0.01)
                raise self.error or Unavailable("gone", reason="WEIGHTS_UNAVAILABLE")
            await asyncio.sleep(0.2 if self.fail_for else 0)
        except asyncio.CancelledError:
            self.cancelled.append(policy_id)
            raise
        self.fetched.append((policy_id, version.version, weights_address))
        return {"w": f"{policy_id}@{version.version}"}, 100


# ----- generate ------------------------------------------------------------------------------


def test_samples_run_concurrently_and_come_back_in_order():
    n = 8
    engine = ScriptedTestEngine(seed_echo, delay=lambda s: (s.seed % 5) * 0.02)
    backend = EngineBackend(engine, ["single_turn"])
    group = make_group(n=n, seed=9, data={"answer": "0"})
    out = run(backend.generate(group, {"policy": 0}))
    assert [t.sample_index for t in out] == list(range(n))
    tok = ByteTokenizer()
    for i, t in enumerate(out):
        s = t.sequences[0]
        assert tok.decode(s.token_ids[s.prompt_length :].tolist()) == str(sample_seed(group, i))
    assert engine.max_in_flight == n
    assert backend.counters["samples"] == n and backend.counters["samples_failed"] == 0
    assert backend.engine == "scripted-test" and backend.policy_ids == ("policy",)
    assert backend.workflows == ("single_turn",)


def test_failed_samples_are_reported_and_counted_not_dropped():
    @register_workflow("test_odd_fails")
    async def odd_fails(ctx):
        if ctx.sample_index % 2:
            raise RuntimeError(f"sample {ctx.sample_index} broke")
        return await WORKFLOWS.get("single_turn")().run(ctx)

    try:
        engine = ScriptedTestEngine(lambda *a: "2")
        backend = EngineBackend(engine, ["test_odd_fails", "single_turn"])
        out = run(backend.generate(make_group(n=5, workflow="test_odd_fails"), {}))
        assert len(out) == 5
        assert [t.error is None for t in out] == [True, False, True, False, True]
        assert out[1].error == "RuntimeError: sample 1 broke" and out[1].sequences == []
        assert backend.counters["samples_failed"] == 2 and backend.counters["samples"] == 5
    finally:
        WORKFLOWS.remove("test_odd_fails")


def test_group_reward_overrides_the_workflow_default():
    engine = ScriptedTestEngine(lambda *a: "The answer: 2")
    backend = EngineBackend(engine, ["single_turn"])
    assert backend.default_reward("single_turn") == "numeric"
    default = run(backend.generate(make_group(), {}))
    assert default[0].reward == 1.0 and default[0].metadata["reward_fn"] == "numeric"
    exact = run(backend.generate(make_group(reward="exact_match"), {}))
    assert exact[0].reward == 0.0 and exact[0].metadata["reward_fn"] == "exact_match"
    with pytest.raises(UnknownReward, match="known: "):
        run(backend.generate(make_group(reward="no_such_reward"), {}))
    with pytest.raises(UnknownWorkflow, match="not served here"):
        run(backend.generate(make_group(workflow="multi_agent"), {}))
    with pytest.raises(InvalidArgument):
        run(backend.generate(make_group(policies=("stranger",)), {}))


def test_reward_allow_list():
    engine = ScriptedTestEngine(lambda *a: "2")
    backend = EngineBackend(engine, ["single_turn"], rewards=["exact_match"])
    assert run(backend.generate(make_group(reward="exact_match"), {}))[0].reward == 1.0
    assert run(backend.generate(make_group(), {}))[0].reward == 1.0  # the workflow default
    with pytest.raises(UnknownReward, match="not allowed here; allowed: exact_match"):
        run(backend.generate(make_group(reward="tests.test_rewards:half_reward"), {}))
    assert backend.check_reward("single_turn", "") == "numeric"
    with pytest.raises(UnknownReward):
        EngineBackend(engine, ["single_turn"], rewards=["typo"])


def test_unknown_workflow_at_construction_lists_known():
    with pytest.raises(UnknownWorkflow, match="single_turn"):
        EngineBackend(ScriptedTestEngine(seed_echo), ["nope"])


# ----- load_weights --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error", [Unavailable("gone", reason="UNAVAILABLE"), DataLoss("bad", reason="CHECKSUM")]
)
def test_load_weights_is_all_or_nothing(error):
    engine = ScriptedTestEngine(seed_echo, ("a", "b"), versions={"a": 1, "b": 1})
    loader = FakeLoader(fail_for="b", error=error)
    backend = EngineBackend(engine, ["single_turn"], loader)
    wanted = {"a": VersionSpec(2, "v2a"), "b": VersionSpec(2, "v2b")}
    with pytest.raises(type(error)):
        run(backend.load_weights(wanted, "weights:1"))
    assert engine.swaps == [] and engine.version("a") == 1 and engine.version("b") == 1
    assert loader.cancelled == ["a"]  # the other fetch did not run on
    assert backend.counters["weight_loads_failed"] == 1


def test_load_weights_swaps_every_policy_together():
    engine = ScriptedTestEngine(lambda *a: "1", ("a", "b"))
    loader = FakeLoader()
    backend = EngineBackend(engine, ["single_turn"], loader)
    fetched = run(backend.load_weights({"a": VersionSpec(3), "b": VersionSpec(3)}, "w:1"))
    assert fetched == 200 and sorted(loader.fetched) == [("a", 3, "w:1"), ("b", 3, "w:1")]
    assert engine.swaps == [({"a": 3, "b": 3}, {"a": {"w": "a@3"}, "b": {"w": "b@3"}})]
    out = run(backend.generate(make_group(policies=("b",)), {"a": 3, "b": 3}))
    seq = out[0].sequences[0]
    assert seq.weight_versions[seq.loss_mask == 1].tolist() == [3]


def test_load_weights_without_a_loader_or_for_an_unknown_policy():
    backend = EngineBackend(ScriptedTestEngine(seed_echo), ["single_turn"])
    with pytest.raises(FailedPrecondition):
        run(backend.load_weights({"policy": VersionSpec(1)}, "w"))
    backend.weight_loader = FakeLoader()
    with pytest.raises(InvalidArgument):
        run(backend.load_weights({"other": VersionSpec(1)}, "w"))


# ----- served over gRPC ----------------------------------------------------------------------


@asynccontextmanager
async def served(backend: EngineBackend):
    """A RolloutService (16 slots) over `backend` on a real socket, and a client to it."""
    server, servicer, _ = await start_raas(backend, capacity=16, grace_s=0.2)
    client = RolloutClient(server.address, timeout_s=5.0)
    try:
        yield client
    finally:
        await client.close()
        await server.stop(0)
        await servicer.close()


def test_rollout_service_over_engine_backend_produces_valid_results():
    async def body():
        def script(policy_id, prompt, sampling):
            if "<result>" in prompt:
                return "so 14"
            return '<tool name="calculator">2*7</tool>'

        engine = ScriptedTestEngine(script, ("policy",))
        backend = EngineBackend(engine, ["single_turn", "multi_turn_tools"], FakeLoader())
        async with served(backend) as client:
            group = rollout_pb2.PromptGroup(
                group_id="g1",
                workflow="multi_turn_tools",
                policy_ids=["policy"],
                prompt=rollout_pb2.Prompt(text="2*7="),
                num_samples=3,
                sampling_params=rollout_pb2.SamplingParams(max_new_tokens=64, seed=1),
                reward="numeric",
            )
            group.prompt.data.update({"answer": "14"})
            await client.submit_groups([group])
            results = []
            while not results:
                results = await client.collect_results(1, 1.0)
            incoming = incoming_group(results[0], "raas")
            assert incoming.error is None and incoming.invalid is None
            records = incoming.per_policy["policy"]
            assert [r.reward for r in records] == [1.0, 1.0, 1.0]
            assert all(not r.failed and r.min_version == 0 for r in records)
            meta = results[0].trajectories[0].metadata
            assert list(meta["tool_calls"]) == ["calculator"]
            version = version_pb2.PolicyVersion(policy_id="policy", version=1, version_id="v1")
            loaded = await client.load_weights([version], "weights:1", "req-1")
            assert loaded.fetched_bytes == 100 and engine.version("policy") == 1

    run(body())


def test_unknown_reward_is_refused_at_submit_and_the_server_keeps_serving():
    async def body():
        import grpc

        engine = ScriptedTestEngine(lambda *a: "1", ("policy",))
        backend = EngineBackend(engine, ["single_turn"], FakeLoader())
        async with served(backend) as client:
            group = rollout_pb2.PromptGroup(
                group_id="g1",
                workflow="single_turn",
                policy_ids=["policy"],
                prompt=rollout_pb2.Prompt(text="1="),
                num_samples=1,
                sampling_params=rollout_pb2.SamplingParams(max_new_tokens=4),
                reward="no_such_reward",
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.submit_groups([group])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "groups[0].reward" in info.value.details()
            status = await client.get_status()
            assert status.running_groups == 0 and status.free_slots == 16

    run(body())


def test_a_load_that_times_out_while_the_engine_swaps_still_reports_the_swap():
    """The engine installs a swap it was handed even when the LoadWeights that asked timed
    out; the RaaS must then report the versions it serves, not the old ones."""

    class SlowSwap(ScriptedTestEngine):
        async def swap_weights(self, versions, state) -> None:
            await asyncio.shield(asyncio.sleep(0.6))  # installing: not cancellable
            await super().swap_weights(versions, state)

    async def body():
        engine = SlowSwap(seed_echo, ("policy",), versions={"policy": 1})
        backend = EngineBackend(engine, ["single_turn"], FakeLoader())
        server, servicer, _ = await start_raas(
            backend, capacity=16, grace_s=0.2, load_timeout_s=0.2
        )
        client = RolloutClient(server.address, timeout_s=5.0)
        try:
            pv = version_pb2.PolicyVersion(policy_id="policy", version=2)
            with pytest.raises(Exception) as err:
                await client.load_weights([pv], "w:1", "r1")
            assert "did not finish" in str(err.value)
            for _ in range(50):
                await asyncio.sleep(0.05)
                if engine.version("policy") == 2:
                    break
            await asyncio.sleep(0.05)
            status = await client.get_status()
            return engine.version("policy"), {
                v.policy_id: v.version for v in status.loaded_versions
            }
        finally:
            await client.close()
            await server.stop(0)
            await servicer.close()

    engine_version, reported = run(body())
    assert engine_version == 2 and reported == {"policy": 2}
