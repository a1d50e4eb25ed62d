"""The start-up version rule: an instance holds a version by counter AND identity.

A RaaS claims in RegisterInstanceRequest.loaded_versions only what it holds; (0, "") is the
weights it was started with, never the trainer's version 0. Dataflow sends LoadWeights
whenever the claimed identity is not the announced one, even at the same counter, and (with
a version floor) gives such an instance no work until it has loaded it. The RaaS matches
"already loaded" by counter and identity too.
"""

from __future__ import annotations

import asyncio

from astra.raas.scripted import ScriptedGenerator
from astra.servers.raas_serve import start_raas
from tests.conftest import running_dataflow
from tests.test_dataflow_invariants import POLICY, dataflow_config, raas, run, until


class Recording(ScriptedGenerator):
    """Records, in order, every load ((version, version_id) per policy) and every group run."""

    def __init__(self, *args, load_delay_s: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.load_delay_s = load_delay_s
        self.events: list[tuple] = []

    async def load_weights(self, versions, weights_address: str) -> int:
        self.events.append(("load", {p: (v.version, v.version_id) for p, v in versions.items()}))
        await asyncio.sleep(self.load_delay_s)
        self.events.append(("loaded",))
        return await super().load_weights(versions, weights_address)

    async def generate(self, group, versions):
        self.events.append(("generate", group.group_id, dict(versions)))
        return await super().generate(group, versions)

    def loads(self) -> list[dict]:
        return [e[1] for e in self.events if e[0] == "load"]


def test_a_raas_started_on_its_own_weights_loads_the_trainers_version_0_before_any_work(
    tmp_path,
):
    """The trainer announced version 0 ("0"); a RaaS starting claims (0, ""): it is sent
    LoadWeights of (0, "0"), and with eta = 0 runs nothing before that load is done. Once
    loaded it claims (0, "0") and is not sent the load again on its heartbeats."""
    config = dataflow_config(tmp_path, 4, gate={"max_version_lag": 0})

    async def body():
        async with running_dataflow(config) as (server, _df, client):
            await client.announce_version(POLICY, 0, "weights://w", version_id="0")
            gen = Recording(load_delay_s=0.3)
            async with raas(server.address, gen, capacity=8, name="r") as r:
                await until(lambda: any(e[0] == "generate" for e in gen.events), 5.0, "work")
                await asyncio.sleep(1.0)  # five heartbeats
                status = await client.get_status()
                held = [(v.version, v.version_id) for v in status.instances[0].loaded_versions]
                return gen, r.servicer.loaded_version_ids, held

    gen, ids, held = run(body())
    assert gen.loads() == [{POLICY: (0, "0")}]
    kinds = [e[0] for e in gen.events]
    assert kinds.index("loaded") < kinds.index("generate"), gen.events[:4]
    assert ids == {POLICY: "0"} and held == [(0, "0")]


def test_a_claimed_identity_other_than_the_announced_one_is_loaded_at_the_same_counter(tmp_path):
    """Versions 1-3 announced with identities a1-a3; a RaaS claiming (3, "3") does not hold
    a3: Dataflow sends LoadWeights (3, "a3"), and the RaaS loads it rather than answering
    "already loaded" by the counter."""
    config = dataflow_config(tmp_path, 4)

    async def body():
        async with running_dataflow(config) as (server, df, client):
            for v in (1, 2, 3):
                await client.announce_version(POLICY, v, "weights://w", version_id=f"a{v}")
            gen = Recording()
            # Started holding (3, "3"): the claim an engine makes from a counter alone.
            rserver, servicer, registrar = await start_raas(
                gen,
                capacity=8,
                dataflow_address=server.address,
                instance_id="r",
                initial_versions={POLICY: 3},
                grace_s=0.1,
            )
            try:
                await until(lambda: gen.loads(), 5.0, "a load")
                await until(lambda: servicer.loaded_version_ids == {POLICY: "a3"}, 5.0)
                return gen, df.pool.instances["r"].held(POLICY)
            finally:
                await registrar.stop()
                await rserver.stop(0)
                await servicer.close()

    gen, held = run(body())
    assert gen.loads()[0] == {POLICY: (3, "a3")}
    assert held == 3
