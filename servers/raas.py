"""RolloutService servicer: validates requests, drives a `RolloutBackend` and a `ResultStore`.

Request shapes are checked here (field names are wire names); admission and
result holding are the ResultStore's; generation is the backend's. Each
accepted group runs as one task whose outcome is always a GroupResult: the
trajectories, or `error` (INTERNAL) when the backend raised, so a failure is
counted, never dropped. Domain errors are mapped to statuses by the server's
interceptor.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from google.rpc import code_pb2, status_pb2

from astra import __version__
from astra.common.v1 import capabilities_pb2, rollout_pb2, version_pb2
from astra.errors import FailedPrecondition, Unavailable, invalid_field
from astra.raas.backend import GroupSpec, RolloutBackend, VersionSpec
from astra.raas.results import ResultStore
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.raas.v1 import rollout_service_pb2_grpc as pb_grpc
from astra.servers.convert import check_id
from astra.servers.raas_convert import check_bounds, check_ids, group_spec
from astra.servers.registrar import Registrar
from astra.servers.result_wire import group_result_bytes
from astra.servers.runtime import DEFAULT_MAX_MESSAGE_BYTES, GrpcServer, with_raw_responses
from astra.servers.weights_convert import identity
from astra.weights.deadline import DeadlineExceeded

log = logging.getLogger(__name__)

CONTRACT_VERSION = "1.0.0"
MAX_GROUPS, MAX_SAMPLES, MAX_COLLECT = 1024, 1024, 4096
MAX_GROUP_ID = 256
MAX_POLICIES = 64
MAX_LOAD_REQUESTS = 256  # LoadWeights request ids remembered for retries
MAX_WAIT_S = 30.0
# A LoadWeights (waiting for an earlier one, fetching, swapping) ends by then with
# DEADLINE_EXCEEDED and the versions in service unchanged; Dataflow's call allows more.
LOAD_TIMEOUT_S = 300.0


def _differs(wanted: VersionSpec, held: VersionSpec) -> bool:
    """True unless `wanted` is in service: the same counter and the same identity."""
    return (wanted.version, wanted.version_id) != (held.version, held.version_id)


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    """astra.raas.v1.RolloutService over one backend; `instance_id` is set before serving."""

    def __init__(
        self,
        backend: RolloutBackend,
        capacity: int,
        *,
        instance_id: str = "",
        initial_versions: dict[str, int] | None = None,
        load_timeout_s: float = LOAD_TIMEOUT_S,
    ) -> None:
        self.backend = backend
        self.load_timeout_s = load_timeout_s
        self.capacity = capacity
        self.instance_id = instance_id
        self.incarnation = uuid.uuid4().hex  # this process (RegisterInstanceRequest.incarnation)
        # The largest GroupResult a CollectResults message can carry (the send limit, less
        # the response's own framing).
        self.max_result_bytes = DEFAULT_MAX_MESSAGE_BYTES - 64 * 1024
        self.policy_ids = list(backend.policy_ids)
        self.workflows = list(backend.workflows)
        self.store = ResultStore(capacity)
        # Why groups cannot run here (the engine failed), or "": SubmitGroups answers
        # UNAVAILABLE meanwhile (health is NOT_SERVING too).
        self.unavailable = ""
        self.counters: Counter[str] = Counter()
        self.metrics: Any = None  # astra.raas.metrics.RaasMetrics when /metrics is served
        # What it holds at start: (0, "") is the weights it was started with, which are none
        # of the trainer's versions until a LoadWeights names them (counter AND identity).
        start = initial_versions if initial_versions is not None else {}
        self._versions = {
            p: VersionSpec(start[p], str(start[p])) if p in start else VersionSpec(0, "")
            for p in backend.policy_ids
        }
        self._tasks: dict[str, asyncio.Task] = {}
        self._load_lock = asyncio.Lock()
        if hasattr(backend, "on_swapped"):
            backend.on_swapped = self._swapped
        self._load_requests: dict[str, tuple[tuple, pb.LoadWeightsResponse]] = {}

    # ----- what the Registrar reports --------------------------------------------------------

    @property
    def loaded_versions(self) -> dict[str, int]:
        return {p: v.version for p, v in self._versions.items()}

    @property
    def loaded_version_ids(self) -> dict[str, str]:
        return {p: v.version_id for p, v in self._versions.items()}

    @property
    def free_slots(self) -> int:
        return self.store.free_slots

    @property
    def pending_results(self) -> int:
        return self.store.pending

    def _version_protos(self) -> list[version_pb2.PolicyVersion]:
        return [
            version_pb2.PolicyVersion(policy_id=p, version=v.version, version_id=v.version_id)
            for p, v in sorted(self._versions.items())
        ]

    # ----- groups ----------------------------------------------------------------------------

    async def _run(self, spec: GroupSpec, versions: dict[str, int]) -> None:
        started, failed = time.perf_counter(), True
        try:
            trajectories = await self.backend.generate(spec, versions)
            # Once, as the wire bytes of its CollectResultsResponse (field 1: result): every
            # CollectResults sends these bytes.
            payload = group_result_bytes(spec.group_id, self.instance_id, trajectories, field=1)
            failed = False
        except Exception as exc:
            log.warning("group %s failed: %s: %s", spec.group_id, type(exc).__name__, exc)
            self.counters["groups_failed"] += 1
            payload = self._failed(spec, code_pb2.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            if self._tasks.get(spec.group_id) is asyncio.current_task():
                del self._tasks[spec.group_id]
        if len(payload) > self.max_result_bytes:
            # Never deliverable (one group per CollectResults message): it would block every
            # result after it. Delivered as the group's failure instead, and counted.
            log.error("group %s: result of %d bytes exceeds the %d-byte message limit",
                      spec.group_id, len(payload), self.max_result_bytes)  # fmt: skip
            self.counters["results_too_large"] += 1
            size, failed = len(payload), True
            payload = self._failed(
                spec,
                code_pb2.RESOURCE_EXHAUSTED,
                f"result of {size} bytes exceeds the {self.max_result_bytes}-byte "
                "message limit: fewer samples or tokens per group",
            )
        if self.metrics is not None:
            self.metrics.observe_group(spec.workflow, time.perf_counter() - started, failed)
        self.store.finish(spec.group_id, payload)

    def _failed(self, spec: GroupSpec, code: int, message: str) -> bytes:
        """The CollectResultsResponse bytes of a group that failed as a whole."""
        result = rollout_pb2.GroupResult(group_id=spec.group_id, instance_id=self.instance_id)
        result.error.CopyFrom(status_pb2.Status(code=code, message=message))
        return pb.CollectResultsResponse(result=result).SerializeToString()

    async def SubmitGroups(self, request: pb.SubmitGroupsRequest, context):
        if self.unavailable:
            raise Unavailable(
                f"instance {self.instance_id} cannot generate: {self.unavailable}",
                reason="ENGINE_UNAVAILABLE",
                retry_after_s=5.0,
            )
        if not 1 <= len(request.groups) <= MAX_GROUPS:
            raise invalid_field("groups", f"{len(request.groups)} groups, expected 1..{MAX_GROUPS}")
        specs, seen = [], set()
        for i, g in enumerate(request.groups):
            where = f"groups[{i}]"
            check_id(g.group_id, f"{where}.group_id", MAX_GROUP_ID)
            if g.group_id in seen:
                raise invalid_field(f"{where}.group_id", f"{g.group_id!r} twice in one request")
            seen.add(g.group_id)
            check_bounds(g, where)  # sizes first: nothing looks a long name up
            if g.workflow not in self.backend.workflows:
                raise invalid_field(
                    f"{where}.workflow",
                    f"unknown workflow {g.workflow!r}",
                    reason="UNKNOWN_WORKFLOW",
                )
            if not g.policy_ids:
                raise invalid_field(f"{where}.policy_ids", "at least one policy is required")
            if len(g.policy_ids) > MAX_POLICIES or len(set(g.policy_ids)) != len(g.policy_ids):
                raise invalid_field(
                    f"{where}.policy_ids", f"1-{MAX_POLICIES} policies, each listed once"
                )
            for j, p in enumerate(g.policy_ids):
                if p not in self.backend.policy_ids:
                    raise invalid_field(
                        f"{where}.policy_ids[{j}]", f"unknown policy {p!r}", reason="UNKNOWN_POLICY"
                    )
            if not 1 <= g.num_samples <= min(MAX_SAMPLES, self.capacity):
                raise invalid_field(
                    f"{where}.num_samples",
                    f"{g.num_samples} outside 1..{min(MAX_SAMPLES, self.capacity)} (capacity)",
                )
            if g.sampling_params.max_new_tokens < 1:
                raise invalid_field(f"{where}.sampling_params.max_new_tokens", "must be >= 1")
            check_reward = getattr(self.backend, "check_reward", None)
            if check_reward is not None:
                try:
                    check_reward(g.workflow, g.reward)
                except LookupError as exc:
                    raise invalid_field(
                        f"{where}.reward", str(exc), reason="UNKNOWN_REWARD"
                    ) from exc
            specs.append(group_spec(g, where))
        admission = self.store.try_accept(
            [(s.group_id, s.num_samples) for s in specs],
            regenerate=[g.group_id for g in request.groups if g.regenerate],
        )
        versions = self.loaded_versions
        by_id = {s.group_id: s for s in specs}
        for gid in admission.new:
            self._tasks[gid] = asyncio.create_task(self._run(by_id[gid], versions))
        return pb.SubmitGroupsResponse(
            accepted_group_ids=admission.accepted, free_slots=self.store.free_slots
        )

    async def CollectResults(
        self, request: pb.CollectResultsRequest, context
    ) -> AsyncIterator[pb.CollectResultsResponse]:
        if not 1 <= request.max_groups <= MAX_COLLECT:
            raise invalid_field("max_groups", f"{request.max_groups} outside 1..{MAX_COLLECT}")
        max_wait = request.max_wait.ToNanoseconds() / 1e9
        if not 0 <= max_wait <= MAX_WAIT_S:
            raise invalid_field("max_wait", f"{max_wait}s outside 0..{MAX_WAIT_S}s")
        for response in await self.store.collect(request.max_groups, max_wait):
            yield response  # a CollectResultsResponse's wire bytes (see _run)

    async def AckResults(self, request: pb.AckResultsRequest, context):
        check_ids(request.group_ids)
        acknowledged, ignored = self.store.ack(request.group_ids)
        return pb.AckResultsResponse(acknowledged=acknowledged, ignored=ignored)

    async def CancelGroups(self, request: pb.CancelGroupsRequest, context):
        check_ids(request.group_ids)
        cancelled = self.store.cancel(request.group_ids)
        for gid in cancelled:
            task = self._tasks.pop(gid, None)
            if task is not None:
                task.cancel()
        return pb.CancelGroupsResponse(cancelled=len(cancelled))

    # ----- weights, status -------------------------------------------------------------------

    async def LoadWeights(self, request: pb.LoadWeightsRequest, context):
        if not request.versions:
            raise invalid_field("versions", "at least one version is required")
        check_id(request.weights_address, "weights_address", MAX_GROUP_ID)
        check_id(request.request_id, "request_id")
        wanted: dict[str, VersionSpec] = {}
        for i, v in enumerate(request.versions):
            where = f"versions[{i}]"
            if v.policy_id not in self.backend.policy_ids:
                raise invalid_field(
                    f"{where}.policy_id", f"unknown policy {v.policy_id!r}", reason="UNKNOWN_POLICY"
                )
            if v.policy_id in wanted:
                raise invalid_field(f"{where}.policy_id", f"{v.policy_id!r} listed twice")
            if v.version < 0:
                raise invalid_field(f"{where}.version", "must be >= 0")
            identity(v.version_id, f"{where}.version_id", required=False)
            wanted[v.policy_id] = VersionSpec(v.version, v.version_id or str(v.version))
        for p, addr in sorted(request.policy_weights_addresses.items()):
            where = f"policy_weights_addresses[{p}]"
            if p not in self.backend.policy_ids:
                raise invalid_field(where, f"unknown policy {p!r}", reason="UNKNOWN_POLICY")
            check_id(addr, where, MAX_GROUP_ID)
            if p in wanted and addr != request.weights_address:
                # This policy comes from its own WeightService; the set still switches together.
                wanted[p] = replace(wanted[p], weights_address=addr)
        # Idempotent by request_id: a retry gets the first answer (a load that failed is run
        # again); the same id with other versions is a caller's bug.
        # What is loaded, not where from: a retry may name another address for the same set.
        asked = tuple(sorted((p, s.version, s.version_id) for p, s in wanted.items()))
        known = self._load_requests.get(request.request_id)
        if known is not None and known[0] != asked:
            raise invalid_field(
                "request_id",
                f"{request.request_id!r} was used for another load",
                reason="REQUEST_ID_REUSED",
            )
        if known is not None:
            return known[1]
        if any(s.version < self._versions[p].version for p, s in wanted.items()):
            return await self._load(wanted, request.weights_address)  # the regression error
        if not any(_differs(s, self._versions[p]) for p, s in wanted.items()):
            # Already in service, by counter and identity: at once, without waiting behind a
            # running load.
            return self._remember_load(request.request_id, asked, 0)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.load_timeout_s) as limit:
                fetched = await self._load(wanted, request.weights_address)
            if self.metrics is not None:
                self.metrics.observe_load(time.perf_counter() - started, fetched)
        except TimeoutError:
            if not limit.expired():
                raise
            self.counters["weight_load_timeouts"] += 1
            wanted_txt = {p: s.version for p, s in wanted.items()}
            log.warning(
                "load %s from %s timed out after %gs; serving %s",
                wanted_txt,
                request.weights_address,
                self.load_timeout_s,
                self.loaded_versions,
            )
            raise DeadlineExceeded(
                f"loading {wanted_txt} from {request.weights_address} did not finish within "
                f"{self.load_timeout_s:g}s; serving {self.loaded_versions} (a swap the engine "
                "had already begun still completes, and GetStatus then shows it)",
                reason="LOAD_DEADLINE_EXCEEDED",
                metadata={"weights_address": request.weights_address},
            ) from None
        return self._remember_load(request.request_id, asked, fetched)

    def _swapped(self, versions: dict[str, VersionSpec]) -> None:
        """The engine serves `versions` now (even when the load call that asked timed out)."""
        newer = {
            p: s
            for p, s in versions.items()
            if s.version >= self._versions[p].version and _differs(s, self._versions[p])
        }
        if newer:
            self._versions = {**self._versions, **newer}

    def _remember_load(self, request_id: str, asked: tuple, fetched: int) -> pb.LoadWeightsResponse:
        resp = pb.LoadWeightsResponse(loaded_versions=self._version_protos(), fetched_bytes=fetched)
        self._load_requests[request_id] = (asked, resp)
        while len(self._load_requests) > MAX_LOAD_REQUESTS:
            self._load_requests.pop(next(iter(self._load_requests)))
        return resp

    async def _load(self, wanted: dict[str, VersionSpec], address: str) -> int:
        async with self._load_lock:
            for p, spec in wanted.items():
                held = self._versions[p].version
                if spec.version < held:
                    raise FailedPrecondition(
                        f"{p}: version {spec.version} is older than the {held} in service",
                        reason="VERSION_REGRESSION",
                        metadata={"policy_id": p, "held_version": str(held)},
                    )
            todo = {p: s for p, s in wanted.items() if _differs(s, self._versions[p])}
            if not todo:
                return 0
            try:
                fetched = await self.backend.load_weights(todo, address)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # the call was cancelled, or its deadline passed
                # A cancellation from inside the load must still answer the call: a handler
                # that ends in CancelledError sends no status and the caller waits it out.
                self.counters["weight_loads_failed"] += 1
                raise Unavailable(
                    f"loading {sorted(todo)} from {address} was cancelled inside the RaaS",
                    reason="LOAD_CANCELLED",
                ) from None
            # One assignment: a group submitted from now on sees the whole new set.
            self._versions = {**self._versions, **todo}
            self.counters["weight_loads"] += 1
            return fetched

    async def GetStatus(self, request: pb.GetStatusRequest, context):
        return pb.GetStatusResponse(
            instance_id=self.instance_id,
            capacity=self.capacity,
            free_slots=self.store.free_slots,
            running_groups=self.store.running,
            pending_results=self.store.pending,
            loaded_versions=self._version_protos(),
            policy_ids=self.policy_ids,
            workflows=self.workflows,
            engine=self.backend.engine,
            counters={**self.store.counters, **self.counters},
        )

    def _features(self) -> list[str]:
        engine = getattr(self.backend, "inference_engine", None)
        partial = getattr(engine, "on_swap", None) == "continue"  # sequences span a swap
        return ["cancel", "multi_policy", *(["partial_rollout"] if partial else [])]

    async def GetCapabilities(self, request: pb.GetCapabilitiesRequest, context):
        return pb.GetCapabilitiesResponse(
            capabilities=capabilities_pb2.Capabilities(
                contract_version=CONTRACT_VERSION,
                features=self._features(),
                implementation=f"astra-raas-{self.backend.engine}",
                implementation_version=__version__,
            )
        )

    async def close(self) -> None:
        """Cancels every running group (their results are not produced)."""
        tasks = list(self._tasks.values())
        self.store.cancel(list(self._tasks))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start_raas(
    backend: RolloutBackend,
    *,
    capacity: int,
    dataflow_address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    instance_id: str | None = None,
    labels: dict[str, str] | None = None,
    initial_versions: dict[str, int] | None = None,
    grace_s: float = 5.0,
    load_timeout_s: float = LOAD_TIMEOUT_S,
) -> tuple[GrpcServer, RolloutServicer, Registrar | None]:
    """Starts a RolloutService on host:port (0 = any); registers with Dataflow when given.

    Health turns SERVING once the server listens. The Registrar (None
    without `dataflow_address`) keeps trying in the background; stop it
    before the server to deregister.
    """
    servicer = RolloutServicer(
        backend, capacity, initial_versions=initial_versions, load_timeout_s=load_timeout_s
    )
    server = GrpcServer(host, port, grace_s=grace_s)
    name = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
    add = with_raw_responses(
        pb_grpc.add_RolloutServiceServicer_to_server, name, ("CollectResults",)
    )
    server.add_service(add, servicer, name)
    await server.start(serving=False)
    servicer.instance_id = instance_id or f"raas-{server.address}-{time.time_ns() // 1_000_000}"
    await server.set_serving(True)
    registrar = None
    if dataflow_address:
        registrar = Registrar(dataflow_address, servicer, server.address, labels=labels)
        registrar.start()
    return server, servicer, registrar
