"""Callbacks from the engine's worker thread into an asyncio loop: a request's result settling
its future (`deliverer`), and each token told as it is sampled (`teller`). Both go through the
loop's own queue (`call_soon_threadsafe`, FIFO), so a request's tokens arrive before its
result; a closed loop is ignored (nobody waits). Knows nothing of models or scheduling.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


def teller(loop: asyncio.AbstractEventLoop, on_token: Any) -> Any:
    """A thread-safe callback calling `on_token` on its loop, in the order tokens come; all of
    a request's tokens reach it before its result does (the same loop queue, FIFO)."""

    def tell(token: int) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody listens
            loop.call_soon_threadsafe(on_token, token)

    return tell


def deliverer(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any]) -> Any:
    """A thread-safe callback settling `fut` on its own loop (ignored once cancelled)."""

    def settle(outcome: Any) -> None:
        if fut.done():
            return
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    def deliver(outcome: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    return deliver
