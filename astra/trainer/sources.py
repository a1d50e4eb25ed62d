"""Where the trainer's batches come from and where its versions go, behind two small protocols.

`BatchSource` (fetch / ack / current version / announce) is Dataflow in
production (`DataflowSource`); `WeightSink` (latest version / publish) is the
WeightService (`WeightServiceSink`). Custom loops and tests pass their own.
Transport failures surface as `BatchNotReady` (retry the same request id)
or `RequestIdSpent` (use a new one); every other error propagates.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from astra.common.v1 import rollout_pb2
from astra.errors import AstraError, NotFound, Unavailable

log = logging.getLogger(__name__)
MAX_FILE_BYTES = 8 << 20  # the WeightService's bound on an extra file
T = TypeVar("T")


class BatchNotReady(Exception):
    """No batch now (not enough groups, or the service is unreachable): retry the same id."""


class RequestIdSpent(Exception):
    """The request id cannot return a batch any more (lease expired, reused): take a new id."""


@dataclass
class FetchedBatch:
    batch_id: str
    policy_version: int
    trajectories: list[rollout_pb2.Trajectory]
    max_staleness: int = 0
    lease_expire: float = 0.0  # seconds since the epoch; 0: the source has no leases


class BatchSource(Protocol):
    async def fetch(
        self, request_id: str, num_groups: int, trainer_version: int = 0
    ) -> FetchedBatch: ...

    async def ack(self, batch_id: str, untrained_reason: str = "") -> None: ...

    async def current_version(self) -> int | None: ...

    async def announce(
        self, version: int, identity: str, resumed: bool = False, resumed_from: int | None = None
    ) -> None: ...

    async def close(self) -> None: ...


class WeightSink(Protocol):
    async def latest_version(self) -> int | None: ...

    async def publish(
        self, version: int, identity: str, tensors: Mapping[str, tuple[str, tuple, Any]]
    ) -> None: ...

    async def close(self) -> None: ...


def _code(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    from astra.clients.weights import domain_error

    return exc.code(), domain_error(exc).reason


async def _batch_call(rpc: str, call: Callable[[str], Awaitable[Any]], batch_id: str) -> Any:
    """`call(batch_id)`; Dataflow not answering is Unavailable (worth retrying), any other
    failure its domain error (the batch was acknowledged, expired, unknown)."""
    from astra.clients.weights import domain_error

    try:
        return await call(batch_id)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise Unavailable(
                f"{rpc} {batch_id}: {exc.code().name}: {exc.details()}",
                reason="DATAFLOW_UNREACHABLE",
                metadata={"batch_id": batch_id},
            ) from exc
        raise domain_error(exc) from exc


class DataflowSource:
    """BatchSource over DataflowService."""

    def __init__(
        self,
        address: str,
        policy_id: str,
        *,
        trainer_id: str,
        weights_address: str,
        max_wait_s: float = 10.0,
    ) -> None:
        from astra.clients.dataflow import DataflowClient

        self.client = DataflowClient(address)
        self.policy_id, self.trainer_id = policy_id, trainer_id
        self.weights_address, self.max_wait_s = weights_address, max_wait_s

    async def fetch(
        self, request_id: str, num_groups: int, trainer_version: int = 0
    ) -> FetchedBatch:
        try:
            header, trajectories, footer = await self.client.fetch_batch(
                self.policy_id,
                num_groups,
                request_id,
                trainer_id=self.trainer_id,
                max_wait_s=self.max_wait_s,
                trainer_version=trainer_version,
            )
        except ConnectionError as exc:
            raise BatchNotReady(str(exc)) from exc
        except grpc.aio.AioRpcError as exc:
            code, reason = _code(exc)
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise BatchNotReady(f"{code.name}: {exc.details()}") from exc
            if reason in ("BATCH_LEASE_EXPIRED", "REQUEST_ID_REUSED"):
                raise RequestIdSpent(reason) from exc
            raise
        return FetchedBatch(
            header.batch_id,
            header.policy_version,
            list(trajectories),
            footer.max_staleness,
            header.lease_expire_time.ToNanoseconds() / 1e9,
        )

    async def extend_lease(self, batch_id: str) -> float:
        """ExtendBatchLease: the new expiry (seconds since the epoch). Unavailable when
        Dataflow does not answer, else its error (the batch was acknowledged or expired)."""
        resp = await _batch_call("ExtendBatchLease", self.client.extend_batch_lease, batch_id)
        return resp.lease_expire_time.ToNanoseconds() / 1e9

    async def ack(self, batch_id: str, untrained_reason: str = "") -> None:
        """Raises Unavailable when Dataflow does not answer (worth retrying), else its error.
        `untrained_reason`: why no step was taken on the batch (empty: it was trained)."""
        ack = functools.partial(self.client.ack_batch, untrained_reason=untrained_reason)
        await _batch_call("AckBatch", ack, batch_id)

    async def current_version(self) -> int | None:
        status = await self.client.get_status()
        return next(
            (p.current_version for p in status.policies if p.policy_id == self.policy_id), None
        )

    async def announce(
        self, version: int, identity: str, resumed: bool = False, resumed_from: int | None = None
    ) -> None:
        try:
            await self.client.announce_version(
                self.policy_id,
                version,
                self.weights_address,
                version_id=identity,
                trainer_id=self.trainer_id,
                resumed=resumed,
                resumed_from_version=resumed_from,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise Unavailable(exc.details() or "", reason="DATAFLOW_UNAVAILABLE") from exc
            raise

    async def close(self) -> None:
        await self.client.close()


class WeightServiceSink:
    """WeightSink over WeightService: each version as xor+zstd frames against the one before.

    The sink keeps the host copy it published last (one more model's worth of
    host memory in the publish dtype) and sends the next version as frames
    against it; the first version, and any the service refuses as a delta
    (its current version is another), go out raw, with the model's small files.
    """

    def __init__(
        self, address: str, policy_id: str, files: Mapping[str, bytes], *, delta: bool = True
    ) -> None:
        from astra.clients.weights import WeightClient

        self.address, self.policy_id, self.files = address, policy_id, dict(files)
        self.delta = delta
        self.client = WeightClient(address)
        self._last: tuple[str, Mapping[str, tuple[str, tuple, Any]]] | None = None
        self.bytes_sent = 0

    async def latest_version(self) -> int | None:
        from astra.clients.weights import domain_error

        try:
            page = await self.client.list_versions(self.policy_id, page_size=1)
        except grpc.aio.AioRpcError as exc:
            err = domain_error(exc)
            if isinstance(err, NotFound):
                return None
            raise err from exc
        return page.versions[0].version if page.versions else None

    async def publish(
        self, version: int, identity: str, tensors: Mapping[str, tuple[str, tuple, Any]]
    ) -> None:
        from astra.clients.weights_publish import publish_version

        result = await publish_version(
            self.address, self.policy_id, identity, version, tensors, self.files, base=self._last
        )
        self.bytes_sent += result.bytes_sent
        self._last = (identity, tensors) if self.delta else None

    async def close(self) -> None:
        await self.client.close()


def model_files(model: str, config: Mapping[str, Any]) -> dict[str, bytes]:
    """config.json plus the small files of a model directory (tokenizer, generation config)."""
    files = {"config.json": (json.dumps(dict(config), indent=2) + "\n").encode()}
    path = Path(model)
    if path.is_dir():
        for f in sorted(path.iterdir()):
            small = f.is_file() and f.stat().st_size <= MAX_FILE_BYTES
            if (
                small
                and f.suffix in (".json", ".txt", ".model", ".jinja")
                and "index" not in f.name
            ):
                files.setdefault(f.name, f.read_bytes())
    return files


async def retrying(call: Callable[[], Awaitable[T]], what: str, *, max_backoff_s: float = 5.0) -> T:
    """`call()` until it returns; retryable errors (a service restarting) are waited out."""
    backoff = 0.1
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_retryable(exc):
                raise
            log.warning("%s: %s; retrying in %.1fs", what, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff_s)


def is_retryable(exc: BaseException) -> bool:
    """Errors a background publish or announce waits out: a service restarting, or one that
    says when to come back (RESOURCE_EXHAUSTED with a retry delay: the WeightService's disk
    is full). Training then pauses on the full publish queue instead of the trainer dying
    and losing the steps since its checkpoint at every restart."""
    if isinstance(exc, (Unavailable, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    if isinstance(exc, AstraError) and exc.code == "RESOURCE_EXHAUSTED":
        return exc.retry_after_s is not None
    return isinstance(exc, AstraError) and exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
