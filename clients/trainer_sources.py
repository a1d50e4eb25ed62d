"""The trainer's BatchSource and WeightSink over gRPC: DataflowService and WeightService.

`DataflowSource` fetches, acknowledges and announces; `WeightServiceSink` publishes each
version as xor+zstd frames against the one before. gRPC failures become what
astra.trainer.sources promises: `BatchNotReady`, `RequestIdSpent`, or the domain error the
service sent (astra.errors). `GRPC` builds both from a TrainerConfig (`Connect`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from astra.clients.dataflow import DataflowClient
from astra.clients.weights import WeightClient, domain_error
from astra.clients.weights_publish import publish_version
from astra.errors import NotFound, Unavailable
from astra.trainer.sources import (
    BatchNotReady,
    BatchSource,
    FetchedBatch,
    RequestIdSpent,
    WeightSink,
)


def _code(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    return exc.code(), domain_error(exc).reason


async def _batch_call(rpc: str, call: Callable[[str], Awaitable[Any]], batch_id: str) -> Any:
    """`call(batch_id)`; Dataflow not answering is Unavailable (worth retrying), any other
    failure its domain error (the batch was acknowledged, expired, unknown)."""
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
            raise domain_error(exc) from exc
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
            raise domain_error(exc) from exc

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
        self.address, self.policy_id, self.files = address, policy_id, dict(files)
        self.delta = delta
        self.client = WeightClient(address)
        self._last: tuple[str, Mapping[str, tuple[str, tuple, Any]]] | None = None
        self.bytes_sent = 0

    async def latest_version(self) -> int | None:
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
        try:
            result = await publish_version(
                self.address,
                self.policy_id,
                identity,
                version,
                tensors,
                self.files,
                base=self._last,
                client=self.client,
                # Its files never change: against its last version they go by digest.
                unchanged_files=self.files if self._last is not None else (),
            )
        except grpc.aio.AioRpcError as exc:
            raise domain_error(exc) from exc
        self.bytes_sent += result.bytes_sent
        self._last = (identity, tensors) if self.delta else None

    async def close(self) -> None:
        await self.client.close()


class GrpcConnect:
    """rank 0's source and sink over gRPC, from the config's addresses."""

    def source(self, config: Any) -> BatchSource | None:
        if config.dataflow is None:
            return None
        return DataflowSource(
            config.dataflow,
            config.policy_id,
            trainer_id=config.trainer_id,
            weights_address=config.weights or "",
            max_wait_s=config.batch.max_wait_s,
        )

    def sink(self, config: Any, files: Mapping[str, bytes]) -> WeightSink | None:
        if config.weights is None or not config.publish.enabled:
            return None
        return WeightServiceSink(config.weights, config.policy_id, files)


GRPC = GrpcConnect()
