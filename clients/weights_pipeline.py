"""A fetch's tensors staged off the event loop while the stream keeps being read.

Used by astra.clients.weights_stream's `Receiver`: chunk writes on one writer thread, each
completed tensor decoded, verified, fsynced and recorded on a small worker pool, acks as
soon as each is recorded. Never reads the stream itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from astra.errors import DataLoss
from astra.weights.tensor_files import INLINE_BYTES
from astra.weights.v1 import weight_service_pb2 as pb

MAX_QUEUED_BYTES = 64 << 20  # chunk bytes read but not yet written to the stage
FINISH_WORKERS = max(2, min(4, os.cpu_count() or 1))  # decode + fsync of completed tensors


def _small(incoming: Any) -> bool:
    """A tensor staged on the loop's thread: below INLINE_BYTES on the stream and at rest."""
    return max(incoming.size, incoming.encoded) < INLINE_BYTES


class FetchPipeline:
    """Stages a fetch's tensors off the event loop while the stream keeps being read.

    Chunk writes (pwrite + Adler-32) run in order on one writer thread, at
    most `MAX_QUEUED_BYTES` behind the reader; each completed tensor is then
    decoded, verified, fsynced and recorded on a worker pool, overlapping the
    next tensors, and acknowledged as soon as it is recorded (acks may come
    out of order). The first failure nacks its tensor, is kept in `error` and
    cancels the reading task, which raises it.
    """

    def __init__(self, call: Any) -> None:
        self.call = call
        self.error: BaseException | None = None
        self.refused = False  # a refusing TensorAck reached the stream
        self.loop = asyncio.get_running_loop()
        self.reader = asyncio.current_task()
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="fetch-write")
        self.workers = ThreadPoolExecutor(FINISH_WORKERS, thread_name_prefix="fetch-finish")
        self.queued: collections.deque[tuple[asyncio.Future[None], int]] = collections.deque()
        self.queued_bytes = 0
        self.last: dict[int, asyncio.Future[None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.opened: list[Any] = []
        self.ack_lock = asyncio.Lock()
        self.last_progress = time.monotonic()  # last message read or acknowledgement sent

    @property
    def busy(self) -> bool:
        """Work of the receiver's own in flight: the service may be waiting on it."""
        return bool(self.tasks) or bool(self.queued)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    async def begin(self, stage: Any, header: dict[str, Any], base: Any) -> Any:
        if max(header["size_bytes"], header["encoded_size_bytes"]) < INLINE_BYTES:
            incoming = stage.receive(header, base)
        else:
            incoming = await self.loop.run_in_executor(self.workers, stage.receive, header, base)
        self.opened.append(incoming)
        return incoming

    async def write(self, incoming: Any, offset: int, data: bytes) -> None:
        incoming.queue(offset, len(data))
        if _small(incoming):
            incoming.write(offset, data)
            return
        future = self.loop.run_in_executor(self.writer, incoming.write, offset, data)
        self.last[id(incoming)] = future
        self.queued.append((future, len(data)))
        self.queued_bytes += len(data)
        while self.queued and (self.queued_bytes > MAX_QUEUED_BYTES or self.queued[0][0].done()):
            oldest, n = self.queued.popleft()
            self.queued_bytes -= n
            await oldest

    def finish(self, incoming: Any) -> None:
        # A small tensor is finished on the loop too, where finishing syncs nothing to disk.
        inline = _small(incoming) and not incoming.syncs
        last = self.last.pop(id(incoming), None)
        task = asyncio.create_task(self._finish(incoming, last, inline))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _finish(
        self, incoming: Any, last: asyncio.Future[None] | None, inline: bool = False
    ) -> None:
        try:
            if last is not None:
                await last
            if inline:
                incoming.finish()
            else:
                await self.loop.run_in_executor(self.workers, incoming.finish)
        except asyncio.CancelledError:
            raise
        except DataLoss as exc:
            nack = pb.TensorAck(name=incoming.name)
            nack.status.code, nack.status.message = 15, exc.message  # DATA_LOSS
            with contextlib.suppress(Exception):
                await self._send(nack)
                self.refused = True
            # Once refused, the read goes on: the service acts on the refusal, then ends the
            # stream with DATA_LOSS. Cancelling the read would cancel the call at once.
            self._fail(exc, hang_up=not self.refused)
            return
        except BaseException as exc:  # raised by the reading task
            self._fail(exc)
            return
        try:
            await self._send(pb.TensorAck(name=incoming.name))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    async def _send(self, ack: pb.TensorAck) -> None:
        async with self.ack_lock:
            await self.call.write(pb.FetchVersionRequest(ack=ack))
        self.last_progress = time.monotonic()

    def _fail(self, exc: BaseException, hang_up: bool = True) -> None:
        if self.error is None:
            self.error = exc
            if hang_up and self.reader is not None:
                self.reader.cancel()

    async def drain(self) -> None:
        """Until every finished tensor is recorded and acknowledged; raises the first failure."""
        while self.tasks:
            await asyncio.gather(*self.tasks)
        while self.queued:
            await self.queued.popleft()[0]
        self.check()

    async def close(self) -> None:
        """Stops what is in flight and drops every unfinished tensor."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for future, _ in self.queued:
            future.cancel()

        def stop() -> None:
            self.writer.shutdown(wait=True, cancel_futures=True)
            self.workers.shutdown(wait=True, cancel_futures=True)
            for incoming in self.opened:
                incoming.abort()

        # Waited for even through a cancellation: the workers may still read the base.
        stopping = asyncio.ensure_future(asyncio.to_thread(stop))
        cancelled = False
        while not stopping.done():
            try:
                await asyncio.shield(stopping)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
