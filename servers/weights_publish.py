"""The PublishVersion stream: header -> accepted, tensors -> acks, commit -> committed.

Each tensor's chunks must arrive in order and are checked (offsets, sizes)
and hashed as they arrive, on a worker thread so the event loop keeps
serving fetches; a tensor whose bytes do not match its Adler-32 fails the
stream with DATA_LOSS naming it. Verified tensors stay staged, so the client
resumes by opening a new stream; a tensor is acknowledged once its shard is
durable (synced in the background while the stream reads on). A failure after PublishAccepted is also
sent in band, as a TensorAck carrying the error's status, so the client
stops sending. Every decision is the store's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from google.rpc import status_pb2

from astra.errors import AstraError, InvalidArgument, invalid_field
from astra.servers.convert import check_id
from astra.servers.errors import status_for
from astra.servers.weights_convert import (
    MAX_METADATA,
    MAX_METADATA_VALUE,
    MAX_TENSORS,
    check_publish_tensor,
    identity,
    version_info,
)
from astra.weights.publish_sink import TensorSink
from astra.weights.store import Store
from astra.weights.store_publish import MAX_FILE_BYTES, PublishSession
from astra.weights.v1 import weight_service_pb2 as pb

DOMAIN = "astra.weights.v1"
DRAIN_S = 5.0
MAX_DECODING = 2
MAX_CHUNK_BYTES = 8 << 20  # TensorChunk.data (weight_service.proto)


async def first_message(requests: AsyncIterator[Any], timeout_s: float) -> Any | None:
    """The stream's first message, None if it ends first; bounded by timeout_s."""
    try:
        return await asyncio.wait_for(anext(requests), timeout_s)
    except StopAsyncIteration:
        return None
    except TimeoutError as exc:
        raise InvalidArgument("no first message in time", reason="STREAM_IDLE") from exc


def _check_header(h: pb.PublishHeader) -> None:
    check_id(h.policy_id, "header.policy_id")
    identity(h.version_id, "header.version_id")
    identity(h.base_version_id, "header.base_version_id", required=False)
    if h.version < 0:
        raise invalid_field("header.version", "must be >= 0")
    if not 0 <= h.num_tensors <= MAX_TENSORS:
        raise invalid_field("header.num_tensors", f"must be 0-{MAX_TENSORS}")
    if len(h.metadata) > MAX_METADATA:
        raise invalid_field("header.metadata", f"more than {MAX_METADATA} entries")
    for key, value in h.metadata.items():
        check_id(key, "header.metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise invalid_field(
                f"header.metadata[{key}]", f"longer than {MAX_METADATA_VALUE} characters"
            )


def accepted(session: PublishSession) -> pb.PublishAccepted:
    """What an earlier attempt staged: names, and what the client compares before it skips."""
    out = pb.PublishAccepted(held_tensors=session.held)
    for name, rec in session.held_records():
        out.held.add(
            name=name, dtype=rec.dtype, shape=list(rec.shape), adler32=rec.adler32,
            size_bytes=rec.size_bytes,
        )  # fmt: skip
    return out


def refusal(exc: AstraError) -> pb.PublishVersionResponse:
    """The in-band form of a failure: a TensorAck whose status is the error (details included)."""
    raw = dict(status_for(exc, DOMAIN).trailing_metadata)["grpc-status-details-bin"]
    ack = pb.TensorAck(name=exc.metadata.get("tensor", ""))
    ack.status.CopyFrom(status_pb2.Status.FromString(raw))
    return pb.PublishVersionResponse(tensor_ack=ack)


async def drain(requests: AsyncIterator[Any], timeout_s: float) -> None:
    """Reads what the client still sends, so it learns of the failure before the status.

    grpc.aio replaces a server's status with INTERNAL when a client write races
    the end of the call (grpc/grpc#36066); a client that sees the refusal in
    band stops writing and half-closes, and then gets the real status.
    """
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            async for _ in requests:
                pass


async def publish_stream(
    store: Store, requests: AsyncIterator[pb.PublishVersionRequest], first_timeout_s: float
) -> AsyncIterator[pb.PublishVersionResponse]:
    first = await first_message(requests, first_timeout_s)
    if first is None or first.WhichOneof("part") != "header":
        raise invalid_field(
            "header", "the first message must be a PublishHeader", reason="PUBLISH_HEADER_REQUIRED"
        )
    h = first.header
    _check_header(h)
    session = await asyncio.to_thread(
        store.begin_publish,
        h.policy_id,
        h.version_id,
        h.version,
        dict(h.metadata),
        delta_base=h.base_version_id,
        restart=h.restart,
    )
    try:
        yield pb.PublishVersionResponse(accepted=accepted(session))
        try:
            async for resp in _receive(store, session, h, requests):
                yield resp
        except AstraError as exc:
            yield refusal(exc)
            await drain(requests, DRAIN_S)
            raise
    finally:
        session.close()


async def _receive(
    store: Store,
    session: PublishSession,
    h: pb.PublishHeader,
    requests: AsyncIterator[pb.PublishVersionRequest],
) -> AsyncIterator[pb.PublishVersionResponse]:
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
            if busy.done() and busy.exception() is not None:
                raise busy.exception()

    def durable_acks() -> list[pb.PublishVersionResponse]:
        check_decoding()
        acks = []
        while syncing and ready(syncing[0]):
            done = syncing.pop(0)
            busy = decoding.pop(done, None)
            if busy is not None:
                busy.result()
            if done.synced is not None:
                done.synced.result()
            ack = pb.TensorAck(name=done.name)
            ack.status.code = 0
            acks.append(pb.PublishVersionResponse(tensor_ack=ack))
        return acks

    async def reads() -> AsyncIterator[Any]:
        """The requests, interleaved with None whenever the oldest syncing tensor became durable."""
        it = aiter(requests)
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
                    req = pending.result()
                except StopAsyncIteration:
                    return
                pending = asyncio.ensure_future(anext(it))
                yield req
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            elif not pending.cancelled():
                pending.exception()  # retrieved: the end of the stream (StopAsyncIteration)

    try:
        async with contextlib.aclosing(reads()) as incoming:
            async for req in incoming:
                if req is None:  # a synced tensor: acknowledge it
                    for ack in durable_acks():
                        yield ack
                    continue
                part = req.WhichOneof("part")
                if part != "chunk" and sink is not None:
                    raise InvalidArgument(
                        f"{sink.name}: {sink.received} of {sink.expected_bytes} bytes before the next part",
                        reason="TRUNCATED_TENSOR",
                        metadata={"tensor": sink.name},
                    )
                if part == "tensor":
                    dtype, shape, encoded = check_publish_tensor(req.tensor, h.base_version_id)
                    sink = session.begin_tensor(
                        req.tensor.name, dtype, shape, req.tensor.adler32, encoded=encoded
                    )
                    if req.tensor.size_bytes != sink.size:
                        raise invalid_field(
                            "tensor.size_bytes",
                            f"{sink.size} for {dtype}{list(shape)}",
                            reason="INVALID_TENSOR",
                        )
                elif part == "chunk":
                    if sink is None:
                        raise invalid_field(
                            "chunk", "no TensorHeader before it", reason="UNEXPECTED_CHUNK"
                        )
                    if len(req.chunk.data) > MAX_CHUNK_BYTES:
                        raise invalid_field(
                            "chunk.data",
                            f"{len(req.chunk.data)} bytes, at most {MAX_CHUNK_BYTES}",
                            reason="CHUNK_TOO_LARGE",
                        )
                    await asyncio.to_thread(sink.write, req.chunk.offset, req.chunk.data)
                elif part == "file":
                    if len(req.file.content) > MAX_FILE_BYTES:
                        raise invalid_field(
                            "file.content",
                            f"{req.file.name!r}: {len(req.file.content)} bytes, at most "
                            f"{MAX_FILE_BYTES}",
                            reason="INVALID_FILE",
                        )
                    session.add_file(req.file.name, req.file.content)
                elif part == "commit":
                    if req.commit.num_tensors != h.num_tensors:
                        raise invalid_field(
                            "commit.num_tensors",
                            f"header said {h.num_tensors}",
                            reason="PUBLISH_INCOMPLETE",
                        )
                    for busy in list(decoding.values()):
                        await busy
                    for waiting in syncing:
                        if waiting.synced is not None:
                            await asyncio.wrap_future(waiting.synced)
                    for ack in durable_acks():
                        yield ack
                    record, existed = await asyncio.to_thread(
                        session.commit, req.commit.num_tensors
                    )
                    yield pb.PublishVersionResponse(
                        committed=pb.PublishCommitted(
                            version=version_info(record, record is store.chain(h.policy_id).head),
                            already_existed=existed,
                        )
                    )
                    return
                else:
                    raise invalid_field("header", "sent twice", reason="UNEXPECTED_HEADER")
                if sink is not None and sink.complete:
                    done, sink = sink, None
                    if done.encoded is None:
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
