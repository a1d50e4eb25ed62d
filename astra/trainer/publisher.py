"""Streams each new version to the WeightService in the background, then announces it.

The training step hands over a host copy (CPU tensors with their own
memory, so later optimiser steps cannot tear it) and waits only while
`max_pending` copies are already queued. One worker publishes the queue in
version order and announces each version to Dataflow once the WeightService
holds it, so Dataflow never points rollouts at a version that is not there.
A service that is down (UNAVAILABLE) is waited out with backoff; any other
failure is fatal and re-raised by the next `submit` or `drain`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from astra.engine.torch_weights import DTYPE_NAMES
from astra.trainer.sources import WeightSink, is_retryable
from astra.waits import cancel_and_wait

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 5.0


def raw_view(state: dict[str, Tensor]) -> dict[str, tuple[str, tuple[int, ...], memoryview]]:
    """(safetensors dtype, shape, bytes view) per tensor, sharing the tensors' memory."""
    out = {}
    for name, t in state.items():
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        out[name] = (DTYPE_NAMES[t.dtype], tuple(t.shape), memoryview(flat.numpy()))
    return out


@dataclass
class PublisherStats:
    published: int = 0
    announced: int = 0
    last_published: int = -1
    last_announced: int = -1
    retries: int = 0
    bytes_published: int = 0
    publish_s: float = 0.0
    blocked_s: float = 0.0
    errors: list[str] = field(default_factory=list)


class Publisher:
    """Background, in-order publish + announce of host copies."""

    def __init__(
        self,
        sink: WeightSink | None,
        announce: Callable[[int, str], Awaitable[None]] | None,
        *,
        max_pending: int = 2,
    ) -> None:
        self.sink, self.announce = sink, announce
        self.stats = PublisherStats()
        self._queue: asyncio.Queue[tuple[int, str, dict[str, Tensor]]] = asyncio.Queue(max_pending)
        self._error: BaseException | None = None
        self._worker: asyncio.Task[None] | None = None
        self.last_submitted = -1  # the newest version queued
        self._handled = -1  # the newest version the worker is done with (announced or not)
        self._progress = asyncio.Event()  # set whenever the worker finishes a version

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publishing failed: {self._error}") from self._error

    async def submit(self, version: int, state: dict[str, Tensor], identity: str = "") -> float:
        """Queues a version; returns the seconds spent waiting for room in the queue."""
        self._check()
        if self._worker is None:
            self._worker = asyncio.create_task(self._run())
        start = time.perf_counter()
        put = asyncio.ensure_future(self._queue.put((version, identity or str(version), state)))
        # The worker may die (a publish that cannot be retried) while the queue is full:
        # nothing would ever make room, so the step waits for either.
        await asyncio.wait({put, self._worker}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            await cancel_and_wait(put)
            self._check()
            raise RuntimeError("publishing stopped")  # the worker ended without an error
        blocked = time.perf_counter() - start
        self.stats.blocked_s += blocked
        self.last_submitted = max(self.last_submitted, version)
        return blocked

    async def drain(self) -> None:
        """Waits until every queued version is published and announced."""
        if self._worker is not None:
            join = asyncio.create_task(self._queue.join())
            await asyncio.wait({join, self._worker}, return_when=asyncio.FIRST_COMPLETED)
            join.cancel()
        self._check()

    async def wait_handled(self, version: int) -> None:
        """Until every version up to `version` that was queued is published and announced
        (a version never queued here, such as the one a resumed trainer starts from, is not
        waited for); raises the worker's failure."""
        target = min(version, self.last_submitted)
        while self._handled < target:
            self._check()  # the worker's failure, if it died of one
            if self._worker is None or self._worker.done():
                raise RuntimeError("publishing stopped")
            self._progress.clear()
            waiter = asyncio.ensure_future(self._progress.wait())
            await asyncio.wait({waiter, self._worker}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        self._check()

    async def close(self) -> None:
        if self._worker is not None:
            await cancel_and_wait(self._worker)

    async def _retrying(self, what: str, call: Callable[..., Awaitable[None]], *args: Any) -> None:
        backoff = 0.1
        while True:
            try:
                await call(*args)
                return
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                self.stats.retries += 1
                log.warning("%s: %s; retrying in %.1fs", what, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _run(self) -> None:
        while True:
            version, identity, state = await self._queue.get()
            try:
                start = time.perf_counter()
                if self.sink is not None:
                    tensors = raw_view(state)
                    await self._retrying(
                        f"publish {identity}", self.sink.publish, version, identity, tensors
                    )
                    self.stats.published += 1
                    self.stats.last_published = version
                    self.stats.bytes_published += sum(v[2].nbytes for v in tensors.values())
                self.stats.publish_s += time.perf_counter() - start
                if self.announce is not None and self.sink is not None:
                    await self._retrying(f"announce {version}", self.announce, version, identity)
                    self.stats.announced += 1
                    self.stats.last_announced = version
            except Exception as exc:
                log.error("version %d: %s", version, exc)
                self.stats.errors.append(f"{version}: {exc}")
                self._error = exc
                return
            finally:
                self._handled = max(self._handled, version)
                self._progress.set()
                self._queue.task_done()
