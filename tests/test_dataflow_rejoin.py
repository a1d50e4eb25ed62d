"""A RaaS that dies and comes back under the same id before Dataflow confirms it dead (what a
supervisor's restart does) must not keep its predecessor's groups leased: they died with it."""

from __future__ import annotations

from astra.raas.scripted import ScriptedGenerator
from tests.conftest import running_dataflow
from tests.test_dataflow_invariants import (
    Trainer,
    assert_epoch_trained_once,
    dataflow_config,
    in_flight_on,
    raas,
    run,
    until,
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
