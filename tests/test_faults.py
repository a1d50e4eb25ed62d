"""Fault tests with real processes and real signals: every group reaches the trainer once.

A trainer loop in the test fetches and acknowledges batches while RaaS processes and the
Dataflow process itself are SIGKILLed and replaced. The accounting at the end must show every
prompt group of the epoch exactly once.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from astra.clients.dataflow import DataflowClient
from tests.conftest import free_port, make_config
from tests.procs import start_dataflow, start_scripted_raas

pytestmark = pytest.mark.slow

NUM_PROMPTS = 24


@pytest.fixture
def big_dataset(tmp_path):
    import json

    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(NUM_PROMPTS)
        )
    )
    return path


def fault_config(dataset, tmp_path, port=0):
    return make_config(
        dataset,
        tmp_path / "state",
        port=port,
        pool={
            "heartbeat_interval_s": 0.2,
            "heartbeat_timeout_s": 1.0,
            "probe_interval_s": 0.1,
            "confirm_failures": 2,
            "collect_wait_s": 0.2,
            "call_timeout_s": 1.0,
        },
        leases={"group_lease_s": 20.0, "batch_lease_s": 20.0},
    )


class Trainer:
    """Fetches and acknowledges batches, remembering every group id it consumed."""

    def __init__(self, address: str) -> None:
        self.client = DataflowClient(address, timeout_s=3.0)
        self.consumed: list[str] = []
        self.n = 0

    async def step(self, num_groups: int = 2) -> bool:
        self.n += 1
        try:
            header, trajectories, _footer = await self.client.fetch_batch(
                "policy", num_groups, f"req-{self.n}", max_wait_s=0.5, timeout_s=3.0
            )
            await self.client.ack_batch(header.batch_id)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return False
            raise
        self.consumed.extend(sorted({t.group_id for t in trajectories}))
        return True

    async def run_until(self, total: int, deadline_s: float, num_groups: int = 2) -> None:
        end = time.monotonic() + deadline_s
        while len(self.consumed) < total and time.monotonic() < end:
            await self.step(num_groups)

    async def wait_status(self, done, timeout_s: float, poll_s: float):
        """Dataflow's status once `done(status)`, or the last one read when `timeout_s` is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = await self.client.get_status()
            if done(status):
                return status
            await asyncio.sleep(poll_s)
            if time.monotonic() >= deadline:
                return status

    async def __aenter__(self) -> Trainer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()


def run_then_close(coro, procs: list):
    """Runs the test body, then closes (SIGKILLs if need be) every process in `procs`."""
    try:
        return asyncio.run(coro)
    finally:
        for p in procs:
            p.close()


def expected_ids() -> set[str]:
    return {f"s/0/{i}" for i in range(NUM_PROMPTS)}


def assert_exactly_once(consumed: list[str]) -> None:
    assert len(consumed) == len(set(consumed)), "a group reached the trainer twice"
    assert set(consumed) == expected_ids(), sorted(expected_ids() - set(consumed))


def test_raas_sigkill_loses_and_duplicates_nothing(big_dataset, tmp_path):
    df = start_dataflow(fault_config(big_dataset, tmp_path), tmp_path)
    raas = [
        start_scripted_raas(df.address, tmp_path, f"raas-{i}", "--delay", "0.3", "--capacity", "8")
        for i in range(3)
    ]
    procs = [*raas, df]

    def dead(status) -> set[str]:
        return {i.instance_id for i in status.instances if i.state == 3}

    async def body():
        async with Trainer(df.address) as trainer:
            await trainer.run_until(2, 30)
            raas[0].kill()  # with groups in flight
            await trainer.run_until(8, 30)
            raas[1].kill()
            procs.append(start_scripted_raas(df.address, tmp_path, "raas-3", "--delay", "0.1"))
            await trainer.run_until(NUM_PROMPTS, 60)
            status = await trainer.wait_status(lambda s: {"raas-0", "raas-1"} <= dead(s), 15, 0.1)
        return trainer.consumed, status

    consumed, status = run_then_close(body(), procs)
    assert_exactly_once(consumed)
    assert {"raas-0", "raas-1"} <= dead(status)


def test_dataflow_sigkill_restart_keeps_state_and_exactly_once(big_dataset, tmp_path):
    port = free_port()
    config = fault_config(big_dataset, tmp_path, port=port)
    df = start_dataflow(config, tmp_path, "dataflow-a")
    raas = [
        start_scripted_raas(df.address, tmp_path, f"raas-{i}", "--delay", "0.2", "--capacity", "8")
        for i in range(2)
    ]
    procs = [*raas, df]

    def known(status) -> set[str]:
        return {i.instance_id for i in status.instances}

    async def body():
        nonlocal df
        async with Trainer(df.address) as trainer:
            await trainer.run_until(6, 30)
            # A batch fetched and not yet acknowledged when Dataflow dies.
            header, trajectories, _ = await trainer.client.fetch_batch(
                "policy", 2, "held", max_wait_s=5.0
            )
            before = await trainer.client.get_status()
            df.kill()
            df = start_dataflow(config, tmp_path, "dataflow-b")
            procs.append(df)
            again, again_trajs, _ = await trainer.client.fetch_batch(
                "policy", 2, "held", max_wait_s=5.0
            )
            assert again.batch_id == header.batch_id
            assert [t.trajectory_id for t in again_trajs] == [t.trajectory_id for t in trajectories]
            await trainer.client.ack_batch(again.batch_id)
            trainer.consumed.extend(sorted({t.group_id for t in trajectories}))
            after = await trainer.client.get_status()
            assert after.dataflow_id != before.dataflow_id
            assert after.streams[0].position >= before.streams[0].position
            assert after.counters["dispatched"] >= before.counters["dispatched"]
            await trainer.run_until(NUM_PROMPTS, 60)
            # The RaaS registered again by themselves.
            status = await trainer.wait_status(lambda s: {"raas-0", "raas-1"} <= known(s), 10, 0.2)
        return trainer.consumed, status

    consumed, status = run_then_close(body(), procs)
    assert_exactly_once(consumed)
    assert {"raas-0", "raas-1"} <= known(status)


def test_all_raas_dead_then_a_new_one_resumes_the_run(big_dataset, tmp_path):
    df = start_dataflow(fault_config(big_dataset, tmp_path), tmp_path)
    first = start_scripted_raas(df.address, tmp_path, "raas-a", "--delay", "0.2")
    procs = [first, df]

    async def body():
        async with Trainer(df.address) as trainer:
            await trainer.run_until(2, 30)
            first.signal(signal.SIGKILL)
            status = await trainer.wait_status(lambda s: s.pool_empty, 15, 0.1)
            assert status.pool_empty and "pool empty" in status.gate.reason
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while True:  # drain what is buffered, then the pool-empty answer
                    header, _, _ = await trainer.client.fetch_batch(
                        "policy", 2, f"drain-{time.monotonic()}", max_wait_s=0.3
                    )
                    await trainer.client.ack_batch(header.batch_id)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "pool empty" in info.value.details()
            procs.append(start_scripted_raas(df.address, tmp_path, "raas-b", "--delay", "0.05"))
            before = len(trainer.consumed)
            await trainer.run_until(before + 4, 30)
            assert len(trainer.consumed) >= before + 4

    run_then_close(body(), procs)


def test_epochs_folded_while_raas_and_dataflow_die_keep_exactly_once(big_dataset, tmp_path):
    """Four epochs with every complete epoch folded into a count as soon as it may be
    (storage.keep_done_epochs 0, looked for every 0.2 s): a RaaS SIGKILLed with groups in
    flight, then Dataflow SIGKILLed and restarted; every group of every epoch reaches the
    trainer exactly once, and the folded epochs stay done across the restart."""
    epochs = 4
    config = fault_config(big_dataset, tmp_path, port=free_port()).model_copy(
        update={"storage": fault_config(big_dataset, tmp_path).storage.model_copy(
            update={"keep_done_epochs": 0, "fold_interval_s": 0.2, "min_free_bytes": 0}
        )}
    )  # fmt: skip
    config.streams[0].dataset.num_epochs = epochs
    total = NUM_PROMPTS * epochs
    df = start_dataflow(config, tmp_path, "dataflow-a")
    raas = [
        start_scripted_raas(df.address, tmp_path, f"raas-{i}", "--delay", "0.05", "--capacity", "8")
        for i in range(2)
    ]
    procs = [*raas, df]

    async def body():
        nonlocal df
        async with Trainer(df.address) as trainer:
            await trainer.run_until(NUM_PROMPTS // 2, 30, num_groups=4)
            raas[0].kill()  # with groups in flight: dispatched again, its results never come
            procs.append(start_scripted_raas(df.address, tmp_path, "raas-2", "--delay", "0.05"))
            await trainer.run_until(NUM_PROMPTS * 2 + 4, 60, num_groups=4)
            folded = await trainer.wait_status(
                lambda s: s.counters["groups_folded"] >= NUM_PROMPTS, 10, 0.1
            )
            df.kill()
            df = start_dataflow(config, tmp_path, "dataflow-b")
            procs.append(df)
            await trainer.run_until(total, 90, num_groups=4)
            status = await trainer.wait_status(
                lambda s: s.counters["groups_folded"] >= total - NUM_PROMPTS, 10, 0.1
            )
        return trainer.consumed, folded, status

    consumed, folded, status = run_then_close(body(), procs)
    assert len(consumed) == len(set(consumed)), "a group reached the trainer twice"
    every = {f"s/{e}/{i}" for e in range(epochs) for i in range(NUM_PROMPTS)}
    assert set(consumed) == every, sorted(every - set(consumed))[:10]
    assert folded.counters["groups_folded"] >= NUM_PROMPTS  # epoch 0 at least, before the kill
    assert status.counters["groups_done"] == total
    assert status.counters["groups_folded"] >= total - NUM_PROMPTS
