"""Dataflow invariants (INVARIANTS.md) attacked with real in-process servers.

Every test runs a real Dataflow gRPC server and one or more scripted RaaS gRPC servers on
127.0.0.1:0 in one event loop, plus a trainer loop that talks to Dataflow through the typed
DataflowClient. The trainer decodes what it is given (group ids, the per-token weight versions
of every sequence) so the checks look at what would really be trained, not at Dataflow's own
bookkeeping. Where a test needs a fault that a real process cannot produce on cue (a lost
AckResults, a duplicate delivery, a failed call), it is injected in-process.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from astra.clients.dataflow import DataflowClient
from astra.clients.raas import RolloutClient
from astra.common.group_convert import incoming_group
from astra.common.v1 import rollout_pb2
from astra.dataflow import dispatch, upkeep
from astra.dataflow.config import DataflowConfig
from astra.dataflow.coordinator import Dataflow
from astra.dataflow.pool import InstanceState
from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.raas.scripted import ScriptedGenerator
from astra.servers.raas_serve import start_raas
from tests.conftest import error_info, free_port, make_config, running_dataflow

POLICY = "policy"
WEIGHTS = "weights://invariants"
GROUP_SIZE = 4


# ----- configuration and small utilities --------------------------------------------------------


def run(coro, timeout_s: float = 30.0):
    """Runs one test body on a fresh event loop, bounded."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def until(predicate, timeout_s: float = 5.0, what: str = "condition"):
    """Polls `predicate` until it is truthy (returned) or the deadline passes (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


def write_prompts(path: Path, n: int) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": f"q{i}=", "answer": str(i)}) + "\n" for i in range(n))
    )
    return path


def policy(pid: str = POLICY, batch_groups: int = 2, **buffer) -> dict:
    return {
        "id": pid,
        "batch_groups": batch_groups,
        "buffer": {"drop_equal_rewards": False, **buffer},
    }


def dataflow_config(tmp_path: Path, n: int, **over) -> DataflowConfig:
    """A Dataflow over `n` prompts of one stream "s"; `over` as for conftest.make_config."""
    dataset = write_prompts(tmp_path / "prompts.jsonl", n)
    stream = over.pop("stream", {})
    base_stream = {
        "name": "s",
        "dataset": {"path": str(dataset), "num_epochs": 1},
        "policy_ids": [POLICY],
        "group_size": GROUP_SIZE,
        "sampling": {"max_new_tokens": 8},
    }
    over.setdefault("policies", [policy()])
    return make_config(dataset, tmp_path / "state", streams=[{**base_stream, **stream}], **over)


def all_ids(n: int, stream: str = "s", epoch: int = 0) -> set[str]:
    return {f"{stream}/{epoch}/{i}" for i in range(n)}


def epoch_finished(df: Dataflow) -> bool:
    """Every prompt of every stream handed out and no group waiting or in flight."""
    return all(s.exhausted for s in df.sources.values()) and not df.work


def run_counters(status: dict) -> dict[str, int]:
    """The durable, run-level counters of a status (without the buffer's and derived ones)."""
    derived = {"groups_waiting", "groups_done"}
    return {
        k: v
        for k, v in status["counters"].items()
        if not k.startswith("buffer.") and k not in derived
    }


def decode(arr) -> np.ndarray:
    """An NDArray as numpy, decoded here (little-endian) rather than by the code under test."""
    dtypes = {"int64": "<i8", "int32": "<i4"}
    assert arr.dtype in dtypes, arr.dtype
    values = np.frombuffer(arr.data, dtype=dtypes[arr.dtype])
    assert values.size == math.prod(arr.shape)
    return values


def generated_versions(trajectory) -> np.ndarray:
    """Weight versions of every generated token of a trajectory (prompt tokens carry -1)."""
    parts = [decode(s.weight_versions) for s in trajectory.sequences]
    every = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return every[every >= 0]


# ----- rollout services ---------------------------------------------------------------------------


class SlowLoadGenerator(ScriptedGenerator):
    """Scripted generator whose LoadWeights takes time (as a real weight fetch does) and which
    records every load it is asked for."""

    def __init__(self, *args, load_delay_s: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.load_delay_s = load_delay_s
        self.load_calls: list[dict[str, int]] = []

    async def load_weights(self, versions, weights_address: str) -> int:
        self.load_calls.append({p: v.version for p, v in versions.items()})
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        return await super().load_weights(versions, weights_address)


class MalformingGenerator(ScriptedGenerator):
    """Scripted generator that returns a non-finite reward (a malformed result) for every
    group whose record index is a multiple of `malformed_every`."""

    def __init__(self, *args, malformed_every: int = 5, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.malformed_every = malformed_every

    async def generate(self, group, versions):
        out = await super().generate(group, versions)
        if int(group.group_id.rsplit("/", 1)[1]) % self.malformed_every == 0:
            out[0].reward = float("nan")
        return out


@dataclass
class Raas:
    server: object
    servicer: object
    registrar: object
    backend: ScriptedGenerator
    stopped: bool = False

    async def kill(self) -> None:
        """Like SIGKILL: no deregistration, running groups lost, the port closed."""
        if self.stopped:
            return
        self.stopped = True
        await self.registrar.stop(deregister=False)
        await self.server.stop(0)
        await self.servicer.close()

    async def stop(self) -> None:
        """A clean shutdown: deregisters first."""
        if self.stopped:
            return
        self.stopped = True
        await self.registrar.stop()
        await self.server.stop(0)
        await self.servicer.close()


@asynccontextmanager
async def raas(
    dataflow_address: str, backend: ScriptedGenerator, *, capacity: int, name: str, port: int = 0
):
    server, servicer, registrar = await start_raas(
        backend,
        capacity=capacity,
        dataflow_address=dataflow_address,
        instance_id=name,
        port=port,
        grace_s=0.1,
    )
    r = Raas(server, servicer, registrar, backend)
    try:
        yield r
    finally:
        await r.kill()


@asynccontextmanager
async def with_raas(
    config: DataflowConfig, backend: ScriptedGenerator, *, capacity: int, name: str
):
    """conftest.running_dataflow with one scripted RaaS (`raas`) registering with it:
    yields (dataflow, client, raas)."""
    async with (
        running_dataflow(config) as (server, df, client),
        raas(server.address, backend, capacity=capacity, name=name) as r,
    ):
        yield df, client, r


async def in_flight_on(df: Dataflow, name: str, groups: int):
    """The pool's instance `name` once it holds `groups` groups in flight, accepted.

    Leased is not yet accepted: a RaaS killed while the submit is on the wire gives the
    groups back as a failed submit, not as the orphans of a dead instance.
    """
    inst = await until(lambda: df.pool.instances.get(name))
    await until(lambda: len(inst.in_flight) == groups)
    await until(lambda: df.counters["groups_accepted"] >= groups, 5.0, "the submit's answer")
    return inst


def probing_pool(confirm_failures: int) -> dict:
    """Pool settings where failed health probes (every 0.1 s), not heartbeats, find the dead."""
    return {
        "confirm_failures": confirm_failures,
        "probe_interval_s": 0.1,
        "heartbeat_timeout_s": 30.0,
    }


async def registered(df: Dataflow, *names: str, timeout_s: float = 5.0) -> None:
    def ok():
        return all(
            n in df.pool.instances and df.pool.instances[n].state is InstanceState.ACTIVE
            for n in names
        )

    await until(ok, timeout_s, f"registration of {names}")


# ----- the trainer ---------------------------------------------------------------------------------


@dataclass
class Fetched:
    header: pb.BatchHeader
    trajectories: list
    footer: pb.BatchFooter

    @property
    def group_ids(self) -> list[str]:
        return list(dict.fromkeys(t.group_id for t in self.trajectories))


@dataclass
class Trainer:
    """Fetches, checks, acknowledges and (optionally) announces the next version."""

    client: DataflowClient
    policy_id: str = POLICY
    version: int = 0
    batches: list[Fetched] = field(default_factory=list)
    consumed: list[str] = field(default_factory=list)

    async def fetch(
        self, num_groups: int, request_id: str | None = None, max_wait_s: float = 1.0
    ) -> Fetched | None:
        """A batch, or None when Dataflow answers BATCH_NOT_READY."""
        try:
            header, trajectories, footer = await self.client.fetch_batch(
                self.policy_id,
                num_groups,
                request_id or uuid.uuid4().hex,
                max_wait_s=max_wait_s,
                timeout_s=5.0,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                return None
            raise
        assert header.policy_id == self.policy_id
        assert header.num_trajectories == len(trajectories) == footer.num_trajectories
        batch = Fetched(header, trajectories, footer)
        assert len(batch.group_ids) == header.num_groups
        return batch

    async def ack(self, batch: Fetched) -> None:
        resp = await self.client.ack_batch(batch.header.batch_id)
        assert resp.consumed_groups == batch.header.num_groups
        self.batches.append(batch)
        self.consumed.extend(batch.group_ids)

    async def announce(self) -> None:
        self.version += 1
        resp = await self.client.announce_version(self.policy_id, self.version, WEIGHTS)
        assert resp.current_version == self.version

    async def drain(
        self,
        df: Dataflow,
        num_groups: int = 2,
        *,
        announce: bool = False,
        check=None,
        timeout_s: float = 15.0,
    ) -> None:
        """Trains until the epoch is finished and the buffer is empty; `check(batch)` on each."""
        deadline = time.monotonic() + timeout_s
        buf = df.buffers[self.policy_id]
        while True:
            if time.monotonic() > deadline:
                status = df.status()
                pytest.fail(f"epoch not drained; gate {status['gate']}; {status['counters']}")
            finished = epoch_finished(df)
            if finished and len(buf) == 0 and df.batches.leased_groups(self.policy_id) == 0:
                return
            n = num_groups if not finished else min(num_groups, len(buf))
            if n == 0:
                await asyncio.sleep(0.02)
                continue
            batch = await self.fetch(n, max_wait_s=0.5 if not finished else 0.05)
            if batch is None:
                continue
            assert batch.header.policy_version == self.version
            if check is not None:
                check(batch)
            await self.ack(batch)
            if announce:
                await self.announce()


def assert_consumed_once(consumed: list[str]) -> None:
    repeated = [g for g, c in Counter(consumed).items() if c > 1]
    assert not repeated, f"groups trained twice: {repeated}"


def assert_epoch_trained_once(consumed: list[str], n: int) -> None:
    """Every group of the `n`-prompt epoch of stream "s" trained, none twice."""
    assert_consumed_once(consumed)
    assert set(consumed) == all_ids(n)


# ----- 1. accounting -------------------------------------------------------------------------------


def test_every_group_of_an_epoch_ends_in_exactly_one_counted_outcome(tmp_path):
    n = 30
    config = dataflow_config(
        tmp_path, n, policies=[policy(drop_equal_rewards=True)], gate={"max_version_lag": None}
    )

    async def body():
        gen = MalformingGenerator(fail_every=4, malformed_every=7)
        async with with_raas(config, gen, capacity=32, name="raas-a") as (df, client, _):
            trainer = Trainer(client)

            def check(batch: Fetched) -> None:
                for t in batch.trajectories:
                    assert not t.HasField("error"), "a failed trajectory reached the trainer"
                    assert math.isfinite(t.reward) and math.isfinite(t.advantage)

            await trainer.drain(df, check=check)
            return trainer, df.status(), {r.group_id: r for r in df.store.work_rows()}

    trainer, status, rows = run(body())
    c = status["counters"]
    assert set(rows) == all_ids(n), "the work table does not hold exactly the epoch's groups"
    assert all(r.state == "done" for r in rows.values())
    outcomes = {"accepted": set(), "filtered": set(), "failed": set(), "malformed": set()}
    for gid, row in rows.items():
        if row.outcome == f"{POLICY}:accepted":
            outcomes["accepted"].add(gid)
        elif row.outcome == f"{POLICY}:filtered_equal_reward":
            outcomes["filtered"].add(gid)
        elif row.outcome.startswith("failed:"):
            outcomes["failed"].add(gid)
        elif row.outcome.startswith("malformed:"):
            outcomes["malformed"].add(gid)
        else:
            pytest.fail(f"unexpected outcome {row.outcome!r} of {gid}")
    assert all(outcomes.values()), {k: len(v) for k, v in outcomes.items()}  # each path exercised
    assert_consumed_once(trainer.consumed)
    assert set(trainer.consumed) == outcomes["accepted"]
    # The counters tell the same story, and add up to the dataset.
    assert c["consumed_groups"] == len(outcomes["accepted"])
    assert c[f"buffer.{POLICY}.filtered_equal_reward"] == len(outcomes["filtered"])
    assert c["failed_groups"] == len(outcomes["failed"])
    assert c["malformed_results"] == len(outcomes["malformed"])
    total = (
        c["consumed_groups"]
        + c[f"buffer.{POLICY}.filtered_equal_reward"]
        + c["failed_groups"]
        + c["malformed_results"]
    )
    assert total == n == c["groups_done"]
    assert c["completed_groups"] == len(outcomes["accepted"]) + len(outcomes["filtered"])
    assert c["consumed_trajectories"] == sum(len(b.trajectories) for b in trainer.batches)
    assert c.get("duplicates_dropped", 0) == 0 and c["dispatched"] == n
    assert status["policies"][0]["buffered_groups"] == 0


# ----- 2. staleness bound ----------------------------------------------------------------------


def test_nothing_older_than_max_version_lag_reaches_the_trainer(tmp_path):
    n = 40
    config = dataflow_config(
        tmp_path, n, policies=[policy(max_version_lag=1)], gate={"max_version_lag": None}
    )

    async def body():
        fast = ScriptedGenerator(delay_s=0.02)
        slow = ScriptedGenerator(delay_s=0.5)
        async with (
            running_dataflow(config) as (server, df, client),
            raas(server.address, fast, capacity=8, name="fast"),
            raas(server.address, slow, capacity=8, name="slow"),
        ):
            await registered(df, "fast", "slow")
            trainer = Trainer(client)
            trained_versions: set[int] = set()

            def check(batch: Fetched) -> None:
                v = batch.header.policy_version
                assert batch.footer.max_staleness <= 1
                for t in batch.trajectories:
                    versions = generated_versions(t)
                    assert versions.size > 0
                    assert v - int(versions.min()) <= 1, (t.trajectory_id, v, versions)
                    assert int(versions.max()) <= v, "a token from a future version"
                    trained_versions.update(int(x) for x in versions)

            await trainer.drain(df, announce=True, check=check)
            loaded = {i["instance_id"]: i["loaded_versions"] for i in df.status()["instances"]}
            return trainer, trained_versions, df.status(), loaded, fast

    trainer, trained_versions, status, loaded, fast = run(body())
    assert_consumed_once(trainer.consumed)
    # The bound was exercised (stale groups were dropped, and counted) ...
    c = status["counters"]
    assert c[f"buffer.{POLICY}.filtered_stale"] > 0
    assert c["consumed_groups"] + c[f"buffer.{POLICY}.filtered_stale"] == n
    # ... and Dataflow did tell the RaaS to load the announced versions.
    assert c["weight_loads"] > 0
    assert fast.loaded[POLICY].version > 0
    assert loaded["fast"][0]["version"] > 0
    assert len(trained_versions) >= 2, trained_versions


@asynccontextmanager
async def four_groups_at_version_0(tmp_path):
    """Dataflow with buffer max_version_lag 1, no gate bound, version 0 announced and 4 groups buffered."""
    config = dataflow_config(
        tmp_path, 8, policies=[policy(max_version_lag=1)], gate={"max_version_lag": None}
    )
    async with with_raas(config, ScriptedGenerator(), capacity=32, name="raas-a") as (df, c, _):
        await until(lambda: len(df.buffers[POLICY]) >= 4, what="4 buffered groups")
        yield df, c


def test_staleness_counts_from_the_trainer_version_when_its_announcement_lags(tmp_path):
    """The trainer publishes in the background, so Dataflow may not know its version yet:
    groups within the bound of the announced version but past it for the trainer's own
    (FetchBatchRequest.trainer_version) must not be served."""

    async def body():
        async with four_groups_at_version_0(tmp_path) as (df, client):
            # Version 0 is announced; the trainer already trains version 2's weights.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.fetch_batch(POLICY, 2, "ahead", trainer_version=2, max_wait_s=0.2)
            assert error_info(err.value)[0].reason == "BATCH_NOT_READY"
            return df.status()

    status = run(body())
    c = status["counters"]
    assert c[f"buffer.{POLICY}.filtered_stale"] >= 4 and c.get("consumed_groups", 0) == 0


def test_a_trainer_one_version_ahead_still_gets_the_groups_within_the_bound(tmp_path):
    async def body():
        async with four_groups_at_version_0(tmp_path) as (_df, client):
            header, trajectories, footer = await client.fetch_batch(
                POLICY, 2, "level", trainer_version=1, max_wait_s=2
            )
            assert header.policy_version == 1 and footer.max_staleness == 1
            return len(trajectories)

    assert run(body()) > 0


# ----- 3. synchronous mode -----------------------------------------------------------------------


def sync_check(batch: Fetched) -> None:
    v = batch.header.policy_version
    for t in batch.trajectories:
        versions = generated_versions(t)
        assert versions.size > 0 and set(versions.tolist()) == {v}, (
            f"{t.trajectory_id} trained at version {v} has tokens of {sorted(set(versions))}"
        )


def train_in_sync(
    config: DataflowConfig, gen: SlowLoadGenerator, timeout_s: float = 15.0
) -> tuple[Trainer, dict]:
    """Drains the epoch from one RaaS running `gen`, announcing a new version after every batch
    and checking each with sync_check: (trainer, Dataflow's status at the end)."""

    async def body():
        async with with_raas(config, gen, capacity=16, name="raas-a") as (df, client, _):
            trainer = Trainer(client)
            await trainer.drain(df, announce=True, check=sync_check, timeout_s=timeout_s)
            return trainer, df.status()

    return run(body())


def test_synchronous_mode_trains_only_tokens_of_the_version_being_trained(tmp_path):
    n = 16
    config = dataflow_config(
        tmp_path, n, policies=[policy(max_version_lag=0)], gate={"max_version_lag": 0}
    )

    trainer, status = train_in_sync(config, SlowLoadGenerator(delay_s=0.02, load_delay_s=0.05))
    assert_consumed_once(trainer.consumed)
    c = status["counters"]
    assert c["consumed_groups"] + c[f"buffer.{POLICY}.filtered_stale"] == n
    assert trainer.version >= 2


def test_eta_zero_alone_is_synchronous_even_when_weight_loads_take_time(tmp_path):
    """eta = 0 without any buffer staleness bound: the dispatcher itself must wait for the
    RaaS to hold the announced version (weight loads take time), or old tokens get trained."""
    n = 12
    config = dataflow_config(tmp_path, n, gate={"max_version_lag": 0})

    trainer, status = train_in_sync(config, SlowLoadGenerator(delay_s=0.02, load_delay_s=0.2))
    assert_epoch_trained_once(trainer.consumed, n)
    assert status["counters"][f"buffer.{POLICY}.filtered_stale"] == 0


def test_eta_zero_dispatches_as_soon_as_the_new_version_is_loaded(tmp_path, monkeypatch):
    """eta = 0: after an announcement nothing is dispatched until a RaaS holds the new version.
    The finished load itself must wake the dispatcher; if it waited for a heartbeat or the idle
    poll instead, every synchronous step would pay that wait. Here both are 30 s away."""
    monkeypatch.setattr(dispatch, "IDLE_POLL_S", 30.0)
    n = 8
    config = dataflow_config(
        tmp_path,
        n,
        gate={"max_version_lag": 0},
        pool={"heartbeat_interval_s": 30.0, "heartbeat_timeout_s": 60.0},
    )

    gen = SlowLoadGenerator(delay_s=0.01, load_delay_s=0.05)
    trainer, _ = train_in_sync(config, gen, timeout_s=10.0)
    assert set(trainer.consumed) == all_ids(n)
    assert trainer.version >= 3 and len(gen.load_calls) >= 3


def test_a_version_announced_during_a_load_is_loaded_as_soon_as_that_load_ends(
    tmp_path, monkeypatch
):
    """One load per instance at a time: a version announced while the RaaS loads the previous
    one must be sent when that load ends, not wait for the next upkeep (up to 0.5 s, paid by
    every version when versions come faster than loads). Upkeep is switched off here, so
    nothing else would start the second load."""

    async def no_upkeep(self) -> None:
        return None

    monkeypatch.setattr(upkeep.Upkeep, "run", no_upkeep)
    config = dataflow_config(tmp_path, 8, gate={"max_version_lag": None})
    gen = SlowLoadGenerator(delay_s=0.01, load_delay_s=0.3)

    async def body():
        async with with_raas(config, gen, capacity=16, name="raas-a") as (df, client, _):
            await registered(df, "raas-a")
            trainer = Trainer(client)
            await trainer.announce()  # version 1: its load starts
            await until(lambda: len(gen.load_calls) == 1, 5.0, "the load of version 1")
            await trainer.announce()  # version 2, while version 1 loads
            await until(lambda: len(gen.load_calls) == 2, 5.0, "the load of version 2")
            inst = df.pool.instances["raas-a"]
            await until(lambda: inst.loaded_versions.get(POLICY) == 2, 5.0, "version 2 held")
            return list(gen.load_calls)

    calls = run(body())
    assert calls == [{POLICY: 1}, {POLICY: 2}]


# ----- 4. batch leases ----------------------------------------------------------------------------


@pytest.mark.parametrize("untrained", ["", "TOKEN_OUT_OF_RANGE"])
def test_a_batch_acknowledged_untrained_gives_its_slots_back(tmp_path, untrained):
    """eta = 0 and no version announced: the first batch takes the version's whole budget.
    Acknowledged as trained, nothing more is generated until a version comes (synchronous).
    Acknowledged untrained (the trainer refused it), its groups give their slots back, so
    another batch forms at the same version (else the run would wait for good for a version
    that cannot come)."""
    n = 12
    config = dataflow_config(tmp_path, n, gate={"max_version_lag": 0})

    async def body():
        gen = ScriptedGenerator()
        async with with_raas(config, gen, capacity=32, name="raas-a") as (df, client, _):
            trainer = Trainer(client)
            first = await trainer.fetch(2, max_wait_s=5.0)
            assert first is not None
            resp = await client.ack_batch(first.header.batch_id, untrained_reason=untrained)
            assert resp.consumed_groups == 2
            again = await client.ack_batch(first.header.batch_id)  # a repeat: idempotent
            assert again.consumed_groups == 0
            second = await trainer.fetch(2, max_wait_s=1.5)
            return df.status()["counters"], first, second

    counters, first, second = run(body())
    assert counters["consumed_groups"] == 2
    if untrained:
        assert second is not None, "no batch after an untrained one: the off-policy bound stalled"
        assert not set(second.group_ids) & set(first.group_ids)
        assert second.header.policy_version == 0
        assert counters["untrained_batches"] == 1 and counters["untrained_groups"] == 2
        assert counters[f"untrained.{untrained}"] == 1
        assert counters[f"untrained_groups.{POLICY}"] == 2
        assert counters.get(f"trained_groups.{POLICY}", 0) == 0
    else:
        assert second is None, "eta = 0 generated past the version's budget"
        assert counters.get("untrained_batches", 0) == 0
        assert counters[f"trained_groups.{POLICY}"] == 2


@pytest.mark.parametrize("untrained", ["", "NON_FINITE_LOSS"])
def test_only_a_trained_batch_enters_replay_memory(tmp_path, untrained):
    """Replay holds copies of groups the trainer trained on: an untrained batch's do not enter."""
    pol = policy(replay_ratio=0.5, replay_capacity_groups=8)
    config = dataflow_config(tmp_path, 8, policies=[pol], gate={"max_version_lag": None})

    async def body():
        async with with_raas(config, ScriptedGenerator(), capacity=32, name="raas-a") as (
            df,
            client,
            _,
        ):
            first = await Trainer(client).fetch(2, max_wait_s=5.0)
            await client.ack_batch(first.header.batch_id, untrained_reason=untrained)
            return df.buffers[POLICY].replay_len, len(first.group_ids)

    replay_len, fresh = run(body())
    assert fresh == 2 and replay_len == (0 if untrained else 2)


def test_an_untrained_reason_that_is_not_a_word_is_refused(tmp_path):
    config = dataflow_config(tmp_path, 4)

    async def body():
        async with with_raas(config, ScriptedGenerator(), capacity=32, name="raas-a") as (
            df,
            client,
            _,
        ):
            first = await Trainer(client).fetch(2, max_wait_s=5.0)
            for bad in ("no spaces", "X" * 65):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.ack_batch(first.header.batch_id, untrained_reason=bad)
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "untrained_reason" in refused.value.details()
            assert df.batches.batches[first.header.batch_id].state == "leased"  # still served
            resp = await client.ack_batch(first.header.batch_id, untrained_reason="NAN_REWARD")
            assert resp.consumed_groups == 2

    run(body())


def test_expired_batch_lease_puts_groups_back_and_refuses_the_late_ack(tmp_path):
    n = 8
    config = dataflow_config(tmp_path, n, leases={"batch_lease_s": 0.5})

    async def body():
        gen = ScriptedGenerator()
        async with with_raas(config, gen, capacity=32, name="raas-a") as (df, client, _):
            await until(lambda: len(df.buffers[POLICY]) >= 4, what="4 buffered groups")
            trainer = Trainer(client)
            first = await trainer.fetch(2, "req-1")
            retry = await trainer.fetch(2, "req-1")
            assert retry.header.batch_id == first.header.batch_id
            assert [t.trajectory_id for t in retry.trajectories] == [
                t.trajectory_id for t in first.trajectories
            ]
            assert [t.advantage for t in retry.trajectories] == [
                t.advantage for t in first.trajectories
            ]
            assert df.status()["policies"][0]["leased_groups"] == 2
            batch = df.batches.batches[first.header.batch_id]
            await until(lambda: batch.state == "expired", 2.0, "the batch lease to expire")
            assert df.status()["policies"][0]["leased_groups"] == 0
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await client.ack_batch(first.header.batch_id)
            assert late.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert error_info(late.value)[0].reason == "BATCH_LEASE_EXPIRED"
            with pytest.raises(grpc.aio.AioRpcError) as again:
                await trainer.fetch(2, "req-1")
            assert again.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert error_info(again.value)[0].reason == "BATCH_LEASE_EXPIRED"
            # The same groups are served again, in a new batch, and can be trained once.
            second = await trainer.fetch(2, "req-2")
            assert second.header.batch_id != first.header.batch_id
            assert set(second.group_ids) == set(first.group_ids)
            await trainer.ack(second)
            await trainer.drain(df)
            return trainer, df.status()

    trainer, status = run(body())
    assert_epoch_trained_once(trainer.consumed, n)
    assert status["counters"]["batch_leases_expired"] == 1
    assert status["counters"]["consumed_groups"] == n


def test_an_expired_group_lease_dispatches_the_group_again_and_drops_the_late_result(tmp_path):
    """A RaaS that is alive but too slow: its leases run out, the groups go to another RaaS
    and are trained from there; the slow one is told to cancel, and the result it sends
    anyway (it does not stop) is dropped as a duplicate."""
    n = 4
    config = dataflow_config(
        tmp_path,
        n,
        leases={"group_lease_s": 0.5, "max_dispatch_attempts": 3},
        gate={"max_version_lag": None},
    )

    async def body():
        slow_gen = ScriptedGenerator(delay_s=2.0)
        async with (
            running_dataflow(config) as (server, df, client),
            raas(server.address, slow_gen, capacity=n * GROUP_SIZE, name="slow") as slow,
        ):
            first = await in_flight_on(df, "slow", n)
            slow_ids = set(first.in_flight)
            told_to_cancel: list[str] = []

            def ignore_cancel(group_ids):  # keeps working, as an engine stuck in a step would
                told_to_cancel.extend(group_ids)
                return []

            slow.servicer.store.cancel = ignore_cancel
            async with raas(server.address, ScriptedGenerator(), capacity=32, name="fast"):
                trainer = Trainer(client)
                await trainer.drain(df)
                await until(
                    lambda: df.counters["duplicates_dropped"] >= n, 10.0, "the late results"
                )
            rows = {r.group_id: r for r in df.store.work_rows()}
            return trainer, df.status(), slow_ids, told_to_cancel, rows

    trainer, status, slow_ids, told_to_cancel, rows = run(body())
    assert slow_ids == all_ids(n)
    assert_epoch_trained_once(trainer.consumed, n)
    c = status["counters"]
    assert c["leases_expired"] == c["requeued_lease_expired"] == n
    assert c["failed_groups"] == 0 and c["gave_up_after_max_attempts"] == 0
    assert c["consumed_groups"] == c["completed_groups"] == n
    assert c["duplicates_dropped"] >= n
    assert sorted(told_to_cancel) == sorted(slow_ids)
    assert all(rows[g].attempts == 2 and rows[g].state == "done" for g in slow_ids)


# ----- 5. duplicate deliveries ---------------------------------------------------------------------


async def delivered_by_another_raas(group_id: str, instance_id: str):
    """The result a second, unregistered scripted RaaS produces for `group_id`, as Dataflow
    would take it in (through the real wire conversion)."""
    server, servicer, _ = await start_raas(
        ScriptedGenerator(), capacity=16, instance_id=instance_id, grace_s=0.1
    )
    client = RolloutClient(server.address, timeout_s=5.0)
    try:
        group = rollout_pb2.PromptGroup(
            group_id=group_id,
            workflow="single_turn",
            policy_ids=[POLICY],
            prompt=rollout_pb2.Prompt(text="q="),
            num_samples=GROUP_SIZE,
            sampling_params=rollout_pb2.SamplingParams(max_new_tokens=8, seed=1),
        )
        await client.submit_groups([group])
        (result,) = await client.collect_results(1, 5.0)
        return incoming_group(result, instance_id)
    finally:
        await client.close()
        await server.stop(0)
        await servicer.close()


def test_duplicate_and_late_results_are_dropped_by_id_and_counted(tmp_path):
    config = dataflow_config(tmp_path, 4)

    async def body():
        slow = ScriptedGenerator(delay_s=10.0)
        async with with_raas(config, slow, capacity=8, name="raas-a") as (df, client, a):
            inst = await in_flight_on(df, "raas-a", 2)
            gid = sorted(inst.in_flight)[0]
            # Another RaaS delivers the group leased to raas-a, twice in one collect.
            other = await delivered_by_another_raas(gid, "raas-b")
            acks = await df.ingest("raas-b", [other, other])
            assert acks == [gid, gid], "a duplicate must still be acknowledged"
            assert df.counters["duplicates_dropped"] == 1
            # raas-a is told to stop working on it.
            await until(lambda: a.servicer.store.counters["groups_cancelled"] >= 1)
            assert gid not in inst.in_flight
            # raas-a's late result, and a repeated delivery after a lost ack, are dropped.
            late = await delivered_by_another_raas(gid, "raas-a")
            assert await df.ingest("raas-a", [late]) == [gid]
            assert await df.ingest("raas-b", [other]) == [gid]
            assert df.counters["duplicates_dropped"] == 3
            buf = df.buffers[POLICY]
            assert gid in buf and len(buf) == 1
            stored = [g for g, _ in df.store.groups() if g.group_id == gid]
            assert len(stored) == 1 and len(stored[0].trajectories) == GROUP_SIZE
            # Bytes written ahead for the duplicates were given back: one live blob per row.
            assert sum(df.store.blobs.live.values()) == len(df.store.groups())
            trainer = Trainer(client)
            batch = await trainer.fetch(1)
            assert batch.group_ids == [gid] and len(batch.trajectories) == GROUP_SIZE
            await trainer.ack(batch)
            return df.status()

    status = run(body())
    assert status["counters"]["consumed_groups"] == 1


def test_a_late_result_of_a_group_done_long_ago_is_dropped_after_memory_forgot_it(tmp_path):
    """Dataflow keeps only the newest done ids in memory (a run of weeks finishes millions):
    a late result for an older one is still dropped as a duplicate, before and after a
    restart, and the restart reads back only the work not done."""
    n = 6
    config = dataflow_config(tmp_path, n)

    async def late(df, gid: str) -> None:
        before = dict(df.counters)
        result = await delivered_by_another_raas(gid, "raas-late")
        assert await df.ingest("raas-late", [result]) == [gid]
        assert df.counters["duplicates_dropped"] == before.get("duplicates_dropped", 0) + 1
        assert df.counters.get("unknown_results_dropped", 0) == before.get(
            "unknown_results_dropped", 0
        )
        assert gid not in df.buffers[POLICY] and gid not in df.work

    async def first_run():
        async with with_raas(config, ScriptedGenerator(), capacity=32, name="raas-a") as (
            df,
            client,
            _,
        ):
            df.done._limit = 2  # remember two ids; the table answers for the rest
            trainer = Trainer(client)
            await trainer.drain(df)
            assert df.done.in_memory <= 2 and len(df.done) == n
            assert all(g in df.done for g in all_ids(n))
            oldest = trainer.consumed[0]
            await late(df, oldest)
            return trainer.consumed, df.status()["counters"]

    async def second_run(consumed):
        async with running_dataflow(config) as (_, df, _):
            assert df.done.in_memory == 0 and len(df.done) == n and not df.work
            await late(df, consumed[0])
            await late(df, consumed[-1])
            return df.status()["counters"]

    consumed, counters = run(first_run())
    assert_epoch_trained_once(consumed, n)
    assert counters["groups_done"] == n
    after = run(second_run(consumed))
    assert after["groups_done"] == n and after["consumed_groups"] == n


@pytest.mark.parametrize("batched", [False, True], ids=["ack_results", "collect_result_batch"])
def test_lost_ack_results_repeat_the_delivery_and_the_repeat_is_dropped(
    tmp_path, monkeypatch, batched
):
    """AckResults lost (a RaaS without CollectResultBatch): the results are delivered again
    and dropped as duplicates. With CollectResultBatch the acknowledgements fail the call
    that carries them: they go again with the next one, before its results are answered."""
    from astra.servers.raas import RolloutServicer

    if not batched:

        async def unimplemented(self, request, context):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

        monkeypatch.setattr(RolloutServicer, "CollectResultBatch", unimplemented)
    n = 12
    config = dataflow_config(tmp_path, n)

    async def body():
        gen = ScriptedGenerator()
        async with with_raas(config, gen, capacity=32, name="raas-a") as (df, client, a):
            store = a.servicer.store
            real_ack, lost = store.ack, []

            def flaky_ack(group_ids):
                if len(lost) < 3:  # the first three AckResults fail on the RaaS
                    lost.append(list(group_ids))
                    raise RuntimeError("ack lost")
                return real_ack(group_ids)

            store.ack = flaky_ack
            trainer = Trainer(client)
            await trainer.drain(df)
            await until(lambda: store.pending == 0, what="the RaaS to drop acked results")
            return trainer, df.status(), lost

    trainer, status, lost = run(body())
    assert len(lost) == 3
    assert_epoch_trained_once(trainer.consumed, n)
    c = status["counters"]
    if batched:  # the same ids, sent again
        assert all(ids == lost[0] for ids in lost)
    else:
        assert c["duplicates_dropped"] >= len({g for ids in lost for g in ids})
    assert c["consumed_groups"] == c["completed_groups"] == n
    assert c[f"buffer.{POLICY}.accepted"] == n


def test_a_crash_between_the_durable_ingest_and_the_ack_redelivers_and_drops_the_repeat(tmp_path):
    """Dataflow commits results, then dies before its AckResults leaves: after the restart
    the RaaS (which still holds them) registers again and delivers them once more; they are
    recognised as done and dropped, never buffered or trained twice."""
    from astra.servers.dataflow_serve import start_dataflow

    n = 6
    config = dataflow_config(tmp_path, n).model_copy(update={"port": free_port()})

    async def body():
        server, df, _ = await start_dataflow(config)
        # Results take 0.5 s: the ack is replaced long before the first one is collected.
        gen = ScriptedGenerator(delay_s=0.5)
        async with raas(server.address, gen, capacity=64, name="a") as a:
            inst = await until(lambda: df.pool.instances.get("a"))
            unsent: list[str] = []
            never = asyncio.Event()

            async def ack_never_leaves(group_ids):  # the process dies on this line
                unsent.extend(group_ids)
                await never.wait()

            inst.port.ack = ack_never_leaves
            return await crash_then_restart(server, df, a, config, unsent)

    check_redelivered_once(*run(body(), timeout_s=60), n)


async def crash_then_restart(server, df, a, config, unsent: list[str]):
    """Once `unsent` names committed results whose ack never left: kills Dataflow (no drain,
    no clean stop), starts it again on the same state and drains it with a trainer; returns
    (trainer, the committed ids, counters before, counters after)."""
    await until(lambda: unsent, 10.0, "results committed, their ack on its way")
    committed = set(unsent)
    assert all(g in df.done for g in committed)
    before = df.status()["counters"]
    await server.stop(0)  # kill -9: no drain, no clean stop of the coordinator
    for task in [*df.ingestor.collectors.values(), *df._tasks, *df._background]:
        task.cancel()
    df.store._checkpointer.stop()
    assert a.servicer.store.pending >= len(committed)  # the RaaS still holds them
    async with running_dataflow(config) as (_, df2, client):
        trainer = Trainer(client)
        await trainer.drain(df2)
        await until(lambda: a.servicer.store.pending == 0, 10.0, "every delivery acked")
        return trainer, committed, before, df2.status()["counters"]


def check_redelivered_once(trainer, committed, before, after, n: int) -> None:
    """The repeat deliveries were dropped as duplicates and every group trained once."""
    assert before.get("duplicates_dropped", 0) == 0
    assert after.get("duplicates_dropped", 0) >= len(committed) >= 1
    assert after.get("unknown_results_dropped", 0) == 0
    assert_epoch_trained_once(trainer.consumed, n)
    assert after["consumed_groups"] == after[f"buffer.{POLICY}.accepted"] == n


# ----- 6. suspect and confirm ----------------------------------------------------------------------


def test_dead_raas_is_suspected_confirmed_and_its_groups_redispatched(tmp_path):
    n = 12
    config = dataflow_config(tmp_path, n, pool=probing_pool(3))

    async def body():
        gen = ScriptedGenerator(delay_s=30.0)
        async with with_raas(config, gen, capacity=8, name="a") as (df, client, a):
            inst = await in_flight_on(df, "a", 2)
            orphans = set(inst.in_flight)
            async with raas(
                a.registrar.dataflow_address, ScriptedGenerator(), capacity=8, name="b"
            ):
                await registered(df, "b")
                await a.kill()
                seen: list[InstanceState] = []

                def dead():
                    if not seen or seen[-1] is not inst.state:
                        seen.append(inst.state)
                    return inst.state is InstanceState.DEAD

                await until(dead, 5.0, "raas a confirmed dead")
                assert seen[-2:] == [InstanceState.SUSPECT, InstanceState.DEAD], seen
                assert inst.failures == 3 and not inst.in_flight
                states = {i["instance_id"]: i["state"] for i in df.status()["instances"]}
                assert states == {"a": "INSTANCE_STATE_DEAD", "b": "INSTANCE_STATE_ACTIVE"}
                trainer = Trainer(client)
                await trainer.drain(df)
                rows = {r.group_id: r for r in df.store.work_rows()}
                return trainer, df.status(), orphans, rows

    trainer, status, orphans, rows = run(body())
    assert_epoch_trained_once(trainer.consumed, n)
    c = status["counters"]
    assert c["instances_confirmed_dead"] == 1
    assert c["requeued_instance_dead"] == len(orphans) == 2
    assert c["redispatched"] >= 2
    assert all(rows[g].attempts == 2 for g in orphans)


def test_deregistered_raas_gives_its_groups_back_at_once(tmp_path):
    n = 8
    config = dataflow_config(tmp_path, n)

    async def body():
        gen = ScriptedGenerator(delay_s=30.0)
        async with with_raas(config, gen, capacity=8, name="a") as (df, client, a):
            inst = await in_flight_on(df, "a", 2)
            orphans = set(inst.in_flight)
            await a.stop()  # DeregisterInstance
            assert inst.state is InstanceState.LEFT and not inst.in_flight
            assert orphans <= set(df.waiting)
            async with raas(
                a.registrar.dataflow_address, ScriptedGenerator(), capacity=8, name="b"
            ):
                trainer = Trainer(client)
                await trainer.drain(df)
                return trainer, df.status()

    trainer, status = run(body())
    assert_epoch_trained_once(trainer.consumed, n)
    assert status["counters"]["requeued_instance_left"] == 2


def test_suspect_gets_no_work_keeps_its_leases_and_is_restored_when_it_answers(tmp_path):
    config = dataflow_config(tmp_path, 8, pool=probing_pool(1000))

    async def body():
        gen = ScriptedGenerator(delay_s=30.0)
        async with with_raas(config, gen, capacity=16, name="c") as (df, _client, c):
            inst = await in_flight_on(df, "c", 4)
            # Heartbeats would also restore it; keep only the health probes talking.
            await c.registrar.stop(deregister=False)
            leases = set(inst.in_flight)
            await c.server.set_serving(False)
            df.pool.call_failed("c")  # a failed call
            assert inst.state is InstanceState.SUSPECT
            await until(lambda: inst.failures >= 3, 3.0, "three failed probes")
            status = df.status()
            assert status["pool_empty"] and "pool empty" in status["gate"]["reason"]
            assert status["instances"][0]["state"] == "INSTANCE_STATE_SUSPECT"
            assert inst.state is InstanceState.SUSPECT and inst.in_flight == leases
            # The suspect answers again: restored, with its leases.
            await c.server.set_serving(True)
            await until(lambda: inst.state is InstanceState.ACTIVE, 2.0, "restoration")
            assert inst.failures == 0 and inst.in_flight >= leases
            assert df.counters.get("requeued_instance_dead", 0) == 0

    run(body())


def test_unreachable_raas_that_still_heartbeats_is_confirmed_dead(tmp_path):
    config = dataflow_config(
        tmp_path,
        8,
        pool={"confirm_failures": 3, "probe_interval_s": 0.1, "heartbeat_interval_s": 0.05},
    )

    async def body():
        gen = ScriptedGenerator(delay_s=30.0)
        async with with_raas(config, gen, capacity=8, name="d") as (df, _client, d):
            inst = await in_flight_on(df, "d", 2)
            await d.server.stop(0)  # RolloutService gone; the registrar keeps heartbeating
            await until(lambda: inst.state is InstanceState.DEAD, 10.0, "confirmed death")
            assert df.counters["requeued_instance_dead"] == 2

    run(body())


# ----- 7. several policies ------------------------------------------------------------------------


def two_policy_config(tmp_path: Path, n: int) -> DataflowConfig:
    return dataflow_config(
        tmp_path,
        n,
        policies=[policy("a"), policy("b")],
        stream={"policy_ids": ["a", "b"]},
        versions={"barrier": "lockstep"},
    )


def only_policy(pid: str):
    """A batch check: only `pid`'s sequences, advantages normalised on `pid`'s own rewards."""

    def check(batch: Fetched) -> None:
        by_group: dict[str, list] = {}
        for t in batch.trajectories:
            assert t.sequences and {s.policy_id for s in t.sequences} == {pid}
            assert generated_versions(t).max() <= batch.header.policy_version
            by_group.setdefault(t.group_id, []).append(t)
        for trajectories in by_group.values():
            rewards = np.array([t.agent_rewards[pid] for t in trajectories])
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            assert np.allclose([t.advantage for t in trajectories], expected)

    return check


def test_each_policy_gets_only_its_sequences_and_lockstep_holds_back_loads(tmp_path):
    n = 8
    config = two_policy_config(tmp_path, n)

    async def body():
        gen = SlowLoadGenerator(("a", "b"), delay_s=0.05)
        async with with_raas(config, gen, capacity=16, name="ab") as (df, client, r):
            await registered(df, "ab")
            ta, tb = Trainer(client, "a"), Trainer(client, "b")
            # a announces v1 alone: nobody is told to load a@1.
            await ta.announce()
            await asyncio.sleep(0.6)
            assert gen.load_calls == [] and r.servicer.loaded_versions == {"a": 0, "b": 0}
            st = {p["policy_id"]: p for p in df.status()["policies"]}
            assert st["a"]["current_version"] == 1 and st["a"]["target_version"] == 0
            # b catches up: both are loaded, together.
            await tb.announce()
            await until(lambda: r.servicer.loaded_versions == {"a": 1, "b": 1})
            assert gen.load_calls == [{"a": 1, "b": 1}]
            await asyncio.gather(
                ta.drain(df, check=only_policy("a")), tb.drain(df, check=only_policy("b"))
            )
            return ta, tb, df.status()

    ta, tb, status = run(body())
    for t in (ta, tb):
        assert_epoch_trained_once(t.consumed, n)
    assert status["counters"]["consumed_groups"] == 2 * n


def test_lockstep_never_serves_a_mix_of_versions_across_weight_addresses(tmp_path):
    config = two_policy_config(tmp_path, 4)

    async def body():
        gen = SlowLoadGenerator(("a", "b"), delay_s=0.05, load_delay_s=0.05)
        async with with_raas(config, gen, capacity=16, name="ab") as (df, client, r):
            await registered(df, "ab")
            await client.announce_version("a", 1, "weights://a")
            await client.announce_version("b", 1, "weights://b")
            await until(lambda: r.servicer.loaded_versions == {"a": 1, "b": 1})
            assert all(set(call) == {"a", "b"} for call in gen.load_calls), gen.load_calls

    run(body())


def test_eta_zero_bounds_every_policy_of_a_stream_not_just_the_first(tmp_path):
    """Lockstep, eta = 0: trainer a runs ahead of trainer b. Its next batch must wait until
    the set (a:1, b:1) is loaded, never carry a's tokens of version 0 into a's version 1."""
    cfg = two_policy_config(tmp_path, 16).model_dump()
    cfg["gate"]["max_version_lag"] = 0
    config = DataflowConfig(**cfg)

    async def body():
        gen = SlowLoadGenerator(("a", "b"), delay_s=0.02)
        async with with_raas(config, gen, capacity=16, name="ab") as (df, client, _):
            await registered(df, "ab")
            ta, tb = Trainer(client, "a"), Trainer(client, "b")
            await client.announce_version("a", 0, WEIGHTS)
            await client.announce_version("b", 0, WEIGHTS)
            await until(lambda: len(df.buffers["b"]) >= 2, 5.0, "a batch for a and for b")
            await ta.ack(await ta.fetch(2))
            await ta.announce()  # a -> 1; b's trainer is slower, still at 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.fetch_batch("a", 2, "a-early", max_wait_s=0.5)
            assert error_info(err.value)[0].reason == "BATCH_NOT_READY"
            await tb.ack(await tb.fetch(2))
            await tb.announce()  # b -> 1: the set (a:1, b:1) may load now
            batch = await ta.fetch(2, "a-level", max_wait_s=10)
            assert batch is not None
            v = batch.header.policy_version
            assert v == 1
            for t in batch.trajectories:
                versions = generated_versions(t)
                assert versions.size and set(versions.tolist()) == {1}, (t.trajectory_id, versions)

    run(body())


# ----- 8. restart in-process ------------------------------------------------------------------------


def restart_config(tmp_path: Path, n: int) -> DataflowConfig:
    return dataflow_config(
        tmp_path,
        n,
        pool=probing_pool(1000),
        # Keeps the gate out of this test (see test_sync_barrier_is_left_...).
        gate={"max_version_lag": None, "barrier_staleness_score": 1.0},
    )


def test_restart_keeps_buffer_leases_position_versions_and_counters(tmp_path):
    n = 16
    config = restart_config(tmp_path, n)

    async def first_life():
        gen = ScriptedGenerator(delay_s=0.3)
        async with with_raas(config, gen, capacity=8, name="a") as (df, client, a):
            trainer = Trainer(client)
            await trainer.announce()
            await trainer.announce()
            await until(lambda: len(df.buffers[POLICY]) >= 4, 5.0, "4 buffered groups")
            await trainer.ack(await trainer.fetch(2))
            held = await trainer.fetch(2, "held")
            await until(lambda: df.pool.instances["a"].in_flight, what="groups in flight")
            await a.kill()
            before = df.status()
            buffered = {g.group_id for g, b in df.store.groups() if b is None}
            in_flight = len(df.pool.instances["a"].in_flight)
        return trainer, held, before, buffered, in_flight

    async def second_life(trainer, held, before, buffered, in_flight):
        async with running_dataflow(config) as (server, df, client):
            after = df.status()
            assert after["dataflow_id"] != before["dataflow_id"]
            assert after["streams"] == before["streams"]
            for p, q in zip(after["policies"], before["policies"], strict=True):
                for key in ("buffered_groups", "leased_groups", "current_version"):
                    assert p[key] == q[key], key
                assert p["target_version"] == 2 and p["weights_address"] == WEIGHTS
            assert {g.group_id for g, b in df.store.groups() if b is None} == buffered
            assert after["counters"]["groups_done"] == before["counters"]["groups_done"]
            waiting = before["counters"]["groups_waiting"] + in_flight
            assert after["counters"]["groups_waiting"] == waiting
            old, new = run_counters(before), run_counters(after)
            changed = {k: (v, new.get(k)) for k, v in old.items() if new.get(k) != v}
            changed.pop("batches_served", None)  # see test_restart_right_after_a_fetch_...
            assert not changed, f"run-level counters changed across the restart: {changed}"
            # The trainer's leased batch survived: the retry gets it, and can acknowledge it.
            trainer.client = client
            again = await trainer.fetch(2, "held")
            assert again.header.batch_id == held.header.batch_id
            assert [t.trajectory_id for t in again.trajectories] == [
                t.trajectory_id for t in held.trajectories
            ]
            await trainer.ack(again)
            # In-flight work is dispatched again to a new RaaS, which loads version 2.
            gen = ScriptedGenerator()
            async with raas(server.address, gen, capacity=16, name="b"):
                await trainer.drain(df)
                await until(lambda: POLICY in gen.loaded and gen.loaded[POLICY].version == 2)
            return df.status()

    async def body():
        state = await first_life()
        return state[0], await second_life(*state)

    trainer, final = run(body())
    assert_epoch_trained_once(trainer.consumed, n)
    assert final["counters"]["consumed_groups"] == n


def test_restart_right_after_a_fetch_keeps_every_run_level_counter(tmp_path):
    config = restart_config(tmp_path, 4)

    async def body():
        gen = ScriptedGenerator()
        async with with_raas(config, gen, capacity=16, name="a") as (df, client, _):
            await until(lambda: epoch_finished(df), what="the epoch")
            await Trainer(client).fetch(2)
            before = run_counters(df.status())
        async with running_dataflow(config) as (_server, df, _client):
            assert run_counters(df.status()) == before

    run(body())


def test_a_count_added_after_the_last_transaction_survives_a_graceful_stop(tmp_path):
    """A submit's `groups_accepted` is counted outside any transaction: a stop writes it
    (CI once saw 6 accepted before a restart and 4 after, when upkeep had not run since)."""
    config = restart_config(tmp_path, 4)

    async def body():
        async with running_dataflow(config) as (_server, df, _client):
            df.counters["groups_accepted"] += 3
            assert df.ledger.dirty
            before = run_counters(df.status())
        async with running_dataflow(config) as (_server, df, _client):
            assert run_counters(df.status()) == before
            assert df.counters["groups_accepted"] == 3

    run(body())


# ----- beyond the list: bounded retries, liveness of the barrier ---------------------------------


def test_a_group_that_never_finishes_is_counted_failed_after_max_dispatch_attempts(tmp_path):
    config = dataflow_config(tmp_path, 1, leases={"group_lease_s": 0.2, "max_dispatch_attempts": 2})

    async def body():
        gen = ScriptedGenerator(delay_s=30.0)
        async with with_raas(config, gen, capacity=8, name="a") as (df, _client, _):
            await asyncio.sleep(1.5)
            assert df.counters["dispatched"] <= 2, df.counters
            assert epoch_finished(df) and df.counters["failed_groups"] == 1

    run(body())


async def two_groups_then_v2(df: Dataflow, client: DataflowClient) -> Trainer:
    """Two groups in flight on instance "a" at v0, then the trainer announces v1 and v2: they
    land at a version gap of 2."""
    await in_flight_on(df, "a", 2)
    trainer = Trainer(client)
    await trainer.announce()
    await trainer.announce()
    return trainer


def test_sync_barrier_is_left_once_in_flight_work_has_drained(tmp_path):
    """Two groups generated at v0 arrive after the trainer reached v2 (gap 2, score 0.4 > 0.3):
    the gate enters SYNC_BARRIER, in-flight work drains, and the run must go on."""
    n = 8
    config = dataflow_config(tmp_path, n, gate={"max_version_lag": None})

    async def body():
        gen = ScriptedGenerator(delay_s=0.3)
        async with with_raas(config, gen, capacity=8, name="a") as (df, client, _):
            trainer = await two_groups_then_v2(df, client)
            await trainer.drain(df, timeout_s=4.0)

    run(body())


def test_the_gate_counts_the_milliseconds_it_spends_in_each_mode(tmp_path):
    """`gate_ms.<MODE>`: a decision holds until the next one; below a millisecond is carried."""
    config = dataflow_config(tmp_path, 8)

    async def body():
        async with running_dataflow(config) as (_server, df, client):
            now = [1000.0]
            df.admission.clock = lambda: now[0]
            df.admission.state = None  # the decisions so far were on the real clock
            before = df.counters["gate_ms.THROTTLED"]
            assert df.admission.evaluate().mode.name == "THROTTLED"  # no RaaS: no capacity
            for dt in (0.25, 0.0004, 0.0007):
                now[0] += dt
                df.admission.evaluate()
            assert df.counters["gate_ms.THROTTLED"] - before == 251  # 250, then 0.4 + 0.7
            status = await client.get_status()
            return status.counters["gate_ms.THROTTLED"] - before

    assert run(body()) == 251


@pytest.mark.parametrize(("allowance", "raw"), [(None, 0.0), (1, 0.2), (0, 0.4)])
def test_the_staleness_score_counts_the_gap_beyond_what_eta_allows(tmp_path, allowance, raw):
    """Two groups generated at v0 land after the trainer announced v2 (gap 2). With eta 2 the
    off-policy bound allows that gap, so by default (allowance None: eta) it adds nothing to
    the score that drives the barrier; allowance 1 counts 1 of it, 0 all of it (Flux's
    score): min(1, gap / 5)."""
    gate = {"max_version_lag": 2, "barrier_gap_allowance": allowance}
    config = dataflow_config(tmp_path, 8, gate=gate)

    async def body():
        gen = ScriptedGenerator(delay_s=0.5)
        async with with_raas(config, gen, capacity=8, name="a") as (df, client, _):
            await two_groups_then_v2(df, client)
            await until(lambda: df.ledger.accepted[POLICY] >= 2, 5.0, "the two results")
            return df.admission.staleness.last_raw

    assert run(body()) == pytest.approx(raw)


def test_a_storage_failure_during_ingest_stops_dataflow_before_it_acknowledges(
    tmp_path, monkeypatch
):
    """A full disk under the ingest transaction: the in-memory buffer may already hold the
    group, so Dataflow fail-stops (to recover from its store, as after kill -9) and never
    acknowledges to the RaaS what is not durable."""
    import sqlite3

    from astra.dataflow import store as store_mod

    config = dataflow_config(tmp_path, 8)
    stopped: list[BaseException] = []

    def full_disk(self, groups, staged=None):
        raise sqlite3.OperationalError("database or disk is full")

    async def body():
        async with running_dataflow(config) as (server, df, _client):
            df.fail_stop = stopped.append
            monkeypatch.setattr(store_mod.Tx, "add_groups", full_disk)
            gen = ScriptedGenerator()
            async with raas(server.address, gen, capacity=8, name="r") as r:
                await until(lambda: stopped, 5.0, "the fail-stop")
                acked = r.servicer.store.counters.get("results_acknowledged", 0)
                return acked, df.counters["storage_failures"]

    acked, failures = run(body())
    assert failures >= 1 and "full" in str(stopped[0])
    assert acked == 0, "nothing was acknowledged to the RaaS"


def test_a_trainer_step_longer_than_the_batch_lease_keeps_its_batch(tmp_path):
    """The trainer extends the lease while it trains (Feed.leased): a step that outlasts
    leases.batch_lease_s does not send its groups back to be trained a second time."""
    from astra.clients.trainer_sources import DataflowSource
    from astra.trainer.config import TrainerConfig
    from astra.trainer.feed import Feed

    config = dataflow_config(tmp_path, 8, leases={"batch_lease_s": 1.0})

    async def body():
        async with with_raas(config, ScriptedGenerator(), capacity=32, name="raas-a") as (
            df,
            client,
            _,
        ):
            await until(lambda: len(df.buffers[POLICY]) >= 2, what="2 buffered groups")
            source = DataflowSource(client.address, POLICY, trainer_id="t", weights_address=WEIGHTS)
            cfg = TrainerConfig.model_validate(
                {"policy_id": POLICY, "port": None, "batch": {"num_groups": 2}}
            )
            feed = Feed(cfg, Counter())
            feed.source = source
            try:
                fetched = await feed.fetch(1)
                assert fetched.lease_expire > time.time()
                async with feed.leased(fetched):
                    await asyncio.sleep(2.5)  # the step: 2.5 leases long
                await feed.ack(fetched.batch_id)
            finally:
                await source.close()
            return df.counters, feed.counters

    counters, trainer_counters = run(body())
    assert counters.get("batch_leases_expired", 0) == 0
    assert counters["batch_leases_extended"] >= 2 and trainer_counters["lease_extensions"] >= 2
    assert trainer_counters["ack_failures"] == 0 and counters["consumed_groups"] == 2


def test_extend_batch_lease_refuses_unknown_acknowledged_and_bad_ids(tmp_path):
    config = dataflow_config(tmp_path, 8)

    async def body():
        async with with_raas(config, ScriptedGenerator(), capacity=32, name="raas-a") as (
            df,
            client,
            _,
        ):
            await until(lambda: len(df.buffers[POLICY]) >= 2, what="2 buffered groups")
            header, _, _ = await client.fetch_batch(POLICY, 2, "r1", max_wait_s=2)
            before = header.lease_expire_time.ToNanoseconds()
            resp = await client.extend_batch_lease(header.batch_id)
            assert resp.lease_expire_time.ToNanoseconds() >= before
            await client.ack_batch(header.batch_id)
            cases = [
                (header.batch_id, grpc.StatusCode.FAILED_PRECONDITION, "BATCH_ACKNOWLEDGED"),
                ("nope", grpc.StatusCode.NOT_FOUND, "BATCH_NOT_FOUND"),
                ("", grpc.StatusCode.INVALID_ARGUMENT, None),
            ]
            for batch_id, code, reason in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.extend_batch_lease(batch_id)
                assert err.value.code() is code
                if reason:
                    assert error_info(err.value)[0].reason == reason

    run(body())


@pytest.mark.parametrize("eta", [2, None], ids=["eta-2", "no-eta"])
def test_with_no_trainer_dataflow_keeps_buffering_within_its_bounds(tmp_path, eta):
    """The failure matrix's trainer row: while no trainer fetches (dead, restarting), rollouts
    go on only as far as the bounds allow: eta batches ahead of the version, and never past
    the buffer's high watermark, counting what is in flight."""
    capacity = 40
    config = dataflow_config(
        tmp_path,
        400,
        policies=[policy(capacity_groups=capacity)],
        gate={"max_version_lag": eta, "buffer_high_watermark": 0.5},
    )

    async def body():
        async with with_raas(config, ScriptedGenerator(), capacity=64, name="raas-a") as (
            df,
            _client,
            _,
        ):
            peak = 0
            for _ in range(30):  # 3 s of a busy RaaS and no trainer
                await asyncio.sleep(0.1)
                in_flight = sum(len(i.in_flight) for i in df.pool.instances.values())
                peak = max(peak, len(df.buffers[POLICY]) + in_flight)
            return peak, len(df.buffers[POLICY]), df.status()

    peak, buffered, status = run(body())
    batch = 2  # policy(): batch_groups
    bound = (eta + 1) * batch if eta is not None else int(0.5 * capacity)
    assert 0 < buffered <= bound and peak <= bound, (peak, buffered, bound)
    assert status["counters"].get("buffer.policy.evicted_full", 0) == 0, "nothing evicted"


def test_a_collector_that_fails_on_a_bug_is_logged_restarted_and_loses_nothing(
    tmp_path, monkeypatch
):
    from astra.clients.rollout_port import GrpcRolloutPort

    n = 8
    config = dataflow_config(tmp_path, n, pool={"heartbeat_interval_s": 0.2})
    real, failures = GrpcRolloutPort.decode, []

    def decode_once_broken(self, received):
        if not failures:
            failures.append(1)
            raise RuntimeError("a bug in decoding")
        return real(self, received)

    monkeypatch.setattr(GrpcRolloutPort, "decode", decode_once_broken)

    async def body():
        async with with_raas(config, ScriptedGenerator(), capacity=16, name="raas-a") as (
            df,
            client,
            _,
        ):
            trainer = Trainer(client)
            await trainer.drain(df, num_groups=2)
            return trainer, df.counters["collector_failures"]

    trainer, collector_failures = run(body())
    assert failures and collector_failures == 1
    assert_consumed_once(trainer.consumed)
    assert set(trainer.consumed) == all_ids(n)
