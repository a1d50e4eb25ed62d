"""astra.raas.versions and astra.raas.groups without a server: LoadWeights' rules (regression,
idempotency by request id, timeout, one-at-a-time) and group runs (results, failures,
oversize results, cancellation)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from astra.errors import AstraError, FailedPrecondition, Unavailable
from astra.raas.backend import GroupSpec, VersionSpec
from astra.raas.groups import GroupRunner
from astra.raas.results import ResultStore
from astra.raas.versions import WeightVersions
from astra.weights.deadline import DeadlineExceeded


def run(coro, timeout_s: float = 10.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


class Backend:
    engine, policy_ids, workflows = "fake", ("a", "b"), ("w",)

    def __init__(self, load_s: float = 0.0) -> None:
        self.load_s, self.loads, self.active = load_s, [], 0
        self.max_active = 0
        self.fail: Exception | None = None
        self.gate = asyncio.Event()

    async def load_weights(self, versions, address):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.load_s)
            self.loads.append(dict(versions))
            return 100
        finally:
            self.active -= 1

    async def generate(self, spec, versions):
        if self.fail is not None:
            raise self.fail
        await self.gate.wait()
        return ["x" * spec.num_samples, dict(versions)]


def book(backend: Backend, timeout_s: float = 5.0, initial=None) -> WeightVersions:
    return WeightVersions(
        backend, initial_versions=initial, timeout_s=timeout_s, counters=Counter()
    )


def test_versions_start_as_given_or_unknown():
    v = book(Backend(), initial={"a": 3})
    assert v.held == {"a": VersionSpec(3, "3"), "b": VersionSpec(0, "")}


def test_load_swaps_the_set_and_answers_retries_by_request_id():
    async def body():
        backend = Backend()
        v = book(backend)
        first = await v.load({"a": VersionSpec(1, "x1")}, "w:1", "r1")
        assert first.fetched_bytes == 100 and v.numbers == {"a": 1, "b": 0}
        again = await v.load({"a": VersionSpec(1, "x1")}, "w:2", "r1")  # another address
        assert again is first and len(backend.loads) == 1
        with pytest.raises(AstraError) as err:
            await v.load({"a": VersionSpec(2, "x2")}, "w:1", "r1")
        assert err.value.reason == "REQUEST_ID_REUSED"
        held = await v.load({"a": VersionSpec(1, "x1")}, "w:1", "r2")  # in service already
        assert held.fetched_bytes == 0 and len(backend.loads) == 1
        other = await v.load({"a": VersionSpec(1, "y1")}, "w:1", "r3")  # same counter, new id
        assert other.fetched_bytes == 100 and v.held["a"].version_id == "y1"

    run(body())


def test_an_older_version_is_refused_before_any_fetch():
    async def body():
        backend = Backend()
        v = book(backend, initial={"a": 5})
        with pytest.raises(FailedPrecondition) as err:
            await v.load({"a": VersionSpec(4, "4")}, "w", "r")
        assert err.value.reason == "VERSION_REGRESSION" and backend.loads == []
        assert "r" not in v.requests

    run(body())


def test_loads_run_one_at_a_time():
    async def body():
        backend = Backend(load_s=0.05)
        v = book(backend)
        await asyncio.gather(
            v.load({"a": VersionSpec(1, "1")}, "w", "r1"),
            v.load({"b": VersionSpec(1, "1")}, "w", "r2"),
        )
        assert backend.max_active == 1 and v.numbers == {"a": 1, "b": 1}

    run(body())


def test_a_load_past_its_deadline_keeps_the_versions():
    async def body():
        v = book(Backend(load_s=1.0), timeout_s=0.05)
        with pytest.raises(DeadlineExceeded) as err:
            await v.load({"a": VersionSpec(1, "1")}, "w", "r")
        assert err.value.reason == "LOAD_DEADLINE_EXCEEDED"
        assert v.numbers == {"a": 0, "b": 0} and v.counters["weight_load_timeouts"] == 1

    run(body())


def test_a_cancellation_inside_the_backend_answers_unavailable():
    async def body():
        backend = Backend()

        async def cancelled(versions, address):
            raise asyncio.CancelledError

        backend.load_weights = cancelled
        v = book(backend)
        with pytest.raises(Unavailable) as err:
            await v.load({"a": VersionSpec(1, "1")}, "w", "r")
        assert err.value.reason == "LOAD_CANCELLED" and v.numbers["a"] == 0

    run(body())


def test_swapped_takes_only_newer_versions():
    v = book(Backend(), initial={"a": 3})
    v.swapped({"a": VersionSpec(2, "2"), "b": VersionSpec(1, "z")})
    assert v.held == {"a": VersionSpec(3, "3"), "b": VersionSpec(1, "z")}


def runner(backend: Backend, max_result_bytes: int = 1000) -> GroupRunner:
    return GroupRunner(
        backend,
        ResultStore(8),
        encode=lambda spec, out: repr((spec.group_id, out)).encode(),
        encode_failure=lambda spec, code, msg: f"{spec.group_id}:{code}:{msg}".encode(),
        max_result_bytes=max_result_bytes,
        counters=Counter(),
    )


def spec(gid: str, n: int = 2) -> GroupSpec:
    return GroupSpec(gid, "w", ("a",), n, max_new_tokens=4)


def test_groups_run_with_the_versions_given_and_failures_are_results():
    async def body():
        backend = Backend()
        groups = runner(backend)
        assert groups.submit([spec("g1")], [], {"a": 7}) == ["g1"]
        assert groups.submit([spec("g1")], [], {"a": 8}) == ["g1"]  # idempotent
        backend.gate.set()
        out = await groups.store.collect(4, 1.0)
        assert out == [repr(("g1", ["xx", {"a": 7}])).encode()]
        backend.fail = ValueError("boom")
        groups.submit([spec("g2")], [], {})
        while groups.store.pending < 2:
            await asyncio.sleep(0.01)
        assert (await groups.store.collect(4, 0))[1] == b"g2:INTERNAL:ValueError: boom"
        assert groups.counters["groups_failed"] == 1 and not groups.tasks

    run(body())


def test_an_oversize_result_is_delivered_as_the_groups_failure():
    async def body():
        backend = Backend()
        backend.gate.set()
        groups = runner(backend, max_result_bytes=10)
        groups.submit([spec("g1")], [], {})
        [result] = await groups.store.collect(1, 1.0)
        assert result.startswith(b"g1:RESOURCE_EXHAUSTED:result of")
        assert groups.counters["results_too_large"] == 1

    run(body())


def test_cancelled_and_closed_groups_produce_nothing():
    async def body():
        groups = runner(Backend())
        groups.submit([spec("g1"), spec("g2")], [], {})
        assert groups.store.free_slots == 4
        assert groups.cancel(["g1", "nope"]) == 1
        await groups.close()
        assert groups.store.free_slots == 8 and groups.store.pending == 0
        assert all(t.cancelled() for t in groups.tasks.values())

    run(body())


def test_an_unavailable_engine_refuses_submits():
    groups = runner(Backend())
    groups.check_available()
    groups.unavailable = "its engine failed"
    with pytest.raises(Unavailable) as err:
        groups.check_available()
    assert err.value.reason == "ENGINE_UNAVAILABLE"
