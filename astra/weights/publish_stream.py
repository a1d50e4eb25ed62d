"""The body of a publish stream, after its header: parts in, acknowledgements out.

`receive_parts` reads the parts of a PublishVersion stream (tensor headers,
their chunks in order, files, the commit) as plain objects, writes each
tensor through its TensorSink (astra.weights.publish_sink) on worker
threads, and yields `TensorAcked` once a tensor's shard is durable (synced in
the background while the stream reads on) and `Committed` at the end.
xor+zstd tensors are decoded off the stream, up to MAX_DECODING at once, and
acknowledged in order. Any failure is raised as a domain error (the caller
sends it in band and as the status); a stream that ends before its commit
is PUBLISH_INCOMPLETE and its verified tensors stay staged for a resume.
Never touches gRPC or protobuf: the servicer converts messages to parts and
replies to messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from astra.errors import InvalidArgument, invalid_field
from astra.weights.publish_sink import TensorSink
from astra.weights.store_publish import MAX_FILE_BYTES, PublishSession

MAX_DECODING = 2
MAX_CHUNK_BYTES = 8 << 20  # TensorChunk.data (weight_service.proto)


@dataclass(frozen=True, slots=True)
class TensorPart:
    """A TensorHeader. `layout()` gives (dtype, shape, frame length or None for raw bytes)
    and raises the header's errors; it is called when the stream reaches the part."""

    name: str
    adler32: str
    size_bytes: int
    layout: Callable[[], tuple[str, tuple[int, ...], int | None]]


@dataclass(frozen=True, slots=True)
class ChunkPart:
    offset: int
    data: Any  # bytes or a memoryview into the received message


@dataclass(frozen=True, slots=True)
class FilePart:
    name: str
    content: bytes
    same_as_base: str = ""  # the SHA-256 of the base's file of this name, the content left out


@dataclass(frozen=True, slots=True)
class CommitPart:
    num_tensors: int


@dataclass(frozen=True, slots=True)
class OtherPart:
    """A second header, or a message with no part."""


Part = TensorPart | ChunkPart | FilePart | CommitPart | OtherPart


@dataclass(frozen=True, slots=True)
class TensorAcked:
    name: str


@dataclass(frozen=True, slots=True)
class Committed:
    record: Any  # astra.weights.records.VersionRecord
    already_existed: bool


async def receive_parts(
    session: PublishSession, num_tensors: int, parts: AsyncIterator[Part]
) -> AsyncIterator[TensorAcked | Committed]:
    """The acknowledgements of a publish whose header announced `num_tensors` tensors."""
    sink: TensorSink | None = None
    # Verified tensors whose shard is still being synced: each is acknowledged once durable
    # (an acknowledged tensor survives a crash), while the stream goes on reading.
    syncing: list[TensorSink] = []
    # xor+zstd tensors being decoded and verified off the stream (up to MAX_DECODING at once,
    # so the next tensor's frame is read and decoded while one still hashes); acknowledged in order.
    decoding: dict[TensorSink, asyncio.Future[Any]] = {}

    def ready(s: TensorSink) -> bool:
        busy = decoding.get(s)
        if busy is not None and not busy.done():
            return False
        return s.synced is None or s.synced.done()

    def check_decoding() -> None:
        """Raises the first failure of a tensor still being decoded (the publish is refused)."""
        for busy in decoding.values():
            if busy.done() and (failure := busy.exception()) is not None:
                raise failure

    def durable_acks() -> list[TensorAcked]:
        check_decoding()
        acks = []
        while syncing and ready(syncing[0]):
            done = syncing.pop(0)
            busy = decoding.pop(done, None)
            if busy is not None:
                busy.result()
            if done.synced is not None:
                done.synced.result()
            acks.append(TensorAcked(done.name))
        return acks

    async def reads() -> AsyncGenerator[Part | None, None]:
        """The parts, interleaved with None whenever the oldest syncing tensor became durable."""
        it = aiter(parts)
        pending = asyncio.ensure_future(anext(it))
        try:
            while True:
                waits: set[asyncio.Future[Any]] = {pending}
                waits |= {busy for busy in decoding.values() if not busy.done()}
                if syncing and syncing[0].synced is not None:
                    waits.add(asyncio.wrap_future(syncing[0].synced))
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if pending not in done:
                    yield None
                    continue
                try:
                    part = pending.result()
                except StopAsyncIteration:
                    return
                pending = asyncio.ensure_future(anext(it))
                yield part
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            elif not pending.cancelled():
                pending.exception()  # retrieved: the end of the stream (StopAsyncIteration)

    try:
        async with contextlib.aclosing(reads()) as incoming:
            async for part in incoming:
                if part is None:  # a synced tensor: acknowledge it
                    for ack in durable_acks():
                        yield ack
                    continue
                if not isinstance(part, ChunkPart) and sink is not None:
                    raise InvalidArgument(
                        f"{sink.name}: {sink.received} of {sink.expected_bytes} bytes before the next part",
                        reason="TRUNCATED_TENSOR",
                        metadata={"tensor": sink.name},
                    )
                if isinstance(part, TensorPart):
                    dtype, shape, encoded = part.layout()
                    sink = session.begin_tensor(
                        part.name, dtype, shape, part.adler32, encoded=encoded
                    )
                    if part.size_bytes != sink.size:
                        raise invalid_field(
                            "tensor.size_bytes",
                            f"{sink.size} for {dtype}{list(shape)}",
                            reason="INVALID_TENSOR",
                        )
                elif isinstance(part, ChunkPart):
                    if sink is None:
                        raise invalid_field(
                            "chunk", "no TensorHeader before it", reason="UNEXPECTED_CHUNK"
                        )
                    if len(part.data) > MAX_CHUNK_BYTES:
                        raise invalid_field(
                            "chunk.data",
                            f"{len(part.data)} bytes, at most {MAX_CHUNK_BYTES}",
                            reason="CHUNK_TOO_LARGE",
                        )
                    if sink.small:
                        sink.write(part.offset, part.data)
                    else:
                        await asyncio.to_thread(sink.write, part.offset, part.data)
                elif isinstance(part, FilePart) and part.same_as_base:
                    await asyncio.to_thread(session.add_base_file, part.name, part.same_as_base)
                elif isinstance(part, FilePart):
                    if len(part.content) > MAX_FILE_BYTES:
                        raise invalid_field(
                            "file.content",
                            f"{part.name!r}: {len(part.content)} bytes, at most {MAX_FILE_BYTES}",
                            reason="INVALID_FILE",
                        )
                    session.add_file(part.name, part.content)
                elif isinstance(part, CommitPart):
                    if part.num_tensors != num_tensors:
                        raise invalid_field(
                            "commit.num_tensors",
                            f"header said {num_tensors}",
                            reason="PUBLISH_INCOMPLETE",
                        )
                    for busy in list(decoding.values()):
                        await busy
                    for waiting in syncing:
                        if waiting.synced is not None:
                            await asyncio.wrap_future(waiting.synced)
                    for ack in durable_acks():
                        yield ack
                    record, existed = await asyncio.to_thread(session.commit, part.num_tensors)
                    yield Committed(record, existed)
                    return
                else:
                    raise invalid_field("header", "sent twice", reason="UNEXPECTED_HEADER")
                if sink is not None and sink.complete:
                    done, sink = sink, None
                    if done.small:
                        done.finish()  # no decode worth overlapping with the next tensor's
                    elif done.encoded is None:
                        await asyncio.to_thread(done.finish)
                    else:
                        while sum(not b.done() for b in decoding.values()) >= MAX_DECODING:
                            running = {b for b in decoding.values() if not b.done()}
                            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                        check_decoding()
                        decoding[done] = asyncio.ensure_future(asyncio.to_thread(done.finish))
                    syncing.append(done)
                for ack in durable_acks():
                    yield ack
            await settle(list(decoding.values()))
            check_decoding()  # a tensor that failed says more than the missing commit
            raise InvalidArgument(
                "the stream ended before PublishCommit; verified tensors stay staged",
                reason="PUBLISH_INCOMPLETE",
            )
    finally:
        if sink is not None:
            sink.abort()
        # Decoders write into the stage and its RAM copy: they end before the session closes.
        await settle(list(decoding.values()))


async def settle(futures: list[asyncio.Future[Any]]) -> None:
    """Waits for every future, through cancellations too; their results are not wanted."""
    if not futures:
        return
    everything = asyncio.gather(*futures, return_exceptions=True)
    cancelled = False
    while not everything.done():
        try:
            await asyncio.shield(everything)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
