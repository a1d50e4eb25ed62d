"""DataflowService request checks: each field of a request validated by its wire name.

A request that fails is answered INVALID_ARGUMENT naming the field (astra.errors.invalid_field)
before anything reaches the coordinator; what passes is handed on as plain Python values.
Shapes only: no decision about the run is made here.
"""

from __future__ import annotations

import re

from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.errors import invalid_field
from astra.servers.checks import MAX_ID_CHARS, check_id
from astra.servers.weights_convert import identity

MAX_LIST = 256
MAX_LABEL_VALUE = 1024
MAX_UNTRAINED_REASON = 64
UNTRAINED_REASON = re.compile(rf"[A-Za-z0-9_]{{0,{MAX_UNTRAINED_REASON}}}")
DEFAULT_MAX_WAIT_S = 10.0


def _check_list(values, field: str) -> None:
    if len(values) > MAX_LIST:
        raise invalid_field(field, f"more than {MAX_LIST} entries")
    for i, v in enumerate(values):
        check_id(v, f"{field}[{i}]")


def _short(value: str, field: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise invalid_field(field, f"longer than {MAX_ID_CHARS} characters")


def versions(items) -> tuple[dict[str, int], dict[str, str]]:
    """(counter, identity) per policy claimed: an empty identity is the counter's decimal
    form (the default identity), except with version 0, where it is the weights the
    instance was started with (RegisterInstanceRequest.loaded_versions)."""
    if len(items) > MAX_LIST:
        raise invalid_field("loaded_versions", f"more than {MAX_LIST} entries")
    counters, ids = {}, {}
    for i, v in enumerate(items):
        check_id(v.policy_id, f"loaded_versions[{i}].policy_id")
        identity(v.version_id, f"loaded_versions[{i}].version_id", required=False)
        if v.version < 0:
            raise invalid_field(f"loaded_versions[{i}].version", "must be >= 0")
        counters[v.policy_id] = v.version
        ids[v.policy_id] = v.version_id or (str(v.version) if v.version else "")
    return counters, ids


def check_register(request: pb.RegisterInstanceRequest) -> None:
    check_id(request.instance_id, "instance_id")
    check_id(request.address, "address")
    if request.capacity < 1:
        raise invalid_field("capacity", "must be >= 1")
    if not request.policy_ids:
        raise invalid_field("policy_ids", "at least one policy is required")
    _check_list(request.policy_ids, "policy_ids")
    if not request.workflows:
        raise invalid_field("workflows", "at least one workflow is required")
    _check_list(request.workflows, "workflows")
    if len(request.labels) > MAX_LIST:
        raise invalid_field("labels", f"more than {MAX_LIST} labels")
    for key, value in request.labels.items():
        check_id(key, "labels")
        if len(value) > MAX_LABEL_VALUE:
            raise invalid_field(f"labels[{key}]", f"longer than {MAX_LABEL_VALUE} characters")
    _short(request.contract_version, "contract_version")
    _short(request.incarnation, "incarnation")


def check_heartbeat(request: pb.HeartbeatInstanceRequest) -> None:
    check_id(request.instance_id, "instance_id")
    if request.free_slots < 0:
        raise invalid_field("free_slots", "must be >= 0")
    if request.pending_results < 0:
        raise invalid_field("pending_results", "must be >= 0")


def check_fetch(request: pb.FetchBatchRequest) -> float:
    """Returns the longest wait for data, in seconds."""
    check_id(request.policy_id, "policy_id")
    max_wait = (
        request.max_wait.ToNanoseconds() / 1e9
        if request.HasField("max_wait")
        else DEFAULT_MAX_WAIT_S
    )
    if max_wait < 0:
        raise invalid_field("max_wait", "must not be negative")
    if request.trainer_version < 0:
        raise invalid_field("trainer_version", "must not be negative")
    _short(request.trainer_id, "trainer_id")
    return max_wait


def check_ack(request: pb.AckBatchRequest) -> None:
    check_id(request.batch_id, "batch_id")
    if not UNTRAINED_REASON.fullmatch(request.untrained_reason):
        raise invalid_field(
            "untrained_reason",
            f"at most {MAX_UNTRAINED_REASON} letters, digits and underscores",
        )


def check_announce(request: pb.AnnounceVersionRequest) -> int | None:
    """Returns the version the trainer resumed from, if it said."""
    v = request.version
    check_id(v.policy_id, "version.policy_id")
    identity(v.version_id, "version.version_id", required=False)  # the RaaS loads it
    check_id(request.weights_address, "weights_address")
    _short(request.trainer_id, "trainer_id")
    if request.resumed_from_version < 0:
        raise invalid_field("resumed_from_version", "must be >= 0")
    return request.resumed_from_version if request.HasField("resumed_from_version") else None
