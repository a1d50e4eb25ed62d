"""CollectResultBatch: a RaaS acknowledges, then answers its results in one message; Dataflow
sends the acknowledgements of one round with the next call, and serves a RaaS without the RPC
(UNIMPLEMENTED) with CollectResults and AckResults. Nothing is lost or trained twice either way,
nor when Dataflow dies between the commit and the call that carries the acknowledgement."""

from __future__ import annotations

import asyncio

import grpc

from astra.clients.raas import RolloutClient
from astra.clients.rollout_port import framed_results
from astra.common.v1 import rollout_pb2
from astra.raas.scripted import ScriptedGenerator
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.servers.raas import RolloutServicer
from astra.servers.raas_convert import within
from astra.servers.raas_serve import start_raas
from tests.conftest import free_port
from tests.test_dataflow_invariants import (
    POLICY,
    Trainer,
    assert_epoch_trained_once,
    check_redelivered_once,
    crash_then_restart,
    dataflow_config,
    raas,
    run,
    until,
    with_raas,
)


def test_within_cuts_at_the_byte_limit_but_keeps_the_first():
    assert within([b"a" * 5, b"b" * 5, b"c" * 5], 10) == [b"a" * 5, b"b" * 5]
    assert within([b"a" * 20, b"b"], 10) == [b"a" * 20]
    assert within([], 10) == []


def test_collect_result_batch_acknowledges_first_then_answers_every_pending_result(tmp_path):
    async def body():
        server, servicer, _ = await start_raas(
            ScriptedGenerator(), capacity=64, instance_id="r", grace_s=0.1
        )
        store = servicer.store
        client = RolloutClient(server.address)
        try:
            groups = [
                rollout_pb2.PromptGroup(
                    group_id=f"g{i}", workflow="single_turn", policy_ids=[POLICY], num_samples=2
                )
                for i in range(3)
            ]
            for g in groups:
                g.sampling_params.max_new_tokens = 4
            await client.submit_groups(groups)
            await until(lambda: store.pending == 3, what="three results")
            raw = await client.collect_result_batch_raw([], 16, 0.0)
            first = pb.CollectResultBatchResponse.FromString(raw)
            assert sorted(g.group_id for g in first.results) == ["g0", "g1", "g2"]
            # Each entry, framed, is a CollectResultsResponse carrying the same result.
            framed = framed_results(raw)
            assert [pb.CollectResultsResponse.FromString(f).result for f in framed] == list(
                first.results
            )
            # Not removed by being sent: the next call acknowledges two, gets the third.
            raw = await client.collect_result_batch_raw(["g0", "g2", "unknown"], 16, 0.0)
            rest = pb.CollectResultBatchResponse.FromString(raw)
            assert [g.group_id for g in rest.results] == ["g1"]
            assert store.counters["results_acknowledged"] == 2
            assert store.counters["acks_ignored"] == 1
            # Nothing ready: waits up to max_wait, answers an empty message.
            raw = await client.collect_result_batch_raw(["g1"], 16, 0.05)
            assert raw == b"" and store.pending == 0
        finally:
            await client.close()
            await server.stop(0)
            await servicer.close()

    run(body())


def test_a_raas_without_collect_result_batch_is_served_with_collect_and_ack(tmp_path, monkeypatch):
    async def unimplemented(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(RolloutServicer, "CollectResultBatch", unimplemented)
    assert drain_an_epoch(tmp_path, "old") is False


def test_dataflow_uses_collect_result_batch_and_acknowledges_everything(tmp_path):
    assert drain_an_epoch(tmp_path, "new") is True


def drain_an_epoch(tmp_path, name: str) -> bool | None:
    """One RaaS `name`, an epoch of 12 groups trained once with every result acknowledged and
    none delivered twice; returns whether Dataflow collected through CollectResultBatch."""
    n = 12
    config = dataflow_config(tmp_path, n)

    async def body():
        async with with_raas(config, ScriptedGenerator(), capacity=32, name=name) as (
            df,
            client,
            a,
        ):
            trainer = Trainer(client)
            await trainer.drain(df)
            await until(lambda: a.servicer.store.pending == 0, what="every result acknowledged")
            return trainer, df.status(), df.pool.instances[name].port.batched

    trainer, status, batched = run(body())
    assert_epoch_trained_once(trainer.consumed, n)
    c = status["counters"]
    assert c["consumed_groups"] == c["completed_groups"] == n
    assert c.get("duplicates_dropped", 0) == 0
    return batched


def test_a_crash_before_the_call_carrying_the_ack_redelivers_and_drops_the_repeat(tmp_path):
    """Dataflow commits results and queues their acknowledgement for its next
    CollectResultBatch, then dies as that call leaves: after the restart the RaaS (which
    still holds them) delivers them again; they are recognised as done and dropped."""
    from astra.servers.dataflow_serve import start_dataflow

    n = 6
    config = dataflow_config(tmp_path, n).model_copy(update={"port": free_port()})

    async def body():
        server, df, _ = await start_dataflow(config)
        gen = ScriptedGenerator(delay_s=0.5)
        async with raas(server.address, gen, capacity=64, name="a") as a:
            inst = await until(lambda: df.pool.instances.get("a"))
            client = inst.port.client
            real = client.collect_result_batch_raw
            unsent: list[str] = []
            never = asyncio.Event()

            async def dies_with_acks(ack_group_ids, *args, **kwargs):
                if ack_group_ids:  # the process dies on this line
                    unsent.extend(ack_group_ids)
                    await never.wait()
                return await real(ack_group_ids, *args, **kwargs)

            client.collect_result_batch_raw = dies_with_acks
            return await crash_then_restart(server, df, a, config, unsent)

    check_redelivered_once(*run(body(), timeout_s=60), n)
