"""The FetchVersion stream: start -> plan -> tensors -> acks -> done.

Here: the FetchStart is checked and converted, the receiver's TensorAcks
become `Ack`s, and what astra.weights.fetch_stream.serve_fetch yields (the
plan, tensors in name order, their chunks as wire bytes, files, done) becomes
FetchVersionResponses. The window, the acknowledgements, resumption and what
a refused tensor sets off are serve_fetch's and the store's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from astra.errors import invalid_field
from astra.servers.checks import check_id
from astra.servers.weights_convert import (
    MAX_HELD,
    MAX_TENSORS,
    identity,
    tensor_header,
    version_info,
)
from astra.servers.weights_publish import first_message
from astra.weights.fetch_stream import (
    Ack,
    ChunkOut,
    Done,
    FetchRequest,
    FileOut,
    Planned,
    StreamSettings,
    TensorOut,
    serve_fetch,
)
from astra.weights.store import Store
from astra.weights.v1 import weight_service_pb2 as pb
from astra.weights.wire import chunk_message

MIN_BYTES_PER_SECOND = 4096  # below, a cap would hold a stream (and the versions it pins) for weeks
__all__ = ["StreamSettings", "fetch_stream"]


def _check_start(start: pb.FetchStart) -> None:
    check_id(start.policy_id, "start.policy_id")
    identity(start.target_version_id, "start.target_version_id", required=False)
    if len(start.held_version_ids) > MAX_HELD:
        raise invalid_field("start.held_version_ids", f"more than {MAX_HELD}")
    if len(start.acknowledged_tensors) > MAX_TENSORS:
        raise invalid_field("start.acknowledged_tensors", f"more than {MAX_TENSORS}")
    if start.max_bytes_per_second < 0 or 0 < start.max_bytes_per_second < MIN_BYTES_PER_SECOND:
        raise invalid_field(
            "start.max_bytes_per_second", f"0 (no cap) or at least {MIN_BYTES_PER_SECOND}"
        )
    if len(start.receiver_id) > 128:
        raise invalid_field("start.receiver_id", "longer than 128 characters")


async def _acks(requests: AsyncIterator[pb.FetchVersionRequest]) -> AsyncIterator[Ack]:
    async for req in requests:
        if req.WhichOneof("part") != "ack":
            raise invalid_field("ack", "only TensorAck may follow FetchStart")
        yield Ack(req.ack.name, req.ack.status.code, req.ack.status.message)


def _response(
    out: Planned | TensorOut | ChunkOut | FileOut | Done,
) -> pb.FetchVersionResponse | bytes:
    if isinstance(out, ChunkOut):
        # The message's wire bytes, built with one copy of the piece (servers/weights.py
        # registers a serializer that passes bytes through).
        return chunk_message(out.offset, out.data)
    if isinstance(out, TensorOut):
        return pb.FetchVersionResponse(tensor=tensor_header(out.tensor))
    if isinstance(out, Planned):
        return pb.FetchVersionResponse(
            plan=pb.FetchPlan(
                target=version_info(out.target, out.is_head),
                base_version_id=out.base_version_id,
                num_tensors=out.num_tensors,
                total_bytes=out.total_bytes,
            )
        )
    if isinstance(out, FileOut):
        if out.same_as_base:
            file = pb.VersionFile(name=out.name, same_as_base=True, sha256=out.same_as_base)
            return pb.FetchVersionResponse(file=file)
        return pb.FetchVersionResponse(file=pb.VersionFile(name=out.name, content=out.content))
    return pb.FetchVersionResponse(done=pb.FetchDone(num_tensors=out.num_tensors))


async def fetch_stream(
    store: Store,
    requests: AsyncIterator[pb.FetchVersionRequest],
    settings: StreamSettings,
) -> AsyncIterator[pb.FetchVersionResponse | bytes]:
    first = await first_message(requests, settings.first_message_timeout_s)
    if first is None or first.WhichOneof("part") != "start":
        raise invalid_field(
            "start", "the first message must be a FetchStart", reason="FETCH_START_REQUIRED"
        )
    start = first.start
    _check_start(start)
    request = FetchRequest(
        policy_id=start.policy_id,
        target_version_id=start.target_version_id,
        held_version_ids=list(start.held_version_ids),
        acknowledged_tensors=list(start.acknowledged_tensors),
        max_bytes_per_second=start.max_bytes_per_second,
        receiver_id=start.receiver_id,
        accepts_same_as_base_files=start.accepts_same_as_base_files,
    )
    # Closed with this stream, so its cleanup runs when this stream's does.
    async with contextlib.aclosing(serve_fetch(store, request, _acks(requests), settings)) as outs:
        async for out in outs:
            yield _response(out)
