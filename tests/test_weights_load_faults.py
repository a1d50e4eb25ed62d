"""Weight loads that cannot complete: every wait bounded, the old version kept, Dataflow retrying.

A WeightService frozen with SIGSTOP mid-stream is the silent peer (the
connection stays open, nothing comes): before the deadlines, a fetch from it
waited on the stream for an hour, LoadWeights never answered, and Dataflow
routed no work to the lagging RaaS. Receivers SIGKILLed mid-stream must not
disturb the others. Every test is bounded in time.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from astra.clients import raas_weights
from astra.clients.raas import RolloutClient
from astra.clients.raas_weights import ReceiverWeightLoader
from astra.clients.weights import WeightClient
from astra.clients.weights_stream import Receiver, publish_version
from astra.common.v1 import version_pb2
from astra.dataflow.pool import LOAD_FAILURES_REPORTED
from astra.dataflow.versions import VersionBook
from astra.errors import Unavailable
from astra.raas.backend import VersionSpec
from astra.raas.scripted import ScriptedGenerator
from astra.servers.raas_serve import start_raas
from astra.weights.deadline import DeadlineExceeded
from tests.conftest import error_info, running_dataflow
from tests.procs import Proc
from tests.test_dataflow_invariants import dataflow_config, until
from tests.test_weights_service import serving
from tests.test_weights_store import chain_of, same

T = 30  # seconds: the bound of every test body

SERVE = (
    "import asyncio, sys; from astra.servers.weights_serve import serve_weights; "
    "asyncio.run(serve_weights(sys.argv[1], port=0))"
)
FETCH = "from astra.weights.cli import weights; weights()"


def run(coro, timeout_s: float = T):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def staged(directory: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in directory.glob("staging/*/tensors.jsonl"))


async def _until_staged(directory: Path, n: int) -> None:
    while staged(directory) < n:
        await asyncio.sleep(0.01)


@asynccontextmanager
async def weight_service(tmp_path: Path):
    """A WeightService in its own process (so it can be frozen and killed)."""
    proc = await asyncio.to_thread(
        Proc, [sys.executable, "-c", SERVE, str(tmp_path / "store")], log=tmp_path / "weights.log"
    )
    try:
        yield proc
    finally:
        proc.signal(signal.SIGCONT)
        await asyncio.to_thread(proc.close)


# ----- the receiver ------------------------------------------------------------------------------


@pytest.mark.slow
def test_fetch_from_a_frozen_weight_service_fails_in_bounded_time_then_resumes(tmp_path):
    """The stall: the service goes silent mid-version with the connection open. The fetch must
    end within its deadline with a clear error, nothing half-fetched current; once the service
    answers again a new fetch resumes after the tensors already acknowledged."""
    models = chain_of(2, seed=31, size=1 << 17)  # 4 tensors of 256 KiB
    rx = tmp_path / "rx"

    async def body() -> None:
        async with weight_service(tmp_path) as service:
            for i, m in enumerate(models):
                await publish_version(service.address, "p", f"v{i}", i, m)
            async with Receiver(service.address, "p", rx, durable=False) as first:
                await first.fetch("v0")
            slow = Receiver(
                service.address,
                "p",
                rx,
                durable=False,
                # v1 is a delta of ~10 KB: at 5 KB/s the service is still sending it when it
                # freezes (at 200 KB/s the whole delta fit in one burst and could finish first).
                max_bytes_per_second=5_000,
                timeout_s=4.0,
                idle_timeout_s=1.0,
                max_attempts=3,
                backoff_s=0.05,
            )
            fetch = asyncio.create_task(slow.fetch("v1"))
            await asyncio.wait_for(_until_staged(rx, 1), T)
            service.signal(signal.SIGSTOP)  # silent, connection open
            started = time.monotonic()
            with pytest.raises((DeadlineExceeded, Unavailable)) as failed:
                await asyncio.wait_for(fetch, 10)  # bounded: before the fix, an hour
            took = time.monotonic() - started
            assert took < 5.5, f"the fetch took {took:.1f}s to give up"
            assert failed.value.reason in ("FETCH_DEADLINE_EXCEEDED", "FETCH_STREAM_STALLED")
            assert service.address in failed.value.message
            await slow.close()
            assert same(rx / "current", models[0]), "the old version stays current"
            service.signal(signal.SIGCONT)
            async with Receiver(service.address, "p", rx, durable=False) as again:
                result = await again.fetch("v1")
            assert result.tensors_resumed >= 1
            assert same(rx / "current", models[1])

    run(body())


@pytest.mark.slow
def test_survivor_fetch_is_not_held_up_by_a_peer_sigkilled_mid_stream(tmp_path):
    """Two receivers in their own processes fetch one version; one is SIGKILLed mid-stream.
    The survivor completes, and the service releases the dead stream."""
    model = chain_of(1, seed=32, size=1 << 18)[0]  # 4 tensors of 512 KiB

    def fetcher(rx: Path) -> subprocess.Popen:
        args = [sys.executable, "-c", FETCH, "fetch", "--server", address, "--policy", "p"]
        args += ["--out", str(rx), "--no-fsync", "--max-bytes-per-second", "1000000"]
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    async def body() -> None:
        nonlocal address
        async with weight_service(tmp_path) as service:
            address = service.address
            await publish_version(address, "p", "v0", 0, model)
            victim, survivor = fetcher(tmp_path / "a"), fetcher(tmp_path / "b")
            try:
                await asyncio.wait_for(_until_staged(tmp_path / "a", 1), T)
                victim.send_signal(signal.SIGKILL)
                _out, err = await asyncio.to_thread(survivor.communicate, timeout=20)
                assert survivor.returncode == 0, err
                assert same(tmp_path / "b" / "current", model)
                async with WeightClient(address) as client:
                    for _ in range(100):
                        if (await client.get_status()).active_fetches == 0:
                            break
                        await asyncio.sleep(0.05)
                    assert (await client.get_status()).active_fetches == 0
            finally:
                for p in (victim, survivor):
                    if p.poll() is None:
                        p.kill()
                    p.wait(10)

    address = ""
    run(body())


# ----- LoadWeights on the RaaS ---------------------------------------------------------------------


class FetchingGenerator(ScriptedGenerator):
    """Scripted rollouts whose LoadWeights really fetches, through the RaaS's weight loader."""

    def __init__(self, loader: ReceiverWeightLoader) -> None:
        super().__init__()
        self.loader = loader

    async def load_weights(self, versions, weights_address: str) -> int:
        fetched = 0
        for p, spec in versions.items():
            _, n = await self.loader.fetch(p, spec, weights_address)
            fetched += n
        return await super().load_weights(versions, weights_address) + fetched


class HangingGenerator(ScriptedGenerator):
    """LoadWeights that never finishes until `release` is set (or that raises `error`)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.error: BaseException | None = None
        self.calls = 0

    async def load_weights(self, versions, weights_address: str) -> int:
        self.calls += 1
        if self.error is not None:
            raise self.error
        await self.release.wait()
        return await super().load_weights(versions, weights_address)


def _versions(version: int) -> list[version_pb2.PolicyVersion]:
    return [
        version_pb2.PolicyVersion(policy_id="policy", version=version, version_id=f"v{version}")
    ]


def _served(status) -> dict[str, int]:
    return {v.policy_id: v.version for v in status.loaded_versions}


@pytest.mark.slow
@pytest.mark.parametrize("in_memory", [False, True], ids=["on-disk", "in-memory"])
def test_load_weights_from_a_frozen_weight_service_fails_in_time_and_keeps_serving(
    tmp_path, monkeypatch, in_memory
):
    """RaaS LoadWeights -> weight loader (its default deadlines, shortened) -> receiver -> a
    frozen WeightService process: the call answers within the loader's deadline, the RaaS keeps
    its version, and loads again once the service is back. Before the deadlines the call waited
    on the silent stream for an hour."""
    monkeypatch.setattr(raas_weights, "FETCH_TIMEOUT_S", 3.0, raising=False)
    monkeypatch.setattr(raas_weights, "IDLE_TIMEOUT_S", 1.0, raising=False)
    models = chain_of(2, seed=33, size=1 << 17)

    async def body() -> None:
        async with weight_service(tmp_path) as service:
            for i, m in enumerate(models):
                await publish_version(service.address, "p", f"v{i}", i, m)
            loader = ReceiverWeightLoader(tmp_path / "raas", in_memory=in_memory)
            gen = FetchingGenerator(loader)
            gen.policy_ids = ["p"]
            server, servicer, _ = await start_raas(gen, capacity=8, grace_s=0.1)
            try:
                async with RolloutClient(server.address, timeout_s=T) as client:
                    service.signal(signal.SIGSTOP)
                    started = time.monotonic()
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        await client.load_weights(
                            [version_pb2.PolicyVersion(policy_id="p", version=1, version_id="v1")],
                            service.address,
                            "load-1",
                        )
                    assert time.monotonic() - started < 6.0
                    assert failed.value.code() in (
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.UNAVAILABLE,
                    )
                    info, _ = error_info(failed.value)
                    assert info is not None and info.reason.startswith("FETCH_")
                    assert _served(await client.get_status()) == {"p": 0}
                    service.signal(signal.SIGCONT)
                    resp = await client.load_weights(
                        [version_pb2.PolicyVersion(policy_id="p", version=1, version_id="v1")],
                        service.address,
                        "load-2",
                    )
                    assert _served(resp) == {"p": 1}
            finally:
                await server.stop(0)
                await servicer.close()
                await loader.close()

    run(body())


def test_load_weights_has_a_deadline_and_never_ends_without_a_status(tmp_path):
    """A load that hangs ends with DEADLINE_EXCEEDED (the versions unchanged, the next load not
    blocked); one cancelled from inside still answers, at once."""

    async def body() -> None:
        gen = HangingGenerator()
        server, servicer, _ = await start_raas(gen, capacity=8, grace_s=0.1, load_timeout_s=0.5)
        try:
            async with RolloutClient(server.address, timeout_s=T) as client:
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as hung:
                    await client.load_weights(_versions(1), "127.0.0.1:1", "load-1")
                assert time.monotonic() - started < 3.0
                assert hung.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                info, _ = error_info(hung.value)
                assert info.reason == "LOAD_DEADLINE_EXCEEDED"
                assert "serving {'policy': 0}" in hung.value.details()
                assert _served(await client.get_status()) == {"policy": 0}

                gen.error = asyncio.CancelledError()
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as cancelled:
                    await client.load_weights(_versions(1), "127.0.0.1:1", "load-2")
                assert time.monotonic() - started < 3.0, "a handler ending in CancelledError"
                assert cancelled.value.code() == grpc.StatusCode.UNAVAILABLE

                gen.error = None
                gen.release.set()
                resp = await client.load_weights(_versions(1), "127.0.0.1:1", "load-3")
                assert _served(resp) == {"policy": 1}
        finally:
            await server.stop(0)
            await servicer.close()

    run(body())


def test_the_weight_loader_follows_a_weight_service_to_its_new_address(tmp_path):
    """One receiver per policy: a new address (the service restarted on another port) replaces
    the old receiver, and the versions it holds still serve as delta bases."""
    models = chain_of(2, seed=34)

    async def body() -> None:
        loader = ReceiverWeightLoader(tmp_path / "raas", durable=False)
        try:
            async with serving(tmp_path / "store") as first:
                await publish_version(first.address, "p", "v0", 0, models[0])
                await loader.fetch("p", VersionSpec(0, "v0"), first.address)
                async with serving(tmp_path / "store") as second:  # the restarted service
                    await publish_version(second.address, "p", "v1", 1, models[1])
                    _, fetched = await loader.fetch("p", VersionSpec(1, "v1"), second.address)
                    assert list(loader._receivers) == ["p"]
                    assert loader._receivers["p"].address == second.address
                    assert same(tmp_path / "raas" / "p" / "current", models[1])
                    assert 0 < fetched < sum(len(d) for _, _, d in models[1].values())  # a delta
        finally:
            await loader.close()

    run(body())


def test_an_in_memory_loader_hands_the_engine_torch_tensors_and_follows_a_new_address(tmp_path):
    """The torch engine's loader: versions stay in RAM, reach the engine as torch tensors over the
    receiver's buffers, and what it holds carries to a service at a new address (a delta)."""
    import torch

    models = chain_of(2, seed=35)

    async def body() -> None:
        loader = ReceiverWeightLoader(tmp_path / "raas", in_memory=True)
        try:
            async with serving(tmp_path / "store") as first:
                await publish_version(first.address, "p", "v0", 0, models[0])
                state, _ = await loader.fetch("p", VersionSpec(0, "v0"), first.address)
                async with serving(tmp_path / "store") as second:  # the restarted service
                    await publish_version(second.address, "p", "v1", 1, models[1])
                    state, fetched = await loader.fetch("p", VersionSpec(1, "v1"), second.address)
                    assert 0 < fetched < sum(len(d) for _, _, d in models[1].values())  # a delta
            assert not (tmp_path / "raas").exists(), "nothing written to disk"
            for name, (_, shape, data) in models[1].items():
                t = state[name]
                assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
                assert tuple(t.shape) == tuple(shape)
                assert t.view(torch.uint8).reshape(-1).numpy().tobytes() == data
        finally:
            await loader.close()

    run(body())


# ----- Dataflow ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_dataflow_retries_a_load_that_cannot_complete_and_reports_the_instance(tmp_path):
    """A RaaS whose loads hang: each ends at the RaaS's deadline, Dataflow retries with a
    backoff, reports the instance in status after repeated failures, and the instance catches
    up (and the report clears) once a load succeeds."""
    config = dataflow_config(tmp_path, 8)

    async def body() -> None:
        gen = HangingGenerator()
        async with running_dataflow(config) as (dserver, df, _client):
            server, servicer, registrar = await start_raas(
                gen,
                capacity=16,
                dataflow_address=dserver.address,
                instance_id="raas-a",
                grace_s=0.1,
                load_timeout_s=0.3,
            )
            try:
                await until(lambda: "raas-a" in df.pool.instances, 5, "registration")
                df.announce("policy", 1, "1", "127.0.0.1:1")
                inst = df.pool.instances["raas-a"]
                await until(
                    lambda: inst.load_failures >= LOAD_FAILURES_REPORTED, 15, "repeated failures"
                )
                status = df.status()
                assert status["counters"]["weight_load_failing.raas-a"] >= LOAD_FAILURES_REPORTED
                assert "weight loads failing on raas-a" in status["gate"]["reason"]
                assert "DEADLINE_EXCEEDED" in inst.load_error
                # Backed off, not hammered: a handful of attempts in these seconds.
                assert gen.calls <= LOAD_FAILURES_REPORTED + 2
                gen.release.set()
                await until(lambda: inst.loaded_versions.get("policy") == 1, 40, "the load")
                assert inst.load_failures == 0
                assert "weight_load_failing.raas-a" not in df.status()["counters"]
            finally:
                await registrar.stop()
                await server.stop(0)
                await servicer.close()

    run(body(), 60)


def test_loads_use_the_newest_announced_weight_service_address(tmp_path):
    """The WeightService restarted on a new port and the trainer announced again: every load,
    of any version, goes to the new address, which survives a Dataflow restart."""
    config = dataflow_config(tmp_path, 8)

    class AddressCheckingGenerator(ScriptedGenerator):
        def __init__(self) -> None:
            super().__init__()
            self.addresses: list[str] = []

        async def load_weights(self, versions, weights_address: str) -> int:
            self.addresses.append(weights_address)
            if weights_address != "127.0.0.1:2222":
                raise Unavailable("nothing listens there", reason="DEAD_ADDRESS")
            return await super().load_weights(versions, weights_address)

    async def body() -> None:
        gen = AddressCheckingGenerator()
        async with running_dataflow(config) as (dserver, df, _client):
            server, servicer, registrar = await start_raas(
                gen,
                capacity=16,
                dataflow_address=dserver.address,
                instance_id="raas-a",
                grace_s=0.1,
            )
            try:
                await until(lambda: "raas-a" in df.pool.instances, 5, "registration")
                df.announce("policy", 1, "1", "127.0.0.1:1111")  # the old, dead service
                await until(lambda: gen.addresses, 5, "a load")
                assert df.announce("policy", 1, "1", "127.0.0.1:2222") is True  # a repeat
                inst = df.pool.instances["raas-a"]
                await until(lambda: inst.loaded_versions.get("policy") == 1, 10, "the load")
                assert gen.addresses[-1] == "127.0.0.1:2222"
                assert df.status()["policies"][0]["weights_address"] == "127.0.0.1:2222"
            finally:
                await registrar.stop()
                await server.stop(0)
                await servicer.close()
        async with running_dataflow(config) as (_dserver, df, _client):
            assert df.versions.targets()["policy"].weights_address == "127.0.0.1:2222"

    run(body())


def test_version_book_targets_any_version_at_the_newest_address():
    book = VersionBook(["p", "q"], "lockstep")
    book.announce("p", 1, "p1", "old:1")
    book.announce("q", 1, "q1", "old:1")
    book.announce("p", 2, "p2", "new:2")  # p's service moved; lockstep still targets v1
    targets = book.targets()
    assert targets["p"].version == 1 and targets["p"].weights_address == "new:2"
    assert targets["q"].weights_address == "old:1"
    assert book.announce("q", 1, "q1", "new:3") is True  # a repeat with a new address
    assert book.targets()["q"].weights_address == "new:3"

    again = VersionBook(["p", "q"], "lockstep")
    again.restore(book.state())
    assert again.targets() == book.targets()

    # State written before the newest address was kept: the newest version's address.
    legacy = {"p": {"current": 2, "history": {"1": ["p1", "old:1"], "2": ["p2", "new:2"]}}}
    old = VersionBook(["p"], "independent")
    old.restore(legacy)
    assert old.address("p") == "new:2"
