"""Drivers of WeightService's two streams: `Receiver` here, `publish_version` re-exported.

publish_version (defined in astra.clients.weights) streams raw tensors,
skips the tensors the service already holds for the identity, and on
UNAVAILABLE opens a new stream, which resumes.

Receiver fetches into a local directory (astra.weights.local): it stages and
verifies every tensor, acknowledges it, resumes after a disconnect or a
refused tensor from the last acknowledged one, and only then swaps the new
version in; on any failure the previous version stays current. With `relay`
set, each version it installs is also published into a local Store, which a
WeightService of its own serves to the next tier (a tree across regions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from astra.clients.weights import PublishResult, WeightClient, domain_error, publish_version
from astra.errors import AstraError, DataLoss, InvalidArgument
from astra.weights.layout import open_full
from astra.weights.local import LocalVersions, identity_of
from astra.weights.v1 import weight_service_pb2 as pb

__all__ = ["FetchResult", "PublishResult", "Receiver", "publish_version"]

log = logging.getLogger(__name__)
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
ENCODINGS = {pb.TENSOR_ENCODING_RAW: "raw", pb.TENSOR_ENCODING_XOR_ZSTD: "xor_zstd"}


@dataclass
class FetchResult:
    identity: str
    version: int
    path: Path
    plan: str  # "none", "delta" or "full"
    base: str
    tensors_received: int
    tensors_resumed: int
    bytes_received: int
    attempts: int


class Receiver:
    """Keeps a local directory at a policy's versions, fetched from one WeightService."""

    def __init__(
        self,
        address: str,
        policy: str,
        directory: str | Path,
        *,
        receiver_id: str | None = None,
        held_dirs: Iterable[str | Path] = (),
        relay: Any = None,
        max_bytes_per_second: int = 0,
        max_attempts: int = 5,
        backoff_s: float = 0.2,
        timeout_s: float = 3600.0,
        keep_versions: int = 2,
        durable: bool = True,
    ) -> None:
        self.policy, self.relay, self.keep_versions = policy, relay, keep_versions
        self.local = LocalVersions(directory, durable=durable)
        self.receiver_id = receiver_id or self.local.receiver_id
        self.extra_held = {identity_of(Path(p)): Path(p) for p in held_dirs}
        self.max_bytes_per_second, self.max_attempts = max_bytes_per_second, max_attempts
        self.backoff_s, self.timeout_s = backoff_s, timeout_s
        self.client = WeightClient(address, timeout_s=timeout_s)

    @property
    def current_path(self) -> Path | None:
        return self.local.current_path

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> Receiver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def fetch(self, target: str = "") -> FetchResult:
        """Fetches `target` (default: the current version), verifies it, makes it current."""
        try:
            if not target:
                page = await self.client.list_versions(self.policy, page_size=1)
                if not page.versions:
                    raise InvalidArgument(
                        f"policy {self.policy!r} has no versions", reason="NO_VERSIONS"
                    )
                target = page.versions[0].version_id
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc) from exc
        for attempt in range(1, self.max_attempts + 1):
            try:
                result = await self._attempt(target)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE or attempt == self.max_attempts:
                    raise domain_error(exc) from exc
                log.info("fetch %s: %s; resuming", target, exc.details())
            except DataLoss as exc:
                if attempt == self.max_attempts:
                    raise
                log.warning("fetch %s: %s; resuming", target, exc.message)
            else:
                result.attempts = attempt
                if self.relay is not None:
                    await asyncio.to_thread(self._relay, result)
                await asyncio.to_thread(self.local.prune, self.keep_versions)
                return result
            await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _relay(self, result: FetchResult) -> None:
        try:
            self.relay.publish_dir(self.policy, result.identity, result.version, result.path)
        except AstraError as exc:
            log.warning("relay store refused %s: %s", result.identity, exc.message)

    async def _attempt(self, target: str) -> FetchResult:
        held = {**self.extra_held, **self.local.held()}
        stage = self.local.stage(target)
        resumed = len(stage.entries)
        call = self.client.stub.FetchVersion(timeout=self.timeout_s)
        start = pb.FetchStart(policy_id=self.policy, target_version_id=target)
        start.held_version_ids.extend(sorted(held))
        start.receiver_id, start.max_bytes_per_second = self.receiver_id, self.max_bytes_per_second
        start.acknowledged_tensors.extend(stage.acknowledged)
        done, received, nbytes = None, 0, 0
        try:
            await call.write(pb.FetchVersionRequest(start=start))
            first = await call.read()
            if first is grpc.aio.EOF or not first.HasField("plan"):
                raise DataLoss("fetch stream did not start with a FetchPlan", reason="NO_PLAN")
            plan = first.plan
            base_path = held.get(plan.base_version_id) if plan.base_version_id else None
            if plan.base_version_id and base_path is None:
                raise DataLoss(
                    f"planned from {plan.base_version_id!r}, not held", reason="WRONG_BASE"
                )
            base = open_full(base_path) if base_path is not None else None
            incoming = None
            try:
                while done is None:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        raise DataLoss("stream ended before FetchDone", reason="TRUNCATED_STREAM")
                    part = resp.WhichOneof("part")
                    if part == "tensor":
                        h = resp.tensor
                        header = {"name": h.name, "dtype": h.dtype, "shape": list(h.shape)}
                        header.update(encoding=ENCODINGS.get(h.encoding), adler32=h.adler32)
                        header.update(
                            size_bytes=h.size_bytes, encoded_size_bytes=h.encoded_size_bytes
                        )
                        incoming = stage.receive(header, base)
                    elif part == "chunk":
                        incoming.write(resp.chunk.offset, resp.chunk.data)
                        nbytes += len(resp.chunk.data)
                    elif part == "file":
                        stage.add_file(resp.file.name, resp.file.content)
                    elif part == "done":
                        done = resp.done
                    if incoming is not None and incoming.complete:
                        try:
                            await asyncio.to_thread(incoming.finish)
                        except DataLoss as exc:
                            nack = pb.TensorAck(name=incoming.name)
                            nack.status.code, nack.status.message = 15, exc.message  # DATA_LOSS
                            with contextlib.suppress(Exception):
                                await call.write(pb.FetchVersionRequest(ack=nack))
                            raise
                        await call.write(
                            pb.FetchVersionRequest(ack=pb.TensorAck(name=incoming.name))
                        )
                        incoming, received = None, received + 1
            finally:
                if base is not None:
                    base.close()
            await call.done_writing()
        finally:
            if done is None:
                call.cancel()
        if plan.target.version_id != target:
            raise DataLoss(f"service sent {plan.target.version_id!r}", reason="WRONG_TARGET")
        if target in held and plan.num_tensors == 0 and not plan.base_version_id:
            path = await asyncio.to_thread(self.local.adopt, held[target], target)
            kind = "none"
        else:
            path = await asyncio.to_thread(self.local.install, stage, base_path, done.num_tensors)
            kind = "delta" if plan.base_version_id else "full"
        return FetchResult(
            target,
            plan.target.version,
            path,
            kind,
            plan.base_version_id,
            received,
            resumed,
            nbytes,
            0,
        )
