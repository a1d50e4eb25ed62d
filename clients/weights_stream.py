"""Drivers of WeightService's two streams: `Receiver` here, `publish_version` re-exported.

publish_version (defined in astra.clients.weights_publish) streams raw
tensors or xor+zstd frames against the sender's previous version, skips the
tensors the service already holds for the identity, and on UNAVAILABLE opens
a new stream, which resumes.

Receiver fetches into a local directory (astra.weights.local), or with
`in_memory` into buffers it holds (astra.weights.memory: for a process that
serves the weights from RAM, with no disk round trip): it stages and
verifies every tensor, acknowledges it, resumes after a disconnect or a
refused tensor from the last acknowledged one, and only then swaps the new
version in; on any failure the previous version stays current. Every wait is
bounded: a stream on which the service stays silent for `idle_timeout_s`
while the receiver has nothing of its own in flight is dropped and resumed,
and a whole `fetch` (every attempt) ends within `timeout_s` with
DeadlineExceeded naming the version, the service and the last error. With `relay`
set, each version it installs is also published into a local Store, which a
WeightService of its own serves to the next tier (a tree across regions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from astra.clients.weights import WeightClient, domain_error
from astra.clients.weights_pipeline import FetchPipeline
from astra.clients.weights_publish import PublishResult, publish_version
from astra.errors import AstraError, DataLoss, InvalidArgument, Unavailable
from astra.waits import within
from astra.weights.deadline import DeadlineExceeded
from astra.weights.local import LocalVersions, identity_of
from astra.weights.malloc import keep_freed_memory
from astra.weights.memory import MemoryVersion, MemoryVersions
from astra.weights.records import sha256_bytes
from astra.weights.v1 import weight_service_pb2 as pb

__all__ = ["FetchResult", "PublishResult", "Receiver", "publish_version"]

log = logging.getLogger(__name__)
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
ENCODINGS = {pb.TENSOR_ENCODING_RAW: "raw", pb.TENSOR_ENCODING_XOR_ZSTD: "xor_zstd"}
UNARY_TIMEOUT_S = 30.0  # ListVersions and the like, within the fetch deadline
REFUSAL_WAIT_S = 10.0  # for the service to act on a refused tensor before hanging up


class StreamStalled(Unavailable):
    """The service sent nothing for `idle_timeout_s` while the receiver waited on it."""


@dataclass
class FetchResult:
    identity: str
    version: int
    path: Path | None  # None for an in-memory receiver
    plan: str  # "none", "delta" or "full"
    base: str
    tensors_received: int
    tensors_resumed: int
    bytes_received: int
    attempts: int
    held: MemoryVersion | None = None  # the version itself, for an in-memory receiver


class Receiver:
    """Keeps a local directory at a policy's versions, fetched from one WeightService."""

    def __init__(
        self,
        address: str,
        policy: str,
        directory: str | Path | None,
        *,
        receiver_id: str | None = None,
        held_dirs: Iterable[str | Path] = (),
        relay: Any = None,
        max_bytes_per_second: int = 0,
        max_attempts: int = 5,
        backoff_s: float = 0.2,
        timeout_s: float = 3600.0,
        idle_timeout_s: float = 60.0,
        keep_versions: int = 2,
        durable: bool = True,
        in_memory: bool | MemoryVersions = False,
    ) -> None:
        """in_memory: True, or the MemoryVersions of an earlier receiver to go on from (what it
        holds carries over, e.g. to a service at a new address)."""
        if timeout_s <= 0 or idle_timeout_s <= 0:
            raise ValueError("timeout_s and idle_timeout_s must be positive")
        if in_memory and (directory is not None or relay is not None or held_dirs):
            raise ValueError("an in-memory receiver takes no directory, relay or held_dirs")
        if not in_memory and directory is None:
            raise ValueError("a receiver needs a directory unless it is in_memory")
        self.address = address
        self.policy, self.relay, self.keep_versions = policy, relay, keep_versions
        self.local: LocalVersions | MemoryVersions
        if isinstance(in_memory, MemoryVersions):
            self.local = in_memory
        elif in_memory:
            self.local = MemoryVersions(receiver_id or f"receiver-{os.urandom(8).hex()}")
        else:
            self.local = LocalVersions(directory, durable=durable)
        self.receiver_id = receiver_id or self.local.receiver_id
        self.extra_held = {identity_of(Path(p)): Path(p) for p in held_dirs}
        self._distrusted: set[str] = set()  # held versions found corrupt: never a base again
        # Takes a file equal to the plan's base's by name and SHA-256 (FetchStart
        # accepts_same_as_base_files); off for good once a base could not give one back.
        self.same_as_base_files = True
        self.max_bytes_per_second, self.max_attempts = max_bytes_per_second, max_attempts
        self.backoff_s, self.timeout_s, self.idle_timeout_s = backoff_s, timeout_s, idle_timeout_s
        keep_freed_memory()  # chunk buffers come back from the heap, not as fresh pages
        self.client = WeightClient(address, timeout_s=min(timeout_s, UNARY_TIMEOUT_S))

    @property
    def current_path(self) -> Path | None:
        return self.local.current_path

    @property
    def current(self) -> MemoryVersion | None:
        """The current version of an in-memory receiver (None on disk, or before a fetch)."""
        return self.local.current if isinstance(self.local, MemoryVersions) else None

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> Receiver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def fetch(self, target: str = "") -> FetchResult:
        """Fetches `target` (default: the current version), verifies it, makes it current.

        Ends within `timeout_s` (DeadlineExceeded) whatever the service does;
        on any failure the previous version stays current.
        """
        deadline = time.monotonic() + self.timeout_s
        try:
            if not target:
                page = await self.client.list_versions(
                    self.policy, page_size=1, timeout_s=self._left(deadline, UNARY_TIMEOUT_S)
                )
                if not page.versions:
                    raise InvalidArgument(
                        f"policy {self.policy!r} has no versions", reason="NO_VERSIONS"
                    )
                target = page.versions[0].version_id
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self._timed_out(target or "the current version", 0, exc.details()) from exc
            raise domain_error(exc) from exc
        last = "no attempt finished"
        for attempt in range(1, self.max_attempts + 1):
            if deadline - time.monotonic() <= 0:
                raise self._timed_out(target, attempt - 1, last)
            try:
                result = await self._attempt(target, deadline)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise self._timed_out(target, attempt, exc.details()) from exc
                if exc.code() not in RETRYABLE or attempt == self.max_attempts:
                    raise domain_error(exc) from exc
                last = f"{exc.code().name}: {exc.details()}"
                log.info("fetch %s: %s; resuming", target, last)
            except (DataLoss, StreamStalled) as exc:
                if attempt == self.max_attempts:
                    raise
                last = exc.message
                corrupt = self._corrupt_held(exc)
                if corrupt:  # the next attempt plans without it (another base, or a full copy)
                    self._distrusted.add(corrupt)
                    log.error("fetch %s: held version %s is corrupt (%s); fetching without it",
                              target, corrupt, exc.message)  # fmt: skip
                else:
                    log.warning("fetch %s: %s; resuming", target, exc.message)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # this fetch was cancelled
                # A cancellation nobody asked for (the call or one of its futures was
                # cancelled under the receiver): a failed attempt, never a silent end.
                last = "the fetch stream was cancelled under the receiver"
                if attempt == self.max_attempts:
                    raise Unavailable(
                        f"fetch {target!r}: {last}", reason="FETCH_CANCELLED"
                    ) from None
                log.warning("fetch %s: %s; resuming", target, last)
            else:
                result.attempts = attempt
                if self.relay is not None:
                    await asyncio.to_thread(self._relay, result)
                await asyncio.to_thread(self.local.prune, self.keep_versions)
                return result
            pause = min(self.backoff_s * 2 ** (attempt - 1), deadline - time.monotonic())
            if pause > 0:
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    @staticmethod
    def _left(deadline: float, cap: float | None = None) -> float:
        left = max(0.001, deadline - time.monotonic())
        return left if cap is None else min(left, cap)

    def _timed_out(self, target: str, attempts: int, last: str) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"fetch of {self.policy}/{target} from {self.address} did not complete within "
            f"{self.timeout_s:g}s ({attempts} attempts; last: {last}); the previous version "
            "stays current",
            reason="FETCH_DEADLINE_EXCEEDED",
            metadata={"policy_id": self.policy, "version_id": target, "address": self.address},
        )

    async def _read(self, call: Any, pipe: FetchPipeline | None, started: float) -> Any:
        """The next message, or StreamStalled once the service has been silent too long.

        Silence counts only while the receiver itself has nothing in flight (no
        chunk write, no tensor being verified or acknowledged): the service may
        be waiting on those acknowledgements.
        """
        read = asyncio.ensure_future(call.read())
        try:
            while True:
                progress = pipe.last_progress if pipe is not None else started
                if pipe is not None and pipe.busy:
                    progress = time.monotonic()
                left = progress + self.idle_timeout_s - time.monotonic()
                if left <= 0:
                    raise StreamStalled(
                        f"the WeightService at {self.address} sent nothing for "
                        f"{self.idle_timeout_s:g}s",
                        reason="FETCH_STREAM_STALLED",
                        metadata={"address": self.address},
                    )
                done, _ = await asyncio.wait({read}, timeout=min(left, 1.0))
                if done:
                    if pipe is not None:
                        pipe.last_progress = time.monotonic()
                    return read.result()
        finally:
            if not read.done():
                read.cancel()

    def _base_file(self, base: Any, file: Any) -> bytes:
        """The content of a file the service marked the same as the plan's base's: this
        receiver's copy, checked against the SHA-256 sent with it."""
        name, content = file.name, None
        if isinstance(base, MemoryVersion):
            content = base.files.get(name)
        elif base is not None:
            with contextlib.suppress(OSError):
                content = (Path(base.path) / name).read_bytes()
        if content is None or sha256_bytes(content) != file.sha256:
            self.same_as_base_files = False  # the next attempt asks for every file's content
            problem = "is not held" if content is None else "does not hash to the SHA-256 sent"
            raise DataLoss(
                f"{name}: the base's copy {problem}",
                reason="BASE_FILE_MISMATCH",
                metadata={"file": name},
            )
        return content

    def _corrupt_held(self, exc: AstraError) -> str:
        """The held version a failure found corrupt on disk (its path in the error), or ""."""
        path = exc.metadata.get("path", "")
        if not path:
            return ""
        for identity, held in {**self.extra_held, **self.local.held()}.items():
            if isinstance(held, Path) and Path(path).resolve() == held.resolve():
                return identity
        return ""

    def _relay(self, result: FetchResult) -> None:
        try:
            self.relay.publish_dir(self.policy, result.identity, result.version, result.path)
        except AstraError as exc:
            log.warning("relay store refused %s: %s", result.identity, exc.message)

    async def _attempt(self, target: str, deadline: float) -> FetchResult:
        held = {
            k: v
            for k, v in {**self.extra_held, **self.local.held()}.items()
            if k not in self._distrusted
        }
        stage = self.local.stage(target)
        resumed = len(stage.entries)
        started = time.monotonic()
        # The call's deadline is what is left of the fetch's: every write, read and
        # acknowledgement on it ends by then.
        await self.client.check_server()  # a revoked server: refused before the stream opens
        call = self.client.fetch_version_raw(timeout_s=self._left(deadline))
        start = pb.FetchStart(policy_id=self.policy, target_version_id=target)
        start.held_version_ids.extend(sorted(held))
        start.receiver_id, start.max_bytes_per_second = self.receiver_id, self.max_bytes_per_second
        start.acknowledged_tensors.extend(stage.acknowledged)
        start.accepts_same_as_base_files = self.same_as_base_files
        done, received, nbytes = None, 0, 0
        try:
            await call.write(pb.FetchVersionRequest(start=start))
            first = await self._read(call, None, started)
            if first is grpc.aio.EOF or not first.HasField("plan"):
                raise DataLoss("fetch stream did not start with a FetchPlan", reason="NO_PLAN")
            plan = first.plan
            base_path = held.get(plan.base_version_id) if plan.base_version_id else None
            if plan.base_version_id and base_path is None:
                raise DataLoss(
                    f"planned from {plan.base_version_id!r}, not held", reason="WRONG_BASE"
                )
            base = self.local.open(base_path) if base_path is not None else None
            pipe = FetchPipeline(call)
            try:
                try:
                    done, received, nbytes = await self._receive(call, pipe, stage, base, started)
                finally:
                    await pipe.close()
                    if base is not None:
                        base.close()
            except asyncio.CancelledError:
                # The pipeline cancels this task to stop the read on its first failure
                # (which may land while it is closing): raise that failure instead.
                if pipe.error is None:
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                raise pipe.error from None
            except DataLoss:
                if pipe.refused:
                    await self._hear_refusal(call, deadline)
                raise
            except grpc.aio.AioRpcError:
                if pipe.error is not None:  # the service ended the stream on our refusal
                    raise pipe.error from None
                raise
            await call.done_writing()
        finally:
            if done is None:
                call.cancel()
        if plan.target.version_id != target:
            raise DataLoss(f"service sent {plan.target.version_id!r}", reason="WRONG_TARGET")
        if target in held and plan.num_tensors == 0 and not plan.base_version_id:
            installed = await asyncio.to_thread(self.local.adopt, held[target], target)
            kind = "none"
        elif isinstance(self.local, MemoryVersions):
            installed = self.local.install(
                stage, base_path, done.num_tensors, version=plan.target.version
            )
            kind = "delta" if plan.base_version_id else "full"
        else:
            installed = await asyncio.to_thread(
                self.local.install, stage, base_path, done.num_tensors
            )
            kind = "delta" if plan.base_version_id else "full"
        memory = installed if isinstance(installed, MemoryVersion) else None
        return FetchResult(
            target,
            plan.target.version,
            None if memory is not None else installed,
            kind,
            plan.base_version_id,
            received,
            resumed,
            nbytes,
            0,
            memory,
        )

    async def _hear_refusal(self, call: Any, deadline: float) -> None:
        """Waits (bounded) for the service to end the stream after a refused tensor.

        The service acts on the refusal (drops a damaged cache entry, marks a bad
        version) before it ends the stream; hanging up at once could cut it off,
        and the next attempt would be served the same damaged bytes.
        """
        end = min(deadline, time.monotonic() + REFUSAL_WAIT_S)
        with contextlib.suppress(Exception):
            await call.done_writing()
            while time.monotonic() < end:
                msg = await within(call.read(), end - time.monotonic())
                if msg is grpc.aio.EOF:
                    return

    async def _receive(
        self, call: Any, pipe: FetchPipeline, stage: Any, base: Any, started: float
    ) -> tuple[Any, int, int]:
        """Reads the stream to FetchDone, staging every tensor; (done, tensors, bytes)."""
        done, received, nbytes, incoming = None, 0, 0, None
        while done is None:
            resp = await self._read(call, pipe, started)
            if resp is grpc.aio.EOF:
                raise DataLoss("stream ended before FetchDone", reason="TRUNCATED_STREAM")
            pipe.check()
            part = resp.WhichOneof("part")
            if part == "tensor":
                if incoming is not None:
                    raise DataLoss(
                        f"{incoming.name}: the next tensor began before it ended",
                        reason="TRUNCATED_TENSOR",
                        metadata={"tensor": incoming.name},
                    )
                h = resp.tensor
                header = {"name": h.name, "dtype": h.dtype, "shape": list(h.shape)}
                header.update(encoding=ENCODINGS.get(h.encoding), adler32=h.adler32)
                header.update(size_bytes=h.size_bytes, encoded_size_bytes=h.encoded_size_bytes)
                incoming = await pipe.begin(stage, header, base)
            elif part == "chunk":
                if incoming is None:
                    raise DataLoss("a chunk before any tensor", reason="BAD_CHUNK")
                await pipe.write(incoming, resp.chunk.offset, resp.chunk.data)
                nbytes += len(resp.chunk.data)
            elif part == "file" and resp.file.same_as_base:
                stage.add_file(resp.file.name, self._base_file(base, resp.file))
            elif part == "file":
                stage.add_file(resp.file.name, resp.file.content)
            elif part == "done":
                done = resp.done
            if incoming is not None and incoming.complete:
                pipe.finish(incoming)
                incoming, received = None, received + 1
        await pipe.drain()
        return done, received, nbytes
