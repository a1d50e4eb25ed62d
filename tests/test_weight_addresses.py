"""Where weights are loaded from: each policy from its own WeightService (LoadWeights'
policy_weights_addresses), and, after a restart, from the address the trainer uses now (the
trainer announces its current version again at start)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from astra.clients.raas import RolloutClient
from astra.clients.raas_weights import ReceiverWeightLoader
from astra.clients.rollout_port import GrpcRolloutPort
from astra.clients.trainer_sources import DataflowSource, WeightServiceSink
from astra.common.v1 import version_pb2
from astra.raas.backend import VersionSpec
from astra.raas.engine_backend import EngineBackend
from astra.servers.raas_serve import start_raas
from astra.trainer.setup import agree_version
from tests.conftest import error_info, running_dataflow
from tests.test_dataflow_invariants import POLICY, dataflow_config
from tests.test_engine_backend import FakeLoader
from tests.test_weights_service import serving
from tests.test_weights_store import chain_of, same
from tests.test_workflows import ScriptedTestEngine

T = 30.0  # seconds: the bound of every test body


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, T))


async def _publish(address: str, policy: str, models: list[dict]) -> None:
    from astra.clients.weights_stream import publish_version

    for i, m in enumerate(models):
        await publish_version(address, policy, str(i), i, m)


# ----- follow-up A: one WeightService per policy -----------------------------------------------


def test_engine_backend_fetches_each_policy_from_its_own_address() -> None:
    engine = ScriptedTestEngine(lambda *a: "1", ("a", "b"))
    loader = FakeLoader()
    backend = EngineBackend(engine, ["single_turn"], loader)
    wanted = {"a": VersionSpec(2), "b": VersionSpec(2, weights_address="w:2")}
    asyncio.run(backend.load_weights(wanted, "w:1"))
    assert sorted(loader.fetched) == [("a", 2, "w:1"), ("b", 2, "w:2")]
    assert engine.swaps[0][0] == {"a": 2, "b": 2}  # still one swap for the set


def test_a_raas_loads_every_policy_from_its_own_weight_service(tmp_path: Path) -> None:
    """Dataflow's port sends one LoadWeights with a per-policy address for the policy on the
    second WeightService; the RaaS fetches each policy from its own service and switches both
    together. Before the fix both were fetched from `weights_address` and `b` was not found."""
    models = {"a": chain_of(2, seed=41), "b": chain_of(2, seed=42)}

    async def body() -> None:
        async with (
            serving(tmp_path / "store-a") as ws_a,
            serving(tmp_path / "store-b") as ws_b,
        ):
            await _publish(ws_a.address, "a", models["a"])
            await _publish(ws_b.address, "b", models["b"])
            loader = ReceiverWeightLoader(tmp_path / "raas", durable=False)
            backend = EngineBackend(ScriptedTestEngine(lambda *a: "1", ("a", "b")), ["single_turn"])
            backend.weight_loader = loader
            server, servicer, _ = await start_raas(backend, capacity=8, grace_s=0.1)
            port = GrpcRolloutPort(server.address, timeout_s=T)
            try:
                held = await port.load_weights(
                    {"a": (1, "1", ws_a.address), "b": (1, "1", ws_b.address)}, "load-1"
                )
                assert held == {"a": 1, "b": 1}
                assert backend.inference_engine.swaps[-1][0] == {"a": 1, "b": 1}
                for p in ("a", "b"):
                    assert same(tmp_path / "raas" / p / "current", models[p][1])
                assert {p: r.address for p, r in loader._receivers.items()} == {
                    "a": ws_a.address,
                    "b": ws_b.address,
                }
                async with RolloutClient(server.address, timeout_s=T) as client:
                    with pytest.raises(grpc.aio.AioRpcError) as bad:
                        await client.load_weights(
                            [version_pb2.PolicyVersion(policy_id="a", version=2)],
                            ws_a.address,
                            "load-2",
                            policy_weights_addresses={"ghost": ws_b.address},
                        )
                    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    info, _ = error_info(bad.value)
                    assert info is not None and info.reason == "UNKNOWN_POLICY"
            finally:
                await port.close()
                await server.stop(0)
                await servicer.close()
                await loader.close()

    run(body())


# ----- follow-up B: the trainer re-announces its version with its address ----------------------


def test_a_restarted_trainer_points_dataflow_at_its_new_weight_service(tmp_path: Path) -> None:
    """Dataflow holds version 1 of the policy announced from a WeightService that is gone; the
    trainer comes back with the same versions on a WeightService at a new address. Agreeing
    versions announces version 1 again, so every load now goes to the live address."""
    models = chain_of(2, seed=43)
    dead = "127.0.0.1:1"

    async def body() -> None:
        async with running_dataflow(dataflow_config(tmp_path, 4)) as (server, df, client):
            for v in (0, 1):
                await client.announce_version(POLICY, v, dead, version_id=str(v))
            async with serving(tmp_path / "store") as ws:
                await _publish(ws.address, POLICY, models)
                source = DataflowSource(
                    server.address, POLICY, trainer_id="t", weights_address=ws.address
                )
                sink = WeightServiceSink(ws.address, POLICY, {})
                try:
                    assert df.versions.targets()[POLICY].weights_address == dead
                    agreed, held = await agree_version(1, source, sink, announce=True)
                    assert (agreed, held) == (1, True)
                    target = df.versions.targets()[POLICY]
                    assert (target.version, target.weights_address) == (1, ws.address)
                    status = await client.get_status()
                    (policy,) = status.policies
                    assert policy.current_version == 1 and policy.weights_address == ws.address
                finally:
                    await source.close()
                    await sink.close()

    run(body())


class _Source:
    def __init__(self, current: int) -> None:
        self.current, self.announced = current, []

    async def current_version(self) -> int:
        return self.current

    async def announce(
        self, version: int, identity: str, resumed: bool = False, resumed_from: int | None = None
    ) -> None:
        self.announced.append((version, identity, resumed))


class _Sink:
    def __init__(self, latest: int | None) -> None:
        self.latest = latest

    async def latest_version(self) -> int | None:
        return self.latest


@pytest.mark.parametrize(
    ("checkpoint", "current", "latest", "announced", "agreed"),
    [
        # the same version: announced again (resumed), for the address
        (0, 3, 3, [(3, "3", True)], 3),
        # newer versions: announced in order, then the last again (resumed)
        (0, 3, 5, [(4, "4", False), (5, "5", False), (5, "5", True)], 5),
        (0, 3, 2, [], 3),  # the service lost versions: nothing it cannot serve is announced
        (0, 3, None, [], 3),  # an empty service: the trainer publishes its initial weights
        (5, 5, 5, [(5, "5", True)], 5),  # resumed where the publishes were
        (4, 5, 6, [(6, "6", False), (6, "6", True)], 6),  # published past the checkpoint
        # The trainer died after its checkpoint of version 15 and before that version's
        # publish: Dataflow would refuse 16 after 14, so the next step is 15.
        (15, 13, 14, [(14, "14", False), (14, "14", True)], 14),
    ],
)
def test_agree_version_announces_only_what_the_service_holds(
    checkpoint: int, current: int, latest: int | None, announced: list, agreed: int
) -> None:
    source, sink = _Source(current), _Sink(latest)
    out = asyncio.run(agree_version(checkpoint, source, sink, announce=True))  # type: ignore[arg-type]
    assert source.announced == announced and out[0] == agreed
    source = _Source(current)
    asyncio.run(agree_version(checkpoint, source, sink, announce=False))  # type: ignore[arg-type]
    assert source.announced == []
