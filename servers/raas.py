"""RolloutService servicer: requests to domain calls (astra.raas), answers back to the wire.

Requests are validated and converted by astra.servers.raas_convert; groups run in an
astra.raas.groups.GroupRunner, whose results are the wire bytes of a
CollectResultsResponse (a failed group carries `error`); versions and LoadWeights'
rules are astra.raas.versions.WeightVersions'. Domain errors are mapped to statuses by
the server's interceptor. Never generates, admits or loads anything itself.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator

from astra.raas.backend import RolloutBackend
from astra.raas.groups import GroupRunner
from astra.raas.results import ResultStore
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.raas.v1 import rollout_service_pb2_grpc as pb_grpc
from astra.raas.versions import WeightVersions
from astra.servers.raas_convert import (
    capabilities,
    check_ids,
    collect_limits,
    failed_group_bytes,
    forward,
    group_specs,
    load_versions,
    status_response,
    version_protos,
    within,
)
from astra.servers.result_wire import group_result_bytes
from astra.servers.runtime import DEFAULT_MAX_MESSAGE_BYTES

# A CollectResultBatch response stays this far below the send limit.
BATCH_BYTES = DEFAULT_MAX_MESSAGE_BYTES - 64 * 1024

# A LoadWeights (waiting for an earlier one, fetching, swapping) ends by then with
# DEADLINE_EXCEEDED and the versions in service unchanged; Dataflow's call allows more.
LOAD_TIMEOUT_S = 300.0


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
        self.backend, self.capacity, self.instance_id = backend, capacity, instance_id
        self.incarnation = uuid.uuid4().hex  # this process (RegisterInstanceRequest.incarnation)
        self.policy_ids, self.workflows = list(backend.policy_ids), list(backend.workflows)
        self.store = ResultStore(capacity)
        self.counters: Counter[str] = Counter()
        self.groups = GroupRunner(
            backend,
            self.store,
            # A result is stored once, as its CollectResultsResponse (field 1: result) bytes.
            encode=lambda spec, out: group_result_bytes(
                spec.group_id, self.instance_id, out, field=1
            ),
            encode_failure=lambda spec, code, message: failed_group_bytes(
                spec.group_id, self.instance_id, code, message
            ),
            # The largest GroupResult a message can carry (the send limit less its framing).
            max_result_bytes=DEFAULT_MAX_MESSAGE_BYTES - 64 * 1024,
            counters=self.counters,
            instance=lambda: self.instance_id,
        )
        self.versions = WeightVersions(
            backend,
            initial_versions=initial_versions,
            timeout_s=load_timeout_s,
            counters=self.counters,
        )
        if hasattr(backend, "on_swapped"):
            backend.on_swapped = self.versions.swapped

    # ----- state the Registrar, metrics and tests read (and set) -----------------------------

    # Why groups cannot run here (the engine failed), or "": SubmitGroups is UNAVAILABLE.
    unavailable = forward("unavailable", "groups")
    max_result_bytes = forward("max_result_bytes", "groups")
    metrics = forward("metrics", "groups", "versions")  # a RaasMetrics when /metrics is served

    @property
    def loaded_versions(self) -> dict[str, int]:
        return self.versions.numbers

    @property
    def loaded_version_ids(self) -> dict[str, str]:
        return {p: v.version_id for p, v in self.versions.held.items()}

    @property
    def free_slots(self) -> int:
        return self.store.free_slots

    @property
    def pending_results(self) -> int:
        return self.store.pending

    # ----- RPCs ---------------------------------------------------------------------------------

    async def SubmitGroups(self, request: pb.SubmitGroupsRequest, context):
        self.groups.check_available()
        specs = group_specs(request.groups, self.backend, self.capacity)
        regenerate = [g.group_id for g in request.groups if g.regenerate]
        accepted = self.groups.submit(specs, regenerate, self.loaded_versions)
        return pb.SubmitGroupsResponse(accepted_group_ids=accepted, free_slots=self.free_slots)

    async def CollectResults(
        self, request: pb.CollectResultsRequest, context
    ) -> AsyncIterator[pb.CollectResultsResponse]:
        max_groups, max_wait = collect_limits(request)
        for response in await self.store.collect(max_groups, max_wait):
            yield response  # a CollectResultsResponse's wire bytes (see encode above)

    async def CollectResultBatch(self, request: pb.CollectResultBatchRequest, context) -> bytes:
        acks = request.ack_group_ids
        if acks:
            check_ids(acks, "ack_group_ids")
        max_groups, max_wait = collect_limits(request)  # checked before anything is dropped
        if acks:
            self.store.ack(acks)
        # The stored bytes are CollectResultsResponse messages, whose `result` (1) has the
        # framing of CollectResultBatchResponse.results (1): joined, they are the response.
        return b"".join(within(await self.store.collect(max_groups, max_wait), BATCH_BYTES))

    async def AckResults(self, request: pb.AckResultsRequest, context):
        check_ids(request.group_ids)
        acknowledged, ignored = self.store.ack(request.group_ids)
        return pb.AckResultsResponse(acknowledged=acknowledged, ignored=ignored)

    async def CancelGroups(self, request: pb.CancelGroupsRequest, context):
        check_ids(request.group_ids)
        return pb.CancelGroupsResponse(cancelled=self.groups.cancel(request.group_ids))

    async def LoadWeights(self, request: pb.LoadWeightsRequest, context):
        wanted = load_versions(request, self.backend.policy_ids)
        done = await self.versions.load(wanted, request.weights_address, request.request_id)
        return pb.LoadWeightsResponse(
            loaded_versions=version_protos(done.versions), fetched_bytes=done.fetched_bytes
        )

    async def GetStatus(self, request: pb.GetStatusRequest, context):
        return status_response(self)

    async def GetCapabilities(self, request: pb.GetCapabilitiesRequest, context):
        return pb.GetCapabilitiesResponse(capabilities=capabilities(self.backend))

    async def close(self) -> None:
        """Cancels every running group (their results are not produced)."""
        await self.groups.close()
