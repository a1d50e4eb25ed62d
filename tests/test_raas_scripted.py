"""RaaS with the scripted generator: ResultStore rules, RolloutService over a real socket,
bad input on every RPC, registration with Dataflow, and the runnable process."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from contextlib import asynccontextmanager

import grpc
import numpy as np
import pytest
from google.rpc import code_pb2, error_details_pb2

from astra.clients.raas import RolloutClient
from astra.clients.registrar import Registrar
from astra.common.group_convert import incoming_group
from astra.common.v1 import rollout_pb2, version_pb2
from astra.dataflow.v1 import dataflow_service_pb2 as df_pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as df_grpc
from astra.errors import NotFound, ResourceExhausted
from astra.raas.backend import GroupSpec
from astra.raas.results import ResultStore
from astra.raas.scripted import PROMPT_LENGTH, LatencyModel, ScriptedGenerator
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.servers.raas_serve import start_raas
from astra.servers.runtime import GrpcServer
from astra.testing import scripted_raas
from tests.conftest import error_info
from tests.procs import Proc


def run(coro, timeout_s: float = 30.0):
    """Runs one test body on a fresh loop, bounded."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def group(gid: str, n: int = 4, *, policies=("policy",), workflow="single_turn", tokens=16):
    return rollout_pb2.PromptGroup(
        group_id=gid,
        workflow=workflow,
        policy_ids=list(policies),
        prompt=rollout_pb2.Prompt(text="1+1="),
        num_samples=n,
        sampling_params=rollout_pb2.SamplingParams(max_new_tokens=tokens, seed=7),
    )


@asynccontextmanager
async def raas(capacity: int = 64, backend=None, **kwargs):
    backend = backend or ScriptedGenerator(("policy", "other"), ("single_turn",))
    server, servicer, registrar = await start_raas(
        backend, capacity=capacity, instance_id="raas-test", grace_s=0.5, **kwargs
    )
    client = RolloutClient(server.address, timeout_s=5.0)
    try:
        yield client, servicer
    finally:
        await client.close()
        if registrar is not None:
            await registrar.stop()
        await server.stop(0)
        await servicer.close()


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# ----- ResultStore ---------------------------------------------------------------------------


def test_store_accept_is_idempotent_and_all_or_nothing():
    store = ResultStore(10)
    first = store.try_accept([("a", 6)])
    assert first.accepted == ["a"] and first.new == ["a"] and store.free_slots == 4
    again = store.try_accept([("a", 6)])
    assert again.accepted == ["a"] and again.new == [] and store.free_slots == 4
    with pytest.raises(ResourceExhausted) as info:
        store.try_accept([("a", 6), ("b", 3), ("c", 3)])
    assert info.value.reason == "NO_FREE_SLOTS" and info.value.retry_after_s == 0.5
    assert not store.holds("b") and not store.holds("c") and store.free_slots == 4
    assert store.try_accept([("b", 2), ("b", 2), ("c", 2)]).new == ["b", "c"]
    assert store.free_slots == 0 and store.running == 3


def test_store_slots_free_on_finish_and_cancel_not_on_ack():
    store = ResultStore(8)
    store.try_accept([("a", 4), ("b", 4)])
    assert store.finish("a", "result-a") and store.free_slots == 4 and store.pending == 1
    assert store.cancel(["b", "zzz"]) == ["b"] and store.free_slots == 8
    assert not store.finish("b", "late")  # a cancelled group produces no result
    assert store.counters["results_dropped_not_running"] == 1
    assert store.ack(["a"]) == (1, 0) and store.free_slots == 8 and store.pending == 0


def test_store_collect_oldest_first_until_ack_and_acked_ids_remembered():
    async def body():
        store = ResultStore(16)
        store.try_accept([("a", 1), ("b", 1), ("c", 1)])
        for gid in ("b", "a", "c"):
            store.finish(gid, gid)
        assert await store.collect(2, 0) == ["b", "a"]
        assert await store.collect(10, 0) == ["b", "a", "c"]  # not removed by collect
        assert store.ack(["a", "a", "unknown"]) == (1, 2)
        assert await store.collect(10, 0) == ["b", "c"]
        # An acknowledged id comes back: reported accepted, not run again.
        assert store.try_accept([("a", 1)]).new == [] and store.running == 0
        # Waiting collect wakes when a result arrives, and is bounded otherwise.
        store.ack(["b", "c"])
        assert await store.collect(1, 0.05) == []
        store.try_accept([("d", 1)])
        waiter = asyncio.create_task(store.collect(1, 5.0))
        await asyncio.sleep(0.01)
        store.finish("d", "d")
        assert await asyncio.wait_for(waiter, 1.0) == ["d"]

    run(body())


def test_store_remember_acked_is_bounded_and_can_be_off():
    store = ResultStore(4, remember_acked=2)
    for gid in ("a", "b", "c"):
        store.try_accept([(gid, 1)])
        store.finish(gid, gid)
        store.ack([gid])
    assert store.try_accept([("a", 1)]).new == ["a"]  # evicted from the LRU: runs again
    assert store.try_accept([("c", 1)]).new == []
    off = ResultStore(4, remember_acked=0)
    off.try_accept([("a", 1)])
    off.finish("a", "a")
    off.ack(["a"])
    assert off.try_accept([("a", 1)]).new == ["a"]


# ----- ScriptedGenerator ---------------------------------------------------------------------


def test_scripted_generator_is_deterministic_and_well_formed():
    async def body():
        gen = ScriptedGenerator(("p", "q"), ("single_turn",))
        spec = GroupSpec("g/0/1", "single_turn", ("p", "q"), num_samples=8, max_new_tokens=32)
        a = await gen.generate(spec, {"p": 3, "q": 5})
        b = await gen.generate(spec, {"p": 3, "q": 5})
        assert len(a) == 8
        for ta, tb in zip(a, b, strict=True):
            assert [s.agent_id for s in ta.sequences] == ["p", "q"]
            assert set(ta.agent_rewards) == {"p", "q"}
            for s, s2 in zip(ta.sequences, tb.sequences, strict=True):
                assert np.array_equal(s.token_ids, s2.token_ids) and s.reward == s2.reward
                n = len(s.token_ids)
                assert 1 <= n - PROMPT_LENGTH <= 32 and s.prompt_length == PROMPT_LENGTH
                assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
                assert s.loss_mask.dtype == np.uint8 and s.weight_versions.dtype == np.int64
                assert (s.loss_mask[:PROMPT_LENGTH] == 0).all() and (s.loss_mask[8:] == 1).all()
                assert (s.weight_versions[:PROMPT_LENGTH] == -1).all()
                assert (s.weight_versions[8:] == {"p": 3, "q": 5}[s.policy_id]).all()
                assert (s.logprobs[8:] < 0).all() and np.isfinite(s.logprobs).all()
                assert s.reward in (0.0, 1.0)
        fixed = ScriptedGenerator(tokens_override=1024)
        one = GroupSpec("x", "single_turn", ("policy",), num_samples=2, max_new_tokens=4)
        for t in await fixed.generate(one, {"policy": 0}):
            assert len(t.sequences[0].token_ids) == PROMPT_LENGTH + 1024
            assert t.sequences[0].agent_id == "" and t.agent_rewards == {}
        # Across groups rewards vary; some groups are all-equal, some are mixed.
        kinds = set()
        for i in range(40):
            spec = GroupSpec(f"g/{i}", "single_turn", ("policy",), num_samples=8, max_new_tokens=4)
            rewards = {t.reward for t in await fixed.generate(spec, {})}
            kinds.add("equal" if len(rewards) == 1 else "mixed")
        assert kinds == {"equal", "mixed"}

    run(body())


def test_latency_model_is_seeded_lognormal_and_a_group_waits_for_its_slowest_sample():
    model = LatencyModel.parse("lognormal:-3.0,0.5", seed=7)
    assert (model.mu, model.sigma, model.seed) == (-3.0, 0.5, 7)
    for bad in ("normal:1,2", "lognormal:1", "lognormal:a,b", "lognormal", "lognormal:0,-1"):
        with pytest.raises(ValueError):
            LatencyModel.parse(bad)
    draws = np.array([model.sample_seconds(f"s/0/{i}", i, 0) for i in range(4000)])
    logs = np.log(draws)
    assert abs(np.median(logs) + 3.0) < 0.05 and abs(logs.std() - 0.5) < 0.05
    # A pure function of (seed, group, group seed, sample): the same workload, the same time.
    assert model.sample_seconds("g", 1, 2) == LatencyModel(-3.0, 0.5, 7).sample_seconds("g", 1, 2)
    assert model.sample_seconds("g", 1, 2) != LatencyModel(-3.0, 0.5, 8).sample_seconds("g", 1, 2)
    assert model.group_seconds("g", 1, 8) == max(model.sample_seconds("g", 1, i) for i in range(8))

    async def body():
        gen = ScriptedGenerator(latency=LatencyModel(-3.0, 0.5))  # median 50 ms per sample
        spec = GroupSpec("g/0/3", "single_turn", ("policy",), num_samples=4, max_new_tokens=4)
        want = gen.latency.group_seconds(spec.group_id, spec.seed, 4)
        loop = asyncio.get_running_loop()
        start = loop.time()
        out = await gen.generate(spec, {"policy": 0})
        assert loop.time() - start >= want * 0.99
        assert {t.metadata["latency_s"] for t in out} == {want}
        plain = await ScriptedGenerator().generate(spec, {"policy": 0})
        assert "latency_s" not in plain[0].metadata

    run(body())
    args = scripted_raas.parse_args(["--latency", "lognormal:-2,0.25", "--latency-seed", "3"])
    assert args.latency == LatencyModel(-2.0, 0.25, 3) and args.delay == 0.05
    assert scripted_raas.parse_args([]).latency is None
    with pytest.raises(SystemExit):
        scripted_raas.parse_args(["--latency", "uniform:0,1"])


# ----- RolloutService over gRPC --------------------------------------------------------------


def test_submit_collect_ack_and_duplicates_not_rerun():
    async def body():
        gen = ScriptedGenerator(("policy", "other"), ("single_turn",))
        async with raas(capacity=16, backend=gen) as (client, servicer):
            assert await client.check_health()
            resp = await client.submit_groups(
                [group("g/0/0"), group("g/0/1", policies=("policy", "other"))]
            )
            assert list(resp.accepted_group_ids) == ["g/0/0", "g/0/1"]
            dup = await client.submit_groups([group("g/0/0")])
            assert list(dup.accepted_group_ids) == ["g/0/0"]
            await until(lambda: servicer.store.pending == 2)
            first = await client.collect_results(10, 1.0)
            again = await client.collect_results(10, 0.0)
            assert [r.group_id for r in first] == [r.group_id for r in again]
            assert {r.group_id for r in first} == {"g/0/0", "g/0/1"}
            for r in first:
                assert r.instance_id == "raas-test" and len(r.trajectories) == 4
                assert [t.trajectory_id for t in r.trajectories] == [
                    f"{r.group_id}/{i}" for i in range(4)
                ]
                parsed = incoming_group(r, r.instance_id)  # Dataflow's own validation
                assert parsed.invalid is None and parsed.error is None, parsed.invalid
            multi = next(r for r in first if r.group_id == "g/0/1")
            seq = multi.trajectories[0].sequences
            assert [s.policy_id for s in seq] == ["policy", "other"]
            assert seq[0].finish_reason in (
                rollout_pb2.FINISH_REASON_STOP,
                rollout_pb2.FINISH_REASON_LENGTH,
            )
            assert gen.generated_groups == 2  # the duplicate did not run
            ack = await client.ack_results(["g/0/0", "g/0/1", "nope"])
            assert (ack.acknowledged, ack.ignored) == (2, 1)
            assert await client.collect_results(10, 0.05) == []
            again = await client.submit_groups([group("g/0/0")])  # acknowledged: not rerun
            assert list(again.accepted_group_ids) == ["g/0/0"] and gen.generated_groups == 2
            status = await client.get_status()
            assert (status.free_slots, status.running_groups, status.pending_results) == (16, 0, 0)
            assert status.engine == "scripted" and status.counters["groups_finished"] == 2
            caps = (await client.get_capabilities()).capabilities
            assert caps.contract_version == "1.0.0" and {"cancel", "multi_policy"} <= set(
                caps.features
            )

    run(body())


def test_an_instance_whose_engine_failed_refuses_groups_as_unavailable():
    # Health turns NOT_SERVING, but Dataflow probes health only for suspects: accepting the
    # groups would end each as a failed result, burning the dataset on a dead engine.
    async def body():
        async with raas(capacity=8) as (client, servicer):
            servicer.unavailable = "its engine failed"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.submit_groups([group("a", 4)])
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            detail, others = error_info(info.value)
            assert detail.reason == "ENGINE_UNAVAILABLE"
            assert any(isinstance(o, error_details_pb2.RetryInfo) for o in others)
            assert not servicer.store.holds("a")

    run(body())


def test_full_instance_refuses_all_with_retry_info_and_cancel_frees_slots():
    async def body():
        gen = ScriptedGenerator(delay_s=30.0)
        async with raas(capacity=8, backend=gen) as (client, servicer):
            await client.submit_groups([group("a", 4), group("b", 4)])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.submit_groups([group("c", 1), group("a", 4)])
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            detail, others = error_info(info.value)
            assert detail.reason == "NO_FREE_SLOTS" and detail.domain == "astra.raas.v1"
            assert any(isinstance(o, error_details_pb2.RetryInfo) for o in others)
            assert not servicer.store.holds("c")
            resp = await client.cancel_groups(["a", "unknown"])
            assert resp.cancelled == 1 and (await client.get_status()).free_slots == 4
            assert (await client.cancel_groups(["a"])).cancelled == 0  # idempotent
            assert await client.collect_results(10, 0.1) == []  # cancelled: no result
            assert list((await client.submit_groups([group("c", 4)])).accepted_group_ids) == ["c"]

    run(body())


def test_backend_failure_becomes_counted_group_error():
    class Broken(ScriptedGenerator):
        async def generate(self, group, versions):
            raise RuntimeError("engine on fire")

    async def body():
        async with raas(backend=Broken()) as (client, _servicer):
            await client.submit_groups([group("bad")])
            results = await client.collect_results(1, 5.0)
            assert len(results) == 1 and results[0].error.code == code_pb2.INTERNAL
            assert "engine on fire" in results[0].error.message
            assert incoming_group(results[0], "x").error is not None
            assert (await client.get_status()).counters["groups_failed"] == 1
            assert await client.check_health()

    run(body())


def test_load_weights_versions_tokens_and_regression():
    def pv(policy, version):
        return version_pb2.PolicyVersion(policy_id=policy, version=version)

    async def body():
        gen = ScriptedGenerator(("policy", "other"), ("single_turn",))
        async with raas(backend=gen) as (client, _servicer):
            resp = await client.load_weights([pv("policy", 2), pv("other", 1)], "w:1", "r1")
            assert {v.policy_id: v.version for v in resp.loaded_versions} == {
                "policy": 2,
                "other": 1,
            }
            assert gen.loaded["policy"].version == 2
            same = await client.load_weights([pv("policy", 2)], "w:1", "r1b")
            assert same.fetched_bytes == 0
            await client.submit_groups([group("v", 2, policies=("policy", "other"))])
            (result,) = await client.collect_results(1, 5.0)
            for seq in result.trajectories[0].sequences:
                versions = np.frombuffer(seq.weight_versions.data, dtype="<i8")
                assert set(versions[versions >= 0]) == {2 if seq.policy_id == "policy" else 1}
            await expect(
                client.load_weights([pv("policy", 1)], "w:1", "r2"),
                grpc.StatusCode.FAILED_PRECONDITION,
                "VERSION_REGRESSION",
            )
            status = await client.get_status()
            assert {v.policy_id: v.version for v in status.loaded_versions}["policy"] == 2
            # A late retry of r1 gets r1's answer, not a regression; r1 for another set is
            # a caller's bug.
            await client.load_weights([pv("policy", 3)], "w:1", "r3")
            retry = await client.load_weights([pv("policy", 2), pv("other", 1)], "w:1", "r1")
            assert {v.policy_id: v.version for v in retry.loaded_versions}["policy"] == 2
            await expect(
                client.load_weights([pv("policy", 4)], "w:1", "r1"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "REQUEST_ID_REUSED",
                "request_id",
            )

    run(body())


async def expect(call, code: grpc.StatusCode, reason: str, field: str | None = None):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    exc = info.value
    assert exc.code() == code, exc.details()
    detail, others = error_info(exc)
    assert detail is not None and detail.reason == reason, (detail, exc.details())
    assert detail.domain == "astra.raas.v1"
    if field is not None:
        fields = [
            v.field
            for o in others
            if isinstance(o, error_details_pb2.BadRequest)
            for v in o.field_violations
        ]
        assert field in fields, (fields, exc.details())


def _collect(stub, max_groups, wait_s=None):
    req = pb.CollectResultsRequest(max_groups=max_groups)
    if wait_s is not None:
        req.max_wait.FromNanoseconds(int(wait_s * 1e9))
    return stub.CollectResults(req, timeout=5)


def group_with(gid: str, **change) -> rollout_pb2.PromptGroup:
    """group(gid) with some fields replaced (dotted names reach into sub-messages)."""
    g = group(gid)
    for path, value in change.items():
        *parents, leaf = path.split("__")
        target = g
        for p in parents:
            target = getattr(target, p)
        field = getattr(target, leaf)
        if isinstance(value, list):
            del field[:]
            field.extend(value)
        else:
            setattr(target, leaf, value)
    return g


BAD = [
    ("submit_empty", lambda c: c.submit_groups([]), "INVALID_FIELD", "groups"),
    (
        "policy_twice",
        lambda c: c.submit_groups([group("a", policies=("policy", "policy"))]),
        "INVALID_FIELD",
        "groups[0].policy_ids",
    ),
    (
        "long_workflow",
        lambda c: c.submit_groups([group_with("a", workflow="w" * 129)]),
        "INVALID_FIELD",
        "groups[0].workflow",
    ),
    (
        "long_reward",
        lambda c: c.submit_groups([group_with("a", reward="r" * 129)]),
        "INVALID_FIELD",
        "groups[0].reward",
    ),
    (
        "huge_prompt",
        lambda c: c.submit_groups([group_with("a", prompt__text="x" * ((1 << 20) + 1))]),
        "INVALID_FIELD",
        "groups[0].prompt.text",
    ),
    (
        "many_stop_strings",
        lambda c: c.submit_groups([group_with("a", sampling_params__stop_strings=["s"] * 65)]),
        "INVALID_FIELD",
        "groups[0].sampling_params.stop_strings",
    ),
    (
        "long_stop_string",
        lambda c: c.submit_groups([group_with("a", sampling_params__stop_strings=["s" * 1025])]),
        "INVALID_FIELD",
        "groups[0].sampling_params.stop_strings[0]",
    ),
    (
        "nan_temperature",
        lambda c: c.submit_groups([group_with("a", sampling_params__temperature=float("nan"))]),
        "INVALID_FIELD",
        "groups[0].sampling_params.temperature",
    ),
    (
        "top_p_above_one",
        lambda c: c.submit_groups([group_with("a", sampling_params__top_p=1.5)]),
        "INVALID_FIELD",
        "groups[0].sampling_params.top_p",
    ),
    (
        "negative_top_k",
        lambda c: c.submit_groups([group_with("a", sampling_params__top_k=-1)]),
        "INVALID_FIELD",
        "groups[0].sampling_params.top_k",
    ),
    (
        "empty_stop_string",
        lambda c: c.submit_groups([group_with("a", sampling_params__stop_strings=[""])]),
        "INVALID_FIELD",
        "groups[0].sampling_params.stop_strings[0]",
    ),
    (
        "many_stop_ids",
        lambda c: c.submit_groups(
            [group_with("a", sampling_params__stop_token_ids=list(range(1025)))]
        ),
        "INVALID_FIELD",
        "groups[0].sampling_params.stop_token_ids",
    ),
    (
        "submit_too_many",
        lambda c: c.submit_groups([group(f"g{i}", 1) for i in range(1025)]),
        "INVALID_FIELD",
        "groups",
    ),
    (
        "empty_group_id",
        lambda c: c.submit_groups([group("")]),
        "INVALID_FIELD",
        "groups[0].group_id",
    ),
    (
        "long_group_id",
        lambda c: c.submit_groups([group("x" * 257)]),
        "INVALID_FIELD",
        "groups[0].group_id",
    ),
    (
        "zero_samples",
        lambda c: c.submit_groups([group("a", 0)]),
        "INVALID_FIELD",
        "groups[0].num_samples",
    ),
    (
        "too_many_samples",
        lambda c: c.submit_groups([group("a", 1025)]),
        "INVALID_FIELD",
        "groups[0].num_samples",
    ),
    (
        "over_capacity",
        lambda c: c.submit_groups([group("a", 65)]),
        "INVALID_FIELD",
        "groups[0].num_samples",
    ),
    (
        "no_tokens",
        lambda c: c.submit_groups([group("a", tokens=0)]),
        "INVALID_FIELD",
        "groups[0].sampling_params.max_new_tokens",
    ),
    (
        "workflow",
        lambda c: c.submit_groups([group("a", workflow="chess")]),
        "UNKNOWN_WORKFLOW",
        "groups[0].workflow",
    ),
    (
        "policy",
        lambda c: c.submit_groups([group("ok"), group("a", policies=("policy", "ghost"))]),
        "UNKNOWN_POLICY",
        "groups[1].policy_ids[1]",
    ),
    (
        "no_policy",
        lambda c: c.submit_groups([group("a", policies=())]),
        "INVALID_FIELD",
        "groups[0].policy_ids",
    ),
    ("collect_zero", lambda c: _collect(c.stub, 0), "INVALID_FIELD", "max_groups"),
    ("collect_huge", lambda c: _collect(c.stub, 4097), "INVALID_FIELD", "max_groups"),
    ("collect_negative_wait", lambda c: _collect(c.stub, 1, -1.0), "INVALID_FIELD", "max_wait"),
    ("collect_long_wait", lambda c: _collect(c.stub, 1, 31.0), "INVALID_FIELD", "max_wait"),
    ("ack_empty", lambda c: c.ack_results([]), "INVALID_FIELD", "group_ids"),
    ("ack_huge", lambda c: c.ack_results(["x"] * 4097), "INVALID_FIELD", "group_ids"),
    ("cancel_empty", lambda c: c.cancel_groups([]), "INVALID_FIELD", "group_ids"),
    ("cancel_huge", lambda c: c.cancel_groups(["x"] * 4097), "INVALID_FIELD", "group_ids"),
    ("load_empty", lambda c: c.load_weights([], "w:1", "r"), "INVALID_FIELD", "versions"),
    (
        "load_no_address",
        lambda c: c.load_weights(
            [version_pb2.PolicyVersion(policy_id="policy", version=1)], "", "r"
        ),
        "INVALID_FIELD",
        "weights_address",
    ),
    (
        "load_unknown_policy",
        lambda c: c.load_weights(
            [version_pb2.PolicyVersion(policy_id="ghost", version=1)], "w", "r"
        ),
        "UNKNOWN_POLICY",
        "versions[0].policy_id",
    ),
    (
        "load_negative",
        lambda c: c.load_weights(
            [version_pb2.PolicyVersion(policy_id="policy", version=-1)], "w", "r"
        ),
        "INVALID_FIELD",
        "versions[0].version",
    ),
]


def test_bad_input_is_refused_with_field_and_server_keeps_serving():
    async def body():
        async with raas(capacity=64) as (client, servicer):
            for name, make, reason, field in BAD:
                try:
                    await expect(make(client), grpc.StatusCode.INVALID_ARGUMENT, reason, field)
                except AssertionError as exc:
                    raise AssertionError(f"case {name}: {exc}") from exc
                status = await client.get_status()
                assert status.running_groups == 0 and status.free_slots == 64, name
            assert servicer.store.counters["groups_accepted"] == 0
            assert await client.check_health()

    run(body(), timeout_s=60)


# ----- registration with Dataflow ------------------------------------------------------------


class FakeDataflow(df_grpc.DataflowServiceServicer):
    """Records membership calls; `forget` simulates a Dataflow restart."""

    def __init__(self) -> None:
        self.instances: dict[str, df_pb.RegisterInstanceRequest] = {}
        self.registers: list[df_pb.RegisterInstanceRequest] = []
        self.heartbeats: list[df_pb.HeartbeatInstanceRequest] = []
        self.deregistered: list[str] = []

    def _interval(self, resp):
        resp.heartbeat_interval.FromMilliseconds(50)
        resp.dataflow_id = "fake"
        return resp

    async def RegisterInstance(self, request, context):
        self.instances[request.instance_id] = request
        self.registers.append(request)
        return self._interval(df_pb.RegisterInstanceResponse())

    async def HeartbeatInstance(self, request, context):
        if request.instance_id not in self.instances:
            raise NotFound("unknown instance", reason="INSTANCE_NOT_REGISTERED")
        self.heartbeats.append(request)
        return self._interval(df_pb.HeartbeatInstanceResponse())

    async def DeregisterInstance(self, request, context):
        self.instances.pop(request.instance_id, None)
        self.deregistered.append(request.instance_id)
        return df_pb.DeregisterInstanceResponse()


async def start_fake_dataflow(port: int = 0) -> tuple[GrpcServer, FakeDataflow]:
    fake = FakeDataflow()
    server = GrpcServer("127.0.0.1", port, grace_s=0.1)
    server.add_service(
        df_grpc.add_DataflowServiceServicer_to_server, fake, "astra.dataflow.v1.DataflowService"
    )
    await server.start()
    return server, fake


def test_registrar_registers_heartbeats_reregisters_and_deregisters():
    async def body():
        df_server, fake = await start_fake_dataflow()
        try:
            async with raas(
                capacity=8, dataflow_address=df_server.address, labels={"region": "x"}
            ) as (client, _servicer):
                await until(lambda: len(fake.heartbeats) >= 2)
                reg = fake.registers[0]
                assert reg.instance_id == "raas-test" and reg.capacity == 8
                assert reg.address == client.address and dict(reg.labels) == {"region": "x"}
                assert set(reg.policy_ids) == {"policy", "other"}
                assert {v.policy_id: v.version for v in reg.loaded_versions} == {
                    "policy": 0,
                    "other": 0,
                }
                await client.submit_groups([group("hb", 3)])
                await until(lambda: fake.heartbeats[-1].pending_results == 1)
                fake.instances.clear()  # Dataflow restarted and forgot everyone
                await until(lambda: len(fake.registers) >= 2)
                assert "raas-test" in fake.instances
                assert len(await client.collect_results(10, 0)) == 1  # result kept meanwhile
            assert fake.deregistered == ["raas-test"]
        finally:
            await df_server.stop(0)

    run(body())


@pytest.mark.slow
def test_registrar_waits_for_dataflow_to_come_up():
    async def body():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        async with raas(capacity=4) as (_client, servicer):
            registrar = Registrar(
                f"127.0.0.1:{port}",
                servicer,
                "127.0.0.1:1",
                initial_backoff_s=0.05,
                max_backoff_s=0.2,
                call_timeout_s=1.0,
            )
            registrar.start()
            await asyncio.sleep(1.5)
            assert not registrar.registered.is_set() and registrar.counters["call_failures"] > 0
            df_server, fake = await start_fake_dataflow(port)
            try:
                await asyncio.wait_for(registrar.registered.wait(), 5.0)
                assert list(fake.instances) == ["raas-test"]
                await registrar.stop()
                assert fake.deregistered == ["raas-test"]
            finally:
                await df_server.stop(0)

    run(body())


def test_scripted_raas_process_registers_serves_and_exits_zero_on_sigterm(tmp_path):
    async def body():
        df_server, fake = await start_fake_dataflow()
        args = [
            sys.executable,
            "-m",
            "astra.testing.scripted_raas",
            "--dataflow",
            df_server.address,
            "--port",
            "0",
            "--capacity",
            "8",
            "--policy",
            "policy",
            "--delay",
            "0",
            "--instance-id",
            "proc-1",
            "--labels",
            "region=x",
        ]
        proc = await asyncio.to_thread(Proc, args, log=tmp_path / "raas.log")
        try:
            assert proc.info["service"] == "raas" and proc.info["instance_id"] == "proc-1"
            await until(lambda: "proc-1" in fake.instances, 10.0)
            assert dict(fake.instances["proc-1"].labels) == {"region": "x"}
            async with RolloutClient(proc.address) as client:
                await client.submit_groups([group("p/0/0", 2)])
                (result,) = await client.collect_results(1, 5.0)
                assert result.group_id == "p/0/0" and result.instance_id == "proc-1"
            proc.signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 15) == 0
            assert fake.deregistered == ["proc-1"]
        finally:
            proc.close()
            await df_server.stop(0)

    run(body(), timeout_s=60)


def test_a_result_too_large_to_deliver_fails_its_group_and_blocks_nothing():
    """One group whose result exceeds a CollectResults message would fail every collect of
    the instance after it (results are sent oldest first until acknowledged)."""
    import numpy as np

    from astra.raas.backend import SequenceSpec, TrajectorySpec

    class Big(ScriptedGenerator):
        async def generate(self, g, versions):
            if not g.group_id.startswith("big"):
                return await super().generate(g, versions)
            n = 400_000  # x 17 bytes per token x 2 samples: ~13.6 MB
            seq = SequenceSpec(
                "policy", np.zeros(n, np.int32), np.zeros(n, np.float32),
                np.ones(n, np.uint8), np.zeros(n, np.int64), 1, "stop", 0.0,
            )  # fmt: skip
            return [TrajectorySpec(i, [seq], 0.0) for i in range(g.num_samples)]

    async def body():
        async with raas(capacity=64, backend=Big(("policy",), ("single_turn",))) as (c, servicer):
            servicer.max_result_bytes = 4 << 20
            await c.submit_groups([group("big", 2)])
            await c.submit_groups([group("small", 1)])
            got = {}
            for _ in range(20):
                got.update({r.group_id: r for r in await c.collect_results(10, max_wait_s=0.5)})
                if len(got) == 2:
                    break
            assert got["small"].trajectories and not got["small"].HasField("error")
            assert got["big"].error.code == 8 and "message limit" in got["big"].error.message
            assert servicer.counters["results_too_large"] == 1

    run(body(), timeout_s=60)


def test_a_group_id_twice_in_one_submit_is_refused():
    async def body():
        async with raas(capacity=64) as (c, _servicer):
            await expect(
                c.submit_groups([group("dup", 1), group("dup", 8)]),
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_FIELD",
                "groups[1].group_id",
            )
            status = await c.get_status()
            assert status.free_slots == 64, "nothing reserved"

    run(body())
