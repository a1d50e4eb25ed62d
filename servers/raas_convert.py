"""RolloutService wire <-> domain: prompt groups and weight loads in, with validation;
a failed group's result and GetStatus out.

Field names in errors are wire names, so a RaaS in any language reports the same fields.
Requests are checked against what the backend serves (workflows, policies, rewards) and
its capacity; nothing here runs, admits or loads anything.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from google.protobuf import json_format
from google.rpc import code_pb2, status_pb2

from astra import __version__
from astra.common.arrays import Malformed, from_array
from astra.common.v1 import capabilities_pb2, rollout_pb2, version_pb2
from astra.engine.validate import MIN_TEMPERATURE
from astra.errors import invalid_field
from astra.raas.backend import GroupSpec, RolloutBackend, VersionSpec
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.servers.checks import check_id
from astra.servers.weights_convert import identity

MAX_IDS = 4096
MAX_GROUPS, MAX_SAMPLES = 1024, 1024
MAX_GROUP_ID = 256
MAX_POLICIES = 64
CONTRACT_VERSION = "1.0.0"
MAX_COLLECT = 4096  # groups per CollectResults
MAX_WAIT_S = 30.0  # CollectResults' longest wait


def check_ids(ids, field: str = "group_ids") -> None:
    if not 1 <= len(ids) <= MAX_IDS:
        raise invalid_field(field, f"{len(ids)} ids, expected 1..{MAX_IDS}")


MAX_NAME = 128  # workflow and reward names
MAX_PROMPT_BYTES = 1 << 20
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKENS = 64, 1024, 1024


def check_bounds(g: rollout_pb2.PromptGroup, where: str) -> None:
    """The size bounds rollout.proto states for a PromptGroup's fields."""
    if len(g.workflow) > MAX_NAME:
        raise invalid_field(f"{where}.workflow", f"longer than {MAX_NAME} characters")
    if len(g.reward) > MAX_NAME:
        raise invalid_field(f"{where}.reward", f"longer than {MAX_NAME} characters")
    if len(g.prompt.text.encode()) > MAX_PROMPT_BYTES:
        raise invalid_field(f"{where}.prompt.text", "longer than 1 MiB")
    sp = g.sampling_params
    at = f"{where}.sampling_params"
    if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        raise invalid_field(f"{at}.temperature", "must be finite and >= 0")
    if 0 < sp.temperature < MIN_TEMPERATURE:  # logits / temperature would overflow
        raise invalid_field(f"{at}.temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}")
    if not 0 <= sp.top_p <= 1:
        raise invalid_field(f"{at}.top_p", "must be in (0, 1] (0 means 1)")
    if sp.top_k < 0:
        raise invalid_field(f"{at}.top_k", "must be >= 0 (0 = no limit)")
    if any(t < 0 for t in sp.stop_token_ids):
        raise invalid_field(f"{at}.stop_token_ids", "token ids must be >= 0")
    if len(sp.stop_strings) > MAX_STOP_STRINGS:
        raise invalid_field(f"{at}.stop_strings", f"more than {MAX_STOP_STRINGS} strings")
    for i, s in enumerate(sp.stop_strings):
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise invalid_field(f"{at}.stop_strings[{i}]", f"must be 1-{MAX_STOP_CHARS} characters")
    if len(sp.stop_token_ids) > MAX_STOP_TOKENS:
        raise invalid_field(f"{at}.stop_token_ids", f"more than {MAX_STOP_TOKENS} ids")


def group_spec(g: rollout_pb2.PromptGroup, where: str) -> GroupSpec:
    sp = g.sampling_params
    tokens = None
    if g.prompt.HasField("token_ids"):
        try:
            tokens = from_array(g.prompt.token_ids, f"{where}.prompt.token_ids")
        except Malformed as exc:
            raise invalid_field(f"{where}.prompt.token_ids", str(exc)) from exc
        if tokens.ndim != 1 or tokens.dtype.kind != "i":
            raise invalid_field(f"{where}.prompt.token_ids", "must be a 1-D integer array")
    data = {}
    if g.prompt.HasField("data"):
        try:
            data = json_format.MessageToDict(g.prompt.data)
        except ValueError as exc:  # NaN or an infinity: not a JSON record
            raise invalid_field(f"{where}.prompt.data", str(exc)) from exc
    return GroupSpec(
        group_id=g.group_id,
        workflow=g.workflow,
        policy_ids=tuple(g.policy_ids),
        num_samples=g.num_samples,
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        stop_strings=tuple(sp.stop_strings),
        stop_token_ids=tuple(sp.stop_token_ids),
        seed=sp.seed,
        prompt_text=g.prompt.text,
        prompt_token_ids=tokens,
        data=data,
        reward=g.reward,
        epoch=g.epoch,
    )


def group_specs(groups, backend: RolloutBackend, capacity: int) -> list[GroupSpec]:
    """A SubmitGroupsRequest's groups as GroupSpecs, each checked against `backend`."""
    if not 1 <= len(groups) <= MAX_GROUPS:
        raise invalid_field("groups", f"{len(groups)} groups, expected 1..{MAX_GROUPS}")
    specs, seen = [], set()
    for i, g in enumerate(groups):
        where = f"groups[{i}]"
        check_id(g.group_id, f"{where}.group_id", MAX_GROUP_ID)
        if g.group_id in seen:
            raise invalid_field(f"{where}.group_id", f"{g.group_id!r} twice in one request")
        seen.add(g.group_id)
        check_bounds(g, where)  # sizes first: nothing looks a long name up
        if g.workflow not in backend.workflows:
            raise invalid_field(
                f"{where}.workflow", f"unknown workflow {g.workflow!r}", reason="UNKNOWN_WORKFLOW"
            )
        if not g.policy_ids:
            raise invalid_field(f"{where}.policy_ids", "at least one policy is required")
        if len(g.policy_ids) > MAX_POLICIES or len(set(g.policy_ids)) != len(g.policy_ids):
            raise invalid_field(
                f"{where}.policy_ids", f"1-{MAX_POLICIES} policies, each listed once"
            )
        for j, p in enumerate(g.policy_ids):
            if p not in backend.policy_ids:
                raise invalid_field(
                    f"{where}.policy_ids[{j}]", f"unknown policy {p!r}", reason="UNKNOWN_POLICY"
                )
        most = min(MAX_SAMPLES, capacity)
        if not 1 <= g.num_samples <= most:
            raise invalid_field(
                f"{where}.num_samples", f"{g.num_samples} outside 1..{most} (capacity)"
            )
        if g.sampling_params.max_new_tokens < 1:
            raise invalid_field(f"{where}.sampling_params.max_new_tokens", "must be >= 1")
        check_reward = getattr(backend, "check_reward", None)
        if check_reward is not None:
            try:
                check_reward(g.workflow, g.reward)
            except LookupError as exc:
                raise invalid_field(f"{where}.reward", str(exc), reason="UNKNOWN_REWARD") from exc
        specs.append(group_spec(g, where))
    return specs


def load_versions(request, policy_ids) -> dict[str, VersionSpec]:
    """A LoadWeightsRequest's versions by policy, each with the address it comes from when
    that is not `request.weights_address`; ids and policies checked."""
    if not request.versions:
        raise invalid_field("versions", "at least one version is required")
    check_id(request.weights_address, "weights_address", MAX_GROUP_ID)
    check_id(request.request_id, "request_id")
    wanted: dict[str, VersionSpec] = {}
    for i, v in enumerate(request.versions):
        where = f"versions[{i}]"
        if v.policy_id not in policy_ids:
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
        if p not in policy_ids:
            raise invalid_field(where, f"unknown policy {p!r}", reason="UNKNOWN_POLICY")
        check_id(addr, where, MAX_GROUP_ID)
        if p in wanted and addr != request.weights_address:
            # This policy comes from its own WeightService; the set still switches together.
            wanted[p] = replace(wanted[p], weights_address=addr)
    return wanted


def failed_group_bytes(group_id: str, instance_id: str, code: str, message: str) -> bytes:
    """The CollectResultsResponse bytes of a group that failed as a whole (`code`: a
    google.rpc.Code name)."""
    result = rollout_pb2.GroupResult(group_id=group_id, instance_id=instance_id)
    result.error.CopyFrom(status_pb2.Status(code=code_pb2.Code.Value(code), message=message))
    return pb.CollectResultsResponse(result=result).SerializeToString()


def collect_limits(request: pb.CollectResultsRequest) -> tuple[int, float]:
    """(max_groups, max_wait in seconds) of a CollectResults, each within its bounds."""
    if not 1 <= request.max_groups <= MAX_COLLECT:
        raise invalid_field("max_groups", f"{request.max_groups} outside 1..{MAX_COLLECT}")
    max_wait = request.max_wait.ToNanoseconds() / 1e9
    if not 0 <= max_wait <= MAX_WAIT_S:
        raise invalid_field("max_wait", f"{max_wait}s outside 0..{MAX_WAIT_S}s")
    return request.max_groups, max_wait


def within(results: list[Any], limit: int) -> list[Any]:
    """The leading `results` whose sizes add up to at most `limit` bytes (the first always,
    which its own limit bounds): what one CollectResultBatch response carries."""
    total = 0
    for i, r in enumerate(results):
        total += len(r)
        if total > limit and i:
            return results[:i]
    return results


def version_protos(held: dict) -> list[version_pb2.PolicyVersion]:
    """The versions an instance holds, policy by policy (LoadWeights, GetStatus)."""
    return [
        version_pb2.PolicyVersion(policy_id=p, version=v.version, version_id=v.version_id)
        for p, v in sorted(held.items())
    ]


def capabilities(backend: RolloutBackend) -> capabilities_pb2.Capabilities:
    engine = getattr(backend, "inference_engine", None)
    partial = getattr(engine, "on_swap", None) == "continue"  # sequences span a swap
    return capabilities_pb2.Capabilities(
        contract_version=CONTRACT_VERSION,
        features=["cancel", "multi_policy", *(["partial_rollout"] if partial else [])],
        implementation=f"astra-raas-{backend.engine}",
        implementation_version=__version__,
    )


def forward(name: str, *owners: str) -> property:
    """A servicer property: `self.<name>` reads `self.<owners[0]>.<name>` and sets it on every
    owner (state the Registrar, metrics and tests read and set through the servicer)."""

    def put(self, value) -> None:
        for owner in owners:
            setattr(getattr(self, owner), name, value)

    return property(lambda self: getattr(getattr(self, owners[0]), name), put)


def status_response(servicer: Any) -> pb.GetStatusResponse:
    """GetStatus of a RolloutServicer: its slots, results, versions and counters (the
    backend's own, such as samples and weight swaps and their pause, under the servicer's)."""
    store = servicer.store
    return pb.GetStatusResponse(
        instance_id=servicer.instance_id,
        capacity=servicer.capacity,
        free_slots=store.free_slots,
        running_groups=store.running,
        pending_results=store.pending,
        loaded_versions=version_protos(servicer.versions.held),
        policy_ids=servicer.policy_ids,
        workflows=servicer.workflows,
        engine=servicer.backend.engine,
        counters={
            **getattr(servicer.backend, "counters", {}),
            **store.counters,
            **servicer.counters,
        },
    )
