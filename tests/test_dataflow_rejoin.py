"""A RaaS that dies and comes back under the same id before Dataflow confirms it dead (what a
supervisor's restart does) must not keep its predecessor's groups leased: they died with it."""

from __future__ import annotations

import pytest

from astra.raas.scripted import ScriptedGenerator
from tests.conftest import free_port, running_dataflow
from tests.test_dataflow_invariants import (
    WEIGHTS,
    Trainer,
    assert_epoch_trained_once,
    dataflow_config,
    in_flight_on,
    raas,
    run,
    until,
    with_raas,
)


def test_a_restarted_raas_gets_its_predecessors_groups_dispatched_again(tmp_path) -> None:
    n = 12
    # Leases and heartbeat timeouts far beyond the test: only the re-registration can free them.
    config = dataflow_config(
        tmp_path,
        n,
        leases={"group_lease_s": 600.0},
        pool={"heartbeat_timeout_s": 600.0, "confirm_failures": 1000},
    )

    async def body() -> None:
        async with running_dataflow(config) as (server, df, client):
            slow = ScriptedGenerator(delay_s=600.0)  # its groups never finish
            async with raas(server.address, slow, capacity=8, name="r") as first:
                inst = await in_flight_on(df, "r", 2)
                lost = set(inst.in_flight)
                await first.kill()
            async with raas(server.address, ScriptedGenerator(), capacity=8, name="r"):
                await until(lambda: df.counters["requeued_instance_restarted"] == len(lost))
                trainer = Trainer(client)
                await trainer.drain(df, num_groups=2)
            assert_epoch_trained_once(trainer.consumed, n)
            assert lost <= set(trainer.consumed)

    run(body(), timeout_s=60)


@pytest.mark.parametrize("second_name", ["r", "r-restarted"], ids=["same-id", "new-id"])
def test_a_raas_restarted_on_the_same_address_frees_its_predecessors_groups(
    tmp_path, second_name: str
) -> None:
    """The restarted process answers health probes at the same address, so nothing would
    ever confirm the old one dead: its incarnation (same id) or its address (new id) does."""
    n = 12
    config = dataflow_config(
        tmp_path,
        n,
        leases={"group_lease_s": 600.0},
        pool={"heartbeat_timeout_s": 600.0, "confirm_failures": 1000},
    )
    port = free_port()

    async def body() -> None:
        async with running_dataflow(config) as (server, df, client):
            slow = ScriptedGenerator(delay_s=600.0)  # its groups never finish
            async with raas(server.address, slow, capacity=8, name="r", port=port) as first:
                inst = await in_flight_on(df, "r", 2)
                lost = set(inst.in_flight)
                await first.kill()
            async with raas(
                server.address, ScriptedGenerator(), capacity=8, name=second_name, port=port
            ):
                await until(
                    lambda: df.counters["requeued_instance_restarted"] >= len(lost),
                    10.0,
                    "the groups freed",
                )
                trainer = Trainer(client)
                await trainer.drain(df, num_groups=2)
            if second_name != "r":
                assert df.pool.instances["r"].state.name == "DEAD"
            assert_epoch_trained_once(trainer.consumed, n)
            assert lost <= set(trainer.consumed)

    run(body(), timeout_s=60)


def test_a_resumed_trainer_is_not_held_by_batches_its_last_run_never_trained(tmp_path) -> None:
    """eta = 1, 2 groups a batch: generation may run 4 groups ahead of version 0. A trainer
    acknowledges two batches (as if for versions 1 and 2), dies without publishing, and comes
    back at version 0: without `resumed` nothing more is ever dispatched."""
    config = dataflow_config(tmp_path, 40, gate={"max_version_lag": 1})

    async def body() -> None:
        async with with_raas(config, ScriptedGenerator(), capacity=16, name="r") as (df, client, _):
            trainer = Trainer(client)
            await client.announce_version("policy", 0, WEIGHTS)
            for _ in range(2):  # the old run: two batches taken and acknowledged, no version
                batch = None
                while batch is None:
                    batch = await trainer.fetch(2)
                await trainer.ack(batch)
            await until(
                lambda: (
                    df.budget.stream_capacity(df.streams["s"]) == 0 and not df.table.running("s")
                )
            )
            assert len(df.buffers["policy"]) == 0 and trainer.version == 0
            resp = await client.announce_version("policy", 0, WEIGHTS, resumed=True)
            assert resp.already_announced
            assert df.counters["groups_untrained_at_resume"] == 4
            batch = None
            while batch is None:  # new groups are generated for the resumed trainer
                batch = await trainer.fetch(2)
            assert not set(batch.group_ids) & set(trainer.consumed)

    run(body(), timeout_s=60)
