"""Bounded waits keep every cancellation (astra.waits), Dataflow's stop ends however its loops
were woken, and a stop that hangs ends the process anyway (astra.stop_deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
import time

import pytest

from astra.dataflow import coordinator
from astra.waits import cancel_and_wait, wait_set, within
from tests.conftest import running_dataflow


def test_wait_set_says_whether_the_event_came():
    async def body() -> tuple[bool, bool, float]:
        ev = asyncio.Event()
        t0 = time.monotonic()
        missed = await wait_set(ev, 0.05)
        waited = time.monotonic() - t0
        asyncio.get_running_loop().call_later(0.01, ev.set)
        return missed, await wait_set(ev, 5.0), waited

    missed, came, waited = asyncio.run(body())
    assert (missed, came) == (False, True) and waited >= 0.04


def test_within_returns_the_result_or_times_out():
    async def body() -> tuple[int, bool]:
        async def slow() -> int:
            await asyncio.sleep(5)
            return 1

        async def quick() -> int:
            return 2

        try:
            await within(slow(), 0.05)
            timed_out = False
        except TimeoutError:
            timed_out = True
        return await within(quick(), 1.0), timed_out

    assert asyncio.run(body()) == (2, True)


async def _cancel_in_the_turn_the_event_is_set(wait) -> str:
    """A loop like Dataflow's dispatch: woken, then cancelled before it runs again."""
    ev = asyncio.Event()

    async def loop() -> None:
        while True:
            await wait(ev)
            ev.clear()
            await asyncio.sleep(0.001)

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.05)
    ev.set()  # its wait is done; the task is not resumed yet
    task.cancel()  # the stop, in the same turn
    done, _ = await asyncio.wait({task}, timeout=2.0)
    if not done:
        task.cancel()
        return "ran on"
    return "cancelled" if task.cancelled() else "ended"


@pytest.mark.parametrize(
    "wait",
    [lambda ev: wait_set(ev, 0.5), lambda ev: within(ev.wait(), 0.5)],
    ids=["wait_set", "within"],
)
def test_a_cancel_in_the_turn_the_wait_ends_is_kept(wait):
    """What asyncio.wait_for loses on Python 3.11 (and Dataflow's stop waited forever on)."""
    assert asyncio.run(_cancel_in_the_turn_the_event_is_set(wait)) == "cancelled"


def test_dataflow_stops_even_when_a_loop_outlives_its_cancel(config, monkeypatch, caplog):
    """A loop that a lost cancellation left running (what Python 3.11's wait_for did to the
    dispatch loop when the supervisor died): the stop still ends, naming it."""
    monkeypatch.setattr(coordinator, "STOP_TASKS_S", 0.5)

    released = asyncio.Event()

    async def deaf() -> None:
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)

    async def body() -> float:
        async with running_dataflow(config) as (_, df, _):
            await asyncio.sleep(0.2)
            stray = asyncio.create_task(deaf(), name="deaf-loop")
            df._tasks.append(stray)
            await asyncio.sleep(0.05)  # it runs (a task cancelled before its first step ends)
            df.wake()
            t0 = time.monotonic()
            await df.stop()
            took = time.monotonic() - t0
            assert all(t.done() for t in df._tasks if t is not stray)
            released.set()
            await stray
            df._tasks.remove(stray)
        return took

    took = asyncio.run(body())
    assert 0.4 < took < 3.0
    assert any("task deaf-loop still running" in r.getMessage() for r in caplog.records)


HUNG_SERVER = textwrap.dedent(
    """
    import asyncio, os, signal
    from astra.logs import configure
    from astra.servers.runtime import GrpcServer, serve_until_signal

    configure("info")

    async def main():
        server = GrpcServer("127.0.0.1", 0, grace_s=0.1)
        server.add_service(lambda servicer, s: None, None, "astra.test.v1.HungService")
        await server.start()

        async def hangs():
            await asyncio.Event().wait()  # an on_stop that never returns

        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        await serve_until_signal(server, on_stop=hangs, deadline_s=1.0)

    asyncio.run(main())
    """
)


def test_a_stop_that_hangs_ends_the_process_with_its_stacks():
    proc = subprocess.run(
        [sys.executable, "-c", HUNG_SERVER], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 70, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    hung = [line for line in lines if "HungService: the stop did not finish within 1s" in line]
    assert len(hung) == 1 and "CRITICAL" in hung[0] and hung[0].endswith("stack below")
    assert any("Current thread" in line or "Thread 0x" in line for line in lines), proc.stderr


async def _slow_to_stop() -> None:
    try:
        await asyncio.sleep(60)
    finally:
        await asyncio.sleep(0.3)  # its own clean-up, after the cancel


def test_cancel_and_wait_keeps_the_callers_own_cancel():
    """The caller cancelled (a bound from outside) while the task it cancelled cleans up."""

    async def body() -> tuple[str, str]:
        async def stops_it(task) -> str:
            await cancel_and_wait(task)
            return "went on"

        quiet = asyncio.create_task(_slow_to_stop())
        await asyncio.sleep(0.01)
        alone = await stops_it(quiet)
        sub = asyncio.create_task(_slow_to_stop())
        await asyncio.sleep(0.01)
        caller = asyncio.create_task(stops_it(sub))
        await asyncio.sleep(0.1)
        caller.cancel()
        try:
            outcome = await caller
        except asyncio.CancelledError:
            outcome = "cancelled"
        return alone, outcome

    assert asyncio.run(body()) == ("went on", "cancelled")


def test_cancel_and_wait_in_a_finally_of_a_cancelled_task_goes_on():
    """Clean-up after the caller's own cancel: each task it stops is stopped, none skipped."""

    async def body() -> list[bool]:
        subs = [asyncio.create_task(_slow_to_stop()) for _ in range(3)]

        async def owner() -> None:
            try:
                await asyncio.sleep(60)
            finally:
                for t in subs:
                    await cancel_and_wait(t)

        task = asyncio.create_task(owner())
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return [t.cancelled() for t in subs]

    assert asyncio.run(body()) == [True, True, True]


def test_cancel_and_wait_raises_what_the_task_failed_with():
    async def body() -> None:
        async def fails() -> None:
            raise ValueError("broken")

        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        await cancel_and_wait(task)

    with pytest.raises(ValueError, match="broken"):
        asyncio.run(body())
