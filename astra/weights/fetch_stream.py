"""The body of a fetch stream: plan -> tensors -> acks -> done, as plain objects.

`serve_fetch` sends one receiver what it lacks of a version: the plan, the
tensors in name order (skipping those the receiver already acknowledged,
only with an explicit target), their chunks, the version's files, and
`Done` once every tensor sent is acknowledged. The plan's encoded directory
is built once by the store and read through mmap by every stream, so N
receivers cost N reads of shared pages, never N encodings. Acknowledgements
are read concurrently (`AckReader`); at most `window_bytes` of encoded data
may wait for them, which bounds what a disconnect costs. A refused tensor
(the receiver's checksum failed) ends the stream with DATA_LOSS naming it,
after the store has checked what it served (astra.weights.store_health),
even when the receiver hung up right after refusing. Never touches gRPC or
protobuf: the servicer converts messages to `FetchRequest` and `Ack`s and
the yielded objects to messages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from astra.errors import AstraError, DataLoss, InvalidArgument, Unavailable, invalid_field
from astra.waits import cancel_and_wait, wait_set
from astra.weights.store import Store
from astra.weights.store_fetch import WireTensor, open_source
from astra.weights.throttle import TokenBucket

MiB = 1 << 20
MAX_TENSOR_NAME = 1024  # characters of TensorAck.name (weight_service.proto)


@dataclass(frozen=True)
class StreamSettings:
    """Stream tuning; the chunk size was chosen by measurement (servers/weights.py)."""

    # Below 4 MiB, gRPC's default receive limit, so a stock receiver still reads every message.
    chunk_bytes: int = 4 * MiB - 64 * 1024
    # Encoded bytes sent but not yet acknowledged. A receiver acknowledges a tensor only once it
    # is verified and fsynced, so the window must span more than the largest tensor (an embedding
    # is ~130-500 MiB) or every big tensor stalls the stream for the receiver's fsync.
    window_bytes: int = 256 * MiB
    ack_timeout_s: float = 60.0
    first_message_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """A checked FetchStart."""

    policy_id: str
    target_version_id: str
    held_version_ids: list[str]
    acknowledged_tensors: list[str]
    max_bytes_per_second: int
    receiver_id: str
    accepts_same_as_base_files: bool = False


@dataclass(frozen=True, slots=True)
class Ack:
    """A receiver's TensorAck: `code` 0 is verified and durable, anything else a refusal."""

    name: str
    code: int
    message: str = ""


@dataclass(frozen=True, slots=True)
class Planned:
    target: Any  # astra.weights.records.VersionRecord
    is_head: bool
    base_version_id: str
    num_tensors: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class TensorOut:
    tensor: WireTensor


@dataclass(frozen=True, slots=True)
class ChunkOut:
    offset: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class FileOut:
    name: str
    content: bytes
    same_as_base: str = ""  # the SHA-256 of the base's file, the content left out


@dataclass(frozen=True, slots=True)
class Done:
    num_tensors: int


class AckReader:
    """Reads a fetch stream's acknowledgements in the background."""

    def __init__(self, acks: AsyncIterator[Ack], sizes: dict[str, int]) -> None:
        self.sizes, self.acked, self.acked_bytes = sizes, set[str](), 0
        self.error: AstraError | None = None
        self.closed = False
        self._event = asyncio.Event()
        self._task = asyncio.create_task(self._run(acks))

    async def _run(self, acks: AsyncIterator[Ack]) -> None:
        try:
            async for ack in acks:
                name = ack.name
                if not 1 <= len(name) <= MAX_TENSOR_NAME:
                    raise invalid_field("ack.name", f"must be 1-{MAX_TENSOR_NAME} characters")
                if name not in self.sizes:
                    raise InvalidArgument(
                        f"ack for {name!r}, which this stream did not send",
                        reason="UNKNOWN_TENSOR",
                        metadata={"tensor": name},
                    )
                if ack.code != 0:
                    raise DataLoss(
                        f"{name}: the receiver refused it: {ack.message}",
                        reason="CHECKSUM_MISMATCH",
                        metadata={"tensor": name},
                    )
                if name not in self.acked:
                    self.acked.add(name)
                    self.acked_bytes += self.sizes[name]
                self._event.set()
        except AstraError as exc:
            self.error = exc
        finally:
            self.closed = True
            self._event.set()

    async def wait(self, ready: Callable[[], bool], timeout_s: float) -> None:
        """Until ready(); raises the reader's error, or when the receiver stops acknowledging."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.error is not None:
                raise self.error
            if ready():
                return
            if self.closed:
                raise Unavailable(
                    "the receiver closed the stream before acknowledging every tensor",
                    reason="ACKS_MISSING",
                )
            self._event.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                # Unavailable: the receiver resumes from what it acknowledged (a slow disk
                # verifying a large tensor is not the receiver's error).
                raise Unavailable("no acknowledgement in time", reason="ACK_TIMEOUT")
            await wait_set(self._event, left)

    async def close(self) -> None:
        await cancel_and_wait(self._task)


async def serve_fetch(
    store: Store, start: FetchRequest, acks: AsyncIterator[Ack], settings: StreamSettings
) -> AsyncIterator[Planned | TensorOut | ChunkOut | FileOut | Done]:
    """One fetch, from its checked start; `acks` are the receiver's messages after it."""
    held = list(start.held_version_ids)
    source = await asyncio.to_thread(
        open_source,
        store,
        start.policy_id,
        start.target_version_id,
        held,
        start.receiver_id,
        same_as_base=start.accepts_same_as_base_files,
    )
    reader: AckReader | None = None
    try:
        # Resumption needs an explicit target (the proto): with "" the current version may have
        # changed since, and the names would skip that version's tensors.
        acked = set(start.acknowledged_tensors) if start.target_version_id else set()
        todo = [t for t in source.tensors() if t.name not in acked]
        store.counters["fetch_tensors_resumed"] += len(source.tensors()) - len(todo)
        target = source.target
        yield Planned(
            target,
            target is store.chain(start.policy_id).head,
            source.plan.base if source.plan.kind == "delta" else "",
            len(todo),
            sum(t.encoded_size for t in todo),
        )
        reader = AckReader(acks, {t.name: t.encoded_size for t in todo})
        bucket = TokenBucket(start.max_bytes_per_second) if start.max_bytes_per_second else None
        sent: dict[str, int] = {}
        sent_bytes = 0

        def room() -> bool:
            return sent_bytes - reader.acked_bytes < settings.window_bytes or not sent

        for t in todo:
            await reader.wait(room, settings.ack_timeout_s)
            yield TensorOut(t)
            offset = 0
            for piece in source.chunks(t.name, settings.chunk_bytes):
                if bucket is not None:
                    await bucket.take(piece.nbytes)
                yield ChunkOut(offset, piece)
                offset += piece.nbytes
            sent[t.name] = t.encoded_size
            sent_bytes += t.encoded_size
            store.counters["fetch_tensors_sent"] += 1
            store.counters["fetch_bytes_sent"] += t.encoded_size
        if source.plan.kind != "none":
            for name, content in sorted(source.files.items()):
                yield FileOut(name, content)
            for name, sha256 in sorted(source.same_files.items()):
                yield FileOut(name, b"", same_as_base=sha256)
                store.counters["fetch_files_same_as_base"] += 1
        await reader.wait(lambda: reader.acked >= sent.keys(), settings.ack_timeout_s)
        if start.receiver_id:
            await asyncio.to_thread(
                store.register_receiver,
                start.policy_id,
                start.receiver_id,
                [*held, target.identity],
            )
        store.counters["fetches_completed"] += 1
        yield Done(len(source.tensors()))
    except DataLoss as exc:
        tensor = exc.metadata.get("tensor", "")
        if exc.reason == "CHECKSUM_MISMATCH" and source.version is not None and tensor:
            # What was served may be damaged: a cache entry is dropped (and rebuilt for the
            # receiver's next attempt), a stored version that is bad is marked so.
            served = source.version.path
            await asyncio.to_thread(store.refused, start.policy_id, target.identity, served, tensor)
        raise
    except asyncio.CancelledError:
        # The receiver hung up: a refusal it sent first is still acted on (off the loop).
        refusal = reader.error if reader is not None else None
        if isinstance(refusal, DataLoss) and refusal.reason == "CHECKSUM_MISMATCH":
            tensor = refusal.metadata.get("tensor", "")
            if source.version is not None and tensor:
                asyncio.get_running_loop().run_in_executor(
                    None, store.refused, start.policy_id, target.identity,
                    source.version.path, tensor,
                )  # fmt: skip
        raise
    finally:
        if reader is not None:
            await reader.close()
        source.close()
