"""Bounded waits that never lose a cancellation: what the code uses instead of
`asyncio.wait_for` (which ruff bans here, see pyproject.toml).

On Python 3.11, `asyncio.wait_for(aw, t)` returns the result when `aw` finished in the
same turn of the event loop as the caller was cancelled: the cancellation is gone, and a
`while True` loop around it runs on after its task was told to stop. Dataflow's dispatch
loop did exactly that on a stop (an instance failing woke it in the turn the stop cancelled
it), and Dataflow never exited. Python 3.12 rewrote `wait_for` on `asyncio.timeout`, which
counts cancellations; these helpers use it on every version, so a cancel always ends the
wait with CancelledError, and only the timeout's own expiry becomes TimeoutError.

The awaited work runs in the calling task (not in a task of its own, as with `wait_for`):
on the timeout it is cancelled there, as `wait_for` cancels its inner task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """`await aw`, or TimeoutError after `timeout_s` seconds (None: no bound)."""
    async with asyncio.timeout(timeout_s):
        return await aw


async def wait_set(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Waits for `event` at most `timeout_s` seconds; whether it is set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancels `task` and waits until it has ended; raises what it failed with, if not its
    cancellation. A cancellation of the caller itself while it waits goes on up: the idiom
    `task.cancel(); with suppress(CancelledError): await task` swallows that one too, and a
    stop bounded from outside (`within`) would then not end at its bound."""
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0  # in a finally: already > 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > before:
            raise
