"""End to end with real processes: Dataflow, WeightService and two torch-engine RaaS.

The test plays the trainer: it publishes a new version of the tiny model to the
WeightService, announces it to Dataflow, and checks that both RaaS load it and
that tokens generated afterwards carry the new version.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence

import numpy as np
import pytest

from astra.clients.dataflow import DataflowClient
from astra.clients.raas import RolloutClient
from tests.conftest import make_config
from tests.procs import Proc, start_dataflow

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")


def start_weights(tmp_path) -> Proc:
    args = [
        sys.executable,
        "-m",
        "astra.cli",
        "serve",
        "weights",
        "--store",
        str(tmp_path / "weights-store"),
        "--port",
        "0",
    ]
    return Proc(args, log=tmp_path / "weights.log")


def start_raas(
    dataflow: str, tmp_path, name: str, capacity: int = 16, engine: Sequence[str] = ()
) -> Proc:
    """`astra serve raas` of the tiny model (the torch engine unless `engine` says otherwise)."""
    args = [
        sys.executable,
        "-m",
        "astra.cli",
        "serve",
        "raas",
        "--dataflow",
        dataflow,
        *engine,
        "--model",
        "tiny",
        "--policy",
        "policy",
        "--capacity",
        str(capacity),
        "--instance-id",
        name,
        "--state-dir",
        str(tmp_path / name),
    ]
    return Proc(args, log=tmp_path / f"{name}.log", timeout_s=60)


def perturbed_tiny() -> dict:
    from astra.engine.tiny import tiny_model

    model = tiny_model()
    out = {}
    gen = torch.Generator().manual_seed(1)
    for name, t in model.hf_state_dict().items():
        t = t.detach().clone()
        if name.endswith("lm_head.weight") or name.endswith("embed_tokens.weight"):
            t += 0.01 * torch.randn(t.shape, generator=gen)
        out[name] = ("F32", list(t.shape), t.numpy().tobytes())
    return out


async def first_batch_then_version_1(client: DataflowClient, weights_address: str) -> list:
    """Trains the first batch (fetched and acknowledged), then publishes version 1 (the tiny
    model perturbed) and announces it: the first batch's trajectories."""
    from astra.clients.weights_publish import publish_version

    header, trajs, _ = await client.fetch_batch("policy", 2, "b0", max_wait_s=30)
    await client.ack_batch(header.batch_id)
    await publish_version(weights_address, "policy", "1", 1, perturbed_tiny())
    await client.announce_version("policy", 1, weights_address, version_id="1")
    return trajs


async def wait_status(client: DataflowClient, done, timeout_s: float = 60.0):
    """Dataflow's status once `done(status)`, or the last one read when `timeout_s` is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await client.get_status()
        if done(status):
            return status
        await asyncio.sleep(0.3)
        if time.monotonic() >= deadline:
            return status


def test_raas_load_announced_version_and_stamp_tokens(dataset, tmp_path):
    # eta = 0 and no staleness: synchronous, so after the announcement only
    # version-1 tokens can be served.
    config = make_config(
        dataset,
        tmp_path / "df-state",
        gate={"max_version_lag": 0},
        policies=[
            {
                "id": "policy",
                "batch_groups": 2,
                "buffer": {"drop_equal_rewards": False, "max_version_lag": 0},
            }
        ],
        streams=[
            {
                "name": "s",
                "dataset": {"path": str(dataset), "num_epochs": 0},
                "policy_ids": ["policy"],
                "group_size": 2,
                "sampling": {"max_new_tokens": 6},
            }
        ],
    )
    df = start_dataflow(config, tmp_path)
    weights = start_weights(tmp_path)
    raas = [start_raas(df.address, tmp_path, f"raas-{i}") for i in range(2)]
    procs = [*raas, weights, df]

    def loaded_by_instance(status) -> dict[str, dict[str, int]]:
        return {
            i.instance_id: {v.policy_id: v.version for v in i.loaded_versions}
            for i in status.instances
        }

    def both_hold_version_1(status) -> bool:
        loaded = loaded_by_instance(status)
        return all(loaded.get(f"raas-{i}", {}).get("policy") == 1 for i in range(2))

    async def body():
        async with DataflowClient(df.address, timeout_s=10) as client:
            trajs = await first_batch_then_version_1(client, weights.address)
            assert all(t.sequences[0].token_ids.shape[0] > 0 for t in trajs)
            status = await wait_status(client, both_hold_version_1)
            loaded = loaded_by_instance(status)
            assert all(loaded[f"raas-{i}"]["policy"] == 1 for i in range(2)), loaded
            # eta = 0: exactly one batch's worth is generated per version.
            seen = set()
            for n in range(1):
                header, trajs, _ = await client.fetch_batch("policy", 2, f"b{n + 1}", max_wait_s=30)
                await client.ack_batch(header.batch_id)
                for t in trajs:
                    s = t.sequences[0]
                    v = np.frombuffer(s.weight_versions.data, dtype="<i8")
                    seen.update(int(x) for x in v[v >= 0])
            assert seen == {1}, seen
            async with RolloutClient(raas[0].address, timeout_s=10) as rc:
                counters = (await rc.get_status()).counters
            # one swap at least (version 1), and the time decoding stood still for it
            assert counters["weight_swaps"] >= 1 and counters["weight_swap_pause_us"] > 0
            return status

    try:
        status = asyncio.run(body())
    finally:
        for p in procs:
            p.close()
    assert status.counters["weight_loads"] >= 2
    logs = json.dumps([p.log.read_text()[-500:] for p in raas])
    assert "Traceback" not in logs, logs


FAKE_SGLANG = """
import json, signal, threading
from astra.testing.fake_engines import FakeEngineServer
fake = FakeEngineServer("sglang").start()
print(json.dumps({"service": "fake-sglang", "address": fake.url}), flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: done.set())
done.wait()
fake.stop()
"""


def test_raas_on_a_fake_sglang_server_serves_dataflow_and_loads_versions(dataset, tmp_path):
    """`astra serve raas --engine sglang --engine-url` against the FAKE SGLang server."""
    config = make_config(dataset, tmp_path / "df-state")
    df = start_dataflow(config, tmp_path)
    weights = start_weights(tmp_path)
    fake = Proc([sys.executable, "-c", FAKE_SGLANG], log=tmp_path / "fake.log")
    procs = [weights, df, fake]
    engine = ["--engine", "sglang", "--engine-url", fake.address]
    procs.append(start_raas(df.address, tmp_path, "raas-sglang", capacity=8, engine=engine))

    def held(status) -> dict[str, int]:
        return {v.policy_id: v.version for i in status.instances for v in i.loaded_versions}

    async def body():
        async with DataflowClient(df.address, timeout_s=10) as client:
            trajs = await first_batch_then_version_1(client, weights.address)
            assert trajs and all(t.sequences[0].logprobs.data for t in trajs)
            return held(await wait_status(client, lambda s: held(s).get("policy") == 1))

    try:
        policies = asyncio.run(body())
    finally:
        for p in procs:
            p.close()
    assert policies.get("policy") == 1, policies
    log = (tmp_path / "raas-sglang.log").read_text()
    assert "Traceback" not in log, log[-2000:]
