"""The checking DataflowService and WeightService of `astra trainer check`.

A real gRPC DataflowService of one policy that serves a trainer synthetic but valid
batches (seeded random groups, astra.trainer.synthetic), answers FetchBatch,
AckBatch, ExtendBatchLease, AnnounceVersion and GetStatus as the contract states,
and records every call with its time (astra.trainer.contract_rules.Event). The
first fetch of each run is broken on purpose after its first trajectories (UNAVAILABLE)
so that the trainer's retry can be seen. Beside it runs a real WeightService (the
store on a temporary directory, which verifies every checksum) whose publish streams
are recorded as they end. Judging is contract_rules'; this module never starts or
stops the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as pb_grpc
from astra.errors import AstraError, FailedPrecondition, NotFound, Unavailable, invalid_field
from astra.servers.runtime import GrpcServer
from astra.servers.weights import SERVICE_NAME as WEIGHTS_SERVICE
from astra.servers.weights import WeightServicer
from astra.servers.weights_serve import WeightServer, add_weight_service
from astra.trainer.contract_rules import REASON, Event
from astra.trainer.synthetic import random_group
from astra.weights.store import Store

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DataflowService"].full_name


@dataclass
class BatchShape:
    vocab_size: int = 256
    group_size: int = 2
    prompt_len: int = 4
    max_new: int = 4
    lease_s: float = 300.0


@dataclass
class Lease:
    batch_id: str
    request_id: str
    num_groups: int
    trajectories: list
    expire: float  # monotonic
    acked: bool = False


@dataclass
class Recorder:
    """The events, and which run of the trainer they belong to."""

    events: list[Event] = field(default_factory=list)
    run: int = 0

    def add(self, kind: str, **info: object) -> Event:
        event = Event(time.monotonic(), self.run, kind, dict(info))
        self.events.append(event)
        return event


@contextlib.contextmanager
def noted(event: Event) -> Iterator[None]:
    """A refusal raised inside is noted on the event (its ErrorInfo reason), then raised."""
    try:
        yield
    except AstraError as exc:
        event.info["reason"] = exc.reason
        raise


class CheckingDataflow(pb_grpc.DataflowServiceServicer):
    def __init__(self, policy: str, shape: BatchShape, recorder: Recorder, store) -> None:
        self.policy, self.shape, self.rec, self.store = policy, shape, recorder, store
        self.current = 0
        self.leases: dict[str, Lease] = {}  # by request_id
        self.by_batch: dict[str, Lease] = {}
        self.broken_runs: set[int] = set()
        self.rng = np.random.default_rng(0)

    def _policy(self, policy_id: str, field_name: str) -> None:
        if policy_id != self.policy:
            raise NotFound(f"unknown policy {policy_id!r}", reason="POLICY_NOT_FOUND",
                           metadata={"field": field_name})  # fmt: skip

    def _cut(self, request_id: str, num_groups: int) -> Lease:
        trajectories = [
            t
            for g in range(num_groups)
            for t in random_group(
                self.rng,
                self.policy,
                f"{request_id}/{g}",
                vocab_size=self.shape.vocab_size,
                group_size=self.shape.group_size,
                prompt_len=self.shape.prompt_len,
                max_new=self.shape.max_new,
                version=self.current,
            )
        ]
        lease = Lease(f"batch-{len(self.by_batch) + 1}", request_id, num_groups, trajectories, 0.0)
        self.leases[request_id] = self.by_batch[lease.batch_id] = lease
        return lease

    async def FetchBatch(self, request: pb.FetchBatchRequest, context):
        info = {"request_id": request.request_id, "num_groups": request.num_groups}
        info["trainer_version"] = request.trainer_version
        event = self.rec.add("fetch", outcome="refused", **info)
        with noted(event):
            async for resp in self._batch(request, event):
                yield resp

    async def _batch(self, request: pb.FetchBatchRequest, event: Event):
        if not request.request_id:
            raise invalid_field("request_id", "required")
        if not 1 <= request.num_groups <= 65536:
            raise invalid_field("num_groups", "must be 1..65536")
        if request.trainer_version < 0 or request.max_wait.ToNanoseconds() < 0:
            field_name = "trainer_version" if request.trainer_version < 0 else "max_wait"
            raise invalid_field(field_name, "must not be negative")
        self._policy(request.policy_id, "policy_id")
        lease = self.leases.get(request.request_id)
        now = time.monotonic()
        if lease is not None and (lease.acked or lease.num_groups != request.num_groups):
            raise invalid_field("request_id", "used before", reason="REQUEST_ID_REUSED")
        if lease is not None and lease.expire < now:
            raise FailedPrecondition("lease expired", reason="BATCH_LEASE_EXPIRED")
        lease = lease or self._cut(request.request_id, request.num_groups)
        lease.expire = now + self.shape.lease_s
        event.info.update(batch_id=lease.batch_id, expire=lease.expire)
        header = pb.BatchHeader(
            batch_id=lease.batch_id,
            policy_id=self.policy,
            num_groups=lease.num_groups,
            num_trajectories=len(lease.trajectories),
            policy_version=self.current,
        )
        header.lease_expire_time.FromNanoseconds(int((time.time() + self.shape.lease_s) * 1e9))
        yield pb.FetchBatchResponse(header=header)
        if self.rec.run not in self.broken_runs:  # once per run: a stream that breaks
            self.broken_runs.add(self.rec.run)
            event.info["outcome"] = "broken"
            part = pb.BatchTrajectories(trajectories=lease.trajectories[:1])
            yield pb.FetchBatchResponse(trajectories=part)
            raise Unavailable("the checker broke this stream: retry it", reason="STREAM_BROKEN")
        part = pb.BatchTrajectories(trajectories=lease.trajectories)
        yield pb.FetchBatchResponse(trajectories=part)
        footer = pb.BatchFooter(batch_id=lease.batch_id, num_trajectories=len(lease.trajectories))
        event.info["outcome"] = "batch"
        yield pb.FetchBatchResponse(footer=footer)

    def _leased(self, batch_id: str) -> Lease:
        lease = self.by_batch.get(batch_id)
        if lease is None:
            raise NotFound(f"unknown batch {batch_id!r}", reason="BATCH_NOT_FOUND")
        if not lease.acked and lease.expire < time.monotonic():
            raise FailedPrecondition("the lease expired", reason="BATCH_LEASE_EXPIRED")
        return lease

    async def AckBatch(self, request: pb.AckBatchRequest, context):
        why = request.untrained_reason
        event = self.rec.add(
            "ack", batch_id=request.batch_id, untrained_reason=why, outcome="refused"
        )
        with noted(event):
            if why and not REASON.fullmatch(why):
                raise invalid_field("untrained_reason", "1-64 letters, digits and underscores")
            lease = self._leased(request.batch_id)
        fresh = 0 if lease.acked else lease.num_groups
        lease.acked, event.info["outcome"] = True, "ok"
        return pb.AckBatchResponse(consumed_groups=fresh)

    async def ExtendBatchLease(self, request: pb.ExtendBatchLeaseRequest, context):
        event = self.rec.add("extend", batch_id=request.batch_id, outcome="refused")
        with noted(event):
            lease = self._leased(request.batch_id)
            if lease.acked:
                raise FailedPrecondition("acknowledged", reason="BATCH_ACKNOWLEDGED")
        lease.expire = time.monotonic() + self.shape.lease_s
        event.info.update(outcome="ok", expire=lease.expire)
        resp = pb.ExtendBatchLeaseResponse()
        resp.lease_expire_time.FromNanoseconds(int((time.time() + self.shape.lease_s) * 1e9))
        return resp

    def _held(self, version: int) -> str | None:
        """The identity the WeightService holds committed at `version`, or None."""
        try:
            records = self.store.list_versions(self.policy)
        except NotFound:
            return None
        return next((r.identity for r in records if r.version == version), None)

    async def AnnounceVersion(self, request: pb.AnnounceVersionRequest, context):
        v = request.version
        resumed_from = (
            request.resumed_from_version if request.HasField("resumed_from_version") else None
        )
        event = self.rec.add(
            "announce", version=v.version, version_id=v.version_id, resumed=request.resumed,
            resumed_from_version=resumed_from, current_before=self.current,
            new=v.version == self.current + 1, held=self._held(v.version), outcome="refused",
        )  # fmt: skip
        with noted(event):
            self._policy(v.policy_id, "version.policy_id")
            if v.version < 0:
                raise invalid_field("version.version", "negative")
            if not request.weights_address:
                raise invalid_field("weights_address", "required")
            if v.version not in (self.current, self.current + 1):
                raise FailedPrecondition(
                    f"version {v.version} after {self.current}",
                    reason="VERSION_NOT_NEXT",
                    metadata={"current_version": str(self.current)},
                )
        repeat = v.version == self.current
        self.current, event.info["outcome"] = v.version, "ok"
        return pb.AnnounceVersionResponse(current_version=self.current, already_announced=repeat)

    async def GetStatus(self, request, context):
        return pb.GetStatusResponse(
            policies=[pb.PolicyStatus(policy_id=self.policy, current_version=self.current)]
        )


class RecordingWeights(WeightServicer):
    """The real WeightService; each publish stream's end is recorded."""

    recorder: Recorder

    async def PublishVersion(self, request_iterator, context):
        seen: dict = {"outcome": "error", "version": -1, "detail": ""}
        try:
            async for resp in super().PublishVersion(self._watch(request_iterator, seen), context):
                part = resp.WhichOneof("part")
                if part == "committed":
                    seen["outcome"] = "committed"
                elif part == "tensor_ack" and resp.tensor_ack.status.code:
                    seen.update(outcome="refused", detail=resp.tensor_ack.status.message)
                yield resp
        except AstraError as exc:
            seen.update(outcome="refused", reason=exc.reason, detail=exc.message)
            raise
        finally:
            self.recorder.add("publish", **seen)

    @staticmethod
    async def _watch(requests, seen: dict):
        async for req in requests:
            if req.WhichOneof("part") == "header":
                seen.update(version=req.header.version, version_id=req.header.version_id)
            yield req


@dataclass
class CheckingServices:
    dataflow: GrpcServer
    weights: WeightServer
    recorder: Recorder
    servicer: CheckingDataflow

    async def stop(self) -> None:
        await self.dataflow.stop(0)
        await self.weights.stop(0)


async def start_checking_services(
    store_dir: Path, policy: str, shape: BatchShape
) -> CheckingServices:
    recorder = Recorder()
    weights = WeightServer("127.0.0.1", 0, grace_s=0)
    weights.store = await asyncio.to_thread(Store, store_dir)
    weights.servicer = RecordingWeights(weights.store)
    weights.servicer.recorder = recorder
    weights.add_service(add_weight_service, weights.servicer, WEIGHTS_SERVICE)
    await weights.start(serving=True)
    dataflow = GrpcServer("127.0.0.1", 0, grace_s=0)
    servicer = CheckingDataflow(policy, shape, recorder, weights.store)
    dataflow.add_service(pb_grpc.add_DataflowServiceServicer_to_server, servicer, SERVICE_NAME)
    await dataflow.start(serving=True)
    return CheckingServices(dataflow, weights, recorder, servicer)
