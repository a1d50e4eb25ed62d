"""The PublishVersion stream: header -> accepted, tensors -> acks, commit -> committed.

Here: the header is checked and the store's publish session opened
(PublishAccepted says what an earlier attempt staged); the other messages
become parts for astra.weights.publish_stream, which checks, hashes and
stages each tensor (its chunks in order) and says when one is durable, and
its replies become TensorAcks and PublishCommitted. A tensor whose bytes do
not match its Adler-32 fails the stream with DATA_LOSS naming it. A failure
after PublishAccepted is also sent in band, as a TensorAck carrying the
error's status, and the stream is drained so the client stops sending and
gets the real status. Every decision is the store's or publish_stream's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

from google.rpc import status_pb2

from astra.errors import AstraError, InvalidArgument, invalid_field
from astra.servers.errors import status_for
from astra.servers.weights_convert import (
    check_publish_header,
    check_publish_tensor,
    publish_accepted,
    version_info,
)
from astra.waits import within
from astra.weights.publish_stream import (
    ChunkPart,
    CommitPart,
    FilePart,
    OtherPart,
    Part,
    TensorAcked,
    TensorPart,
    receive_parts,
)
from astra.weights.store import Store
from astra.weights.v1 import weight_service_pb2 as pb

DOMAIN = "astra.weights.v1"
DRAIN_S = 5.0


async def first_message(requests: AsyncIterator[Any], timeout_s: float) -> Any | None:
    """The stream's first message, None if it ends first; bounded by timeout_s."""
    try:
        return await within(anext(requests), timeout_s)
    except StopAsyncIteration:
        return None
    except TimeoutError as exc:
        raise InvalidArgument("no first message in time", reason="STREAM_IDLE") from exc


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
    check_publish_header(h)
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
        yield pb.PublishVersionResponse(accepted=publish_accepted(session))
        try:
            async for reply in receive_parts(
                session, h.num_tensors, _parts(requests, h.base_version_id)
            ):
                if isinstance(reply, TensorAcked):
                    ack = pb.TensorAck(name=reply.name)
                    ack.status.code = 0
                    yield pb.PublishVersionResponse(tensor_ack=ack)
                else:  # Committed: the end
                    is_head = reply.record is store.chain(h.policy_id).head
                    info = version_info(reply.record, is_head)
                    yield pb.PublishVersionResponse(
                        committed=pb.PublishCommitted(
                            version=info, already_existed=reply.already_existed
                        )
                    )
        except AstraError as exc:
            yield refusal(exc)
            await drain(requests, DRAIN_S)
            raise
    finally:
        session.close()


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


async def _parts(
    requests: AsyncIterator[pb.PublishVersionRequest], base_version_id: str
) -> AsyncIterator[Part]:
    """The stream's messages as publish parts; a TensorHeader is checked when it is reached."""
    async for req in requests:
        part = req.WhichOneof("part")
        if part == "tensor":
            t = req.tensor
            layout = functools.partial(check_publish_tensor, t, base_version_id)
            yield TensorPart(t.name, t.adler32, t.size_bytes, layout)
        elif part == "chunk":
            yield ChunkPart(req.chunk.offset, req.chunk.data)
        elif part == "file":
            f = req.file
            if f.same_as_base and (not base_version_id or not _is_sha256(f.sha256) or f.content):
                raise InvalidArgument(
                    f"file {f.name!r}: same_as_base needs the header's base_version_id, a "
                    "SHA-256 of 64 lowercase hex digits and no content",
                    reason="INVALID_FILE",
                    metadata={"field": "file.same_as_base"},
                )
            yield FilePart(f.name, f.content, f.sha256 if f.same_as_base else "")
        elif part == "commit":
            yield CommitPart(req.commit.num_tensors)
        else:
            yield OtherPart()
