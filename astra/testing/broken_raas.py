"""A deliberately broken RolloutService: Astra's real servicer with one contract rule switched off.

A test double for `astra raas check`: each entry of SWITCHES breaks one rule of
rollout_service.proto (its docstring says which) and CATCHES names the check that
must fail for it. `start_broken_raas(name)` serves the broken servicer on a real
gRPC server (127.0.0.1, port 0); the switch is applied before the service is
registered, so it may replace RPC methods as well as what they call. Never used
outside tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import grpc
import numpy as np

from astra.errors import (
    AstraError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    invalid_field,
)
from astra.raas.backend import RolloutBackend
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.raas.v1 import rollout_service_pb2_grpc as pb_grpc
from astra.servers.raas import RolloutServicer
from astra.servers.runtime import GrpcServer, with_raw_responses
from astra.testing.broken_raas_batch import BATCH_CATCHES, BATCH_SWITCHES
from astra.testing.broken_raas_loads import (
    FetchingScripted,
    allows_regression,
    forgets_request_ids,
    ids_past_vocab,
    load_accepts_empty,
    load_accepts_unknown_policy,
    load_is_ignored,
    loaded_by_counter_only,
    reload_refused,
    skips_verification,
    stamps_version_zero,
    wrap,
)
from astra.testing.broken_registrar import REGISTRATION_CATCHES, REGISTRATION_SWITCHES

Switch = Callable[[RolloutServicer, GrpcServer], None]


def never_serving(servicer, server) -> None:
    """Health stays NOT_SERVING with the model loaded (rule: SERVING once it can generate)."""
    set_serving = server.set_serving

    async def stuck(serving: bool) -> None:
        await set_serving(False)

    server.set_serving = stuck


def wrong_contract_major(servicer, server) -> None:
    """GetCapabilities reports contract 2.x for a 1.x service (rule: the major is the contract)."""
    call = servicer.GetCapabilities

    async def caps(request, context):
        out = await call(request, context)
        out.capabilities.contract_version = "2.0.0"
        return out

    servicer.GetCapabilities = caps


def free_slots_above_capacity(servicer, server) -> None:
    """GetStatus reports more free slots than capacity (rule: 0 <= free_slots <= capacity)."""
    call = servicer.GetStatus

    async def status(request, context):
        out = await call(request, context)
        out.free_slots = out.capacity + 1
        return out

    servicer.GetStatus = status


def loses_a_slot(servicer, server) -> None:
    """GetStatus never gives one slot back (rule: acknowledged groups free their slots)."""
    call = servicer.GetStatus

    async def status(request, context):
        out = await call(request, context)
        out.free_slots = min(out.free_slots, out.capacity - 1)
        return out

    servicer.GetStatus = status


def accepts_empty_submit(servicer, server) -> None:
    """SubmitGroups with no groups answers OK (rule: 1..1024 groups, else INVALID_ARGUMENT)."""
    wrap(servicer, "SubmitGroups", lambda r: pb.SubmitGroupsResponse() if not r.groups else None)


def accepts_duplicate_ids(servicer, server) -> None:
    """A group id twice in one request is admitted once (rule: INVALID_ARGUMENT)."""

    def dedupe(request):
        seen: dict[str, Any] = {g.group_id: g for g in request.groups}
        del request.groups[:]
        request.groups.extend(seen.values())

    wrap(servicer, "SubmitGroups", dedupe)


def _drops_groups(servicer, bad: Callable[[Any], bool]) -> None:
    def accept_silently(request):
        if any(bad(g) for g in request.groups):
            return pb.SubmitGroupsResponse(accepted_group_ids=[g.group_id for g in request.groups])
        return None

    wrap(servicer, "SubmitGroups", accept_silently)


def accepts_unknown_policy(servicer, server) -> None:
    """A group for a policy it does not serve is accepted, never run (rule: UNKNOWN_POLICY)."""
    _drops_groups(servicer, lambda g: any(p not in servicer.policy_ids for p in g.policy_ids))


def accepts_unknown_workflow(servicer, server) -> None:
    """A group of a workflow it does not serve is accepted (rule: UNKNOWN_WORKFLOW)."""
    _drops_groups(servicer, lambda g: g.workflow not in servicer.workflows)


def accepts_zero_max_new_tokens(servicer, server) -> None:
    """sampling_params.max_new_tokens 0 is accepted (rule: bad sampling fields are refused,
    INVALID_ARGUMENT naming the field)."""
    _drops_groups(servicer, lambda g: g.sampling_params.max_new_tokens < 1)


def names_no_field(servicer, server) -> None:
    """Refuses bad requests with an ErrorInfo that names no field (rule: the field is named)."""
    call = servicer.SubmitGroups

    async def submit(request, context):
        try:
            return await call(request, context)
        except AstraError as exc:
            if exc.reason != "INVALID_FIELD":
                raise
            raise InvalidArgument(str(exc), reason=exc.reason) from None

    servicer.SubmitGroups = submit


def ignores_capacity(servicer, server) -> None:
    """Reports its capacity but admits whatever comes (rule: over capacity RESOURCE_EXHAUSTED)."""
    store, accept = servicer.store, servicer.store.try_accept

    def admit_all(groups, **kw):
        capacity, store.capacity = store.capacity, 10**6
        try:
            return accept(groups, **kw)
        finally:
            store.capacity = capacity

    store.try_accept = admit_all


def no_retry_info(servicer, server) -> None:
    """RESOURCE_EXHAUSTED without RetryInfo (rule: the caller is told when to retry)."""
    accept = servicer.store.try_accept

    def refuse(groups, **kw):
        try:
            return accept(groups, **kw)
        except ResourceExhausted as exc:
            raise ResourceExhausted(str(exc), reason=exc.reason) from None

    servicer.store.try_accept = refuse


def no_error_info(servicer, server) -> None:
    """Errors carry no google.rpc.ErrorInfo (rule: every error names its reason)."""
    call = servicer.SubmitGroups

    async def submit(request, context):
        try:
            return await call(request, context)
        except AstraError as exc:
            await context.abort(grpc.StatusCode[exc.code], str(exc))

    servicer.SubmitGroups = submit


def accepts_long_wait(servicer, server) -> None:
    """CollectResults takes any max_wait (rule: 0..30 s, else INVALID_ARGUMENT)."""
    call = servicer.CollectResults

    async def collect(request, context):
        if request.max_wait.seconds > 30:
            request.max_wait.FromSeconds(0)
        async for out in call(request, context):
            yield out

    servicer.CollectResults = collect


def accepted_ids_missing(servicer, server) -> None:
    """SubmitGroups runs the groups but lists none as accepted (rule: accepted_group_ids)."""
    call = servicer.SubmitGroups

    async def submit(request, context):
        out = await call(request, context)
        del out.accepted_group_ids[:]
        return out

    servicer.SubmitGroups = submit


def refuses_resubmission(servicer, server) -> None:
    """A group id it holds, submitted again, is refused (rule: idempotent by group_id)."""

    def refuse(request):
        for i, g in enumerate(request.groups):
            if servicer.store.holds(g.group_id):
                raise invalid_field(f"groups[{i}].group_id", "already submitted")

    wrap(servicer, "SubmitGroups", refuse)


def fails_every_group(servicer, server) -> None:
    """Every group ends in error (rule: an accepted group's result carries its trajectories)."""

    async def generate(spec, versions):
        raise RuntimeError("engine crashed")

    servicer.backend.generate = generate


def short_logprobs(servicer, server) -> None:
    """Each sequence one log-prob short of its tokens (rule: len(logprobs) == completion)."""
    generate = servicer.backend.generate

    async def short(spec, versions):
        out = await generate(spec, versions)
        return [
            replace(t, sequences=[replace(s, logprobs=s.logprobs[:-1]) for s in t.sequences])
            for t in out
        ]

    servicer.backend.generate = short


def _edit_sequences(servicer, edit: Callable[[Any], None]) -> None:
    """Rewrites every sequence of every finished result with `edit(Sequence message)`."""
    finish = servicer.store.finish

    def edited(group_id: str, payload: bytes) -> bool:
        msg = pb.CollectResultsResponse.FromString(payload)
        for t in msg.result.trajectories:
            for seq in t.sequences:
                edit(seq)
        return finish(group_id, msg.SerializeToString())

    servicer.store.finish = edited


def no_finish_reason(servicer, server) -> None:
    """Sequences with finish_reason unset (rule: STOP, LENGTH or ABORTED on every sequence)."""
    _edit_sequences(servicer, lambda seq: setattr(seq, "finish_reason", 0))


def no_prompt_tokens(servicer, server) -> None:
    """Sequences without their prompt's tokens (rule: token_ids start with the prompt's ids)."""
    _edit_sequences(servicer, lambda seq: setattr(seq, "prompt_length", 0))


def _fill(array, value: int) -> None:
    array.data = np.full(list(array.shape), value, dtype=array.dtype).tobytes()


def trains_on_the_prompt(servicer, server) -> None:
    """loss_mask 1 on every token, the prompt's too (rule: 1 exactly on generated tokens)."""
    _edit_sequences(servicer, lambda seq: _fill(seq.loss_mask, 1))


def unversioned_tokens(servicer, server) -> None:
    """Generated tokens carry version -1 (rule: a trained token carries a version >= 0)."""
    _edit_sequences(servicer, lambda seq: _fill(seq.weight_versions, -1))


def forgets_unacknowledged(servicer, server) -> None:
    """Drops a result once collected, before AckResults (rule: repeated until acknowledged)."""
    store, collect = servicer.store, servicer.store.collect

    async def once(max_groups: int, max_wait_s: float) -> list:
        out = await collect(max_groups, max_wait_s)
        store.ack([gid for gid, payload in list(store._finished.items()) if payload in out])
        return out

    store.collect = once


def miscounts_ack(servicer, server) -> None:
    """AckResults removes the results but reports them ignored (rule: acknowledged counts)."""
    store, ack = servicer.store, servicer.store.ack

    def wrong(ids):
        acknowledged, ignored = ack(ids)
        return 0, acknowledged + ignored

    store.ack = wrong


def keeps_acknowledged(servicer, server) -> None:
    """Answers AckResults but keeps the results (rule: AckResults removes them)."""
    store = servicer.store
    store.ack = lambda ids: (sum(g in store._finished for g in ids), 0)


def _refuses_unknown(servicer, method: str) -> None:
    def refuse(request):
        unknown = [g for g in request.group_ids if not servicer.store.holds(g)]
        if unknown:
            raise NotFound(f"unknown group ids {unknown}", reason="UNKNOWN_GROUP")

    wrap(servicer, method, refuse)


def ack_refuses_unknown_ids(servicer, server) -> None:
    """AckResults with an id it never held is NOT_FOUND (rule: unknown ids are ignored, OK)."""
    _refuses_unknown(servicer, "AckResults")


def cancel_refuses_unknown_ids(servicer, server) -> None:
    """CancelGroups with an unknown id is NOT_FOUND (rule: unknown ids are ignored, OK)."""
    _refuses_unknown(servicer, "CancelGroups")


def cancel_keeps_running(servicer, server) -> None:
    """CancelGroups reports groups cancelled yet they run on (rule: no result after a cancel)."""

    def pretend(request):
        return pb.CancelGroupsResponse(
            cancelled=sum(servicer.store.is_running(g) for g in request.group_ids)
        )

    wrap(servicer, "CancelGroups", pretend)


def collect_accepts_zero_max_groups(servicer, server) -> None:
    """Takes CollectResults' max_groups 0 as a default of 1 (rule: 0 is INVALID_ARGUMENT,
    field max_groups: the field is required)."""
    collect = servicer.CollectResults

    async def lenient(request, context):
        if request.max_groups == 0:
            request = pb.CollectResultsRequest(max_groups=1, max_wait=request.max_wait)
        async for message in collect(request, context):
            yield message

    servicer.CollectResults = lenient


def cancel_drops_finished(servicer, server) -> None:
    """CancelGroups also drops finished, unacknowledged results and counts them cancelled
    (rule: only running groups are cancelled; a finished one keeps its result)."""
    cancel = servicer.groups.cancel

    def dropping(group_ids):
        acknowledged, _ = servicer.store.ack(list(group_ids))
        return cancel(group_ids) + acknowledged

    servicer.groups.cancel = dropping


SWITCHES: dict[str, Switch] = {
    f.__name__: f
    for f in (
        never_serving,
        wrong_contract_major,
        free_slots_above_capacity,
        accepts_empty_submit,
        accepts_duplicate_ids,
        accepts_unknown_policy,
        accepts_unknown_workflow,
        accepts_zero_max_new_tokens,
        names_no_field,
        no_error_info,
        ignores_capacity,
        no_retry_info,
        accepts_long_wait,
        accepted_ids_missing,
        refuses_resubmission,
        fails_every_group,
        short_logprobs,
        no_finish_reason,
        no_prompt_tokens,
        trains_on_the_prompt,
        unversioned_tokens,
        forgets_unacknowledged,
        miscounts_ack,
        keeps_acknowledged,
        ack_refuses_unknown_ids,
        cancel_refuses_unknown_ids,
        cancel_keeps_running,
        load_accepts_empty,
        load_accepts_unknown_policy,
        load_is_ignored,
        loaded_by_counter_only,
        allows_regression,
        reload_refused,
        forgets_request_ids,
        stamps_version_zero,
        ids_past_vocab,
        skips_verification,
        loses_a_slot,
        collect_accepts_zero_max_groups,
        cancel_drops_finished,
        *BATCH_SWITCHES,
    )
} | REGISTRATION_SWITCHES

# The check of `astra raas check` that must fail for each switch.
CATCHES: dict[str, str] = {
    "never_serving": "health",
    "wrong_contract_major": "capabilities",
    "free_slots_above_capacity": "status",
    "accepts_empty_submit": "submit_rejects_empty",
    "accepts_duplicate_ids": "submit_rejects_duplicate_ids",
    "accepts_unknown_policy": "submit_rejects_unknown_policy",
    "accepts_unknown_workflow": "submit_rejects_unknown_workflow",
    "accepts_zero_max_new_tokens": "submit_rejects_bad_sampling",
    "names_no_field": "submit_rejects_bad_sampling",
    "no_error_info": "submit_rejects_empty",
    "ignores_capacity": "submit_refuses_over_capacity",
    "no_retry_info": "submit_refuses_over_capacity",
    "accepts_long_wait": "collect_rejects_long_wait",
    "accepted_ids_missing": "submit",
    "refuses_resubmission": "submit_is_idempotent",
    "fails_every_group": "collect",
    "short_logprobs": "collect",
    "no_finish_reason": "trajectories_are_well_formed",
    "no_prompt_tokens": "trajectories_are_well_formed",
    "trains_on_the_prompt": "trajectories_are_well_formed",
    "unversioned_tokens": "trajectories_are_well_formed",
    "forgets_unacknowledged": "collect_repeats_until_ack",
    "miscounts_ack": "ack",
    "keeps_acknowledged": "ack_removes_the_result",
    "ack_refuses_unknown_ids": "ack_ignores_unknown_ids",
    "cancel_refuses_unknown_ids": "cancel",
    "cancel_keeps_running": "cancel",
    "load_accepts_empty": "load_weights_rejects_bad_requests",
    "load_accepts_unknown_policy": "load_weights_rejects_bad_requests",
    "load_is_ignored": "load_weights",
    "allows_regression": "load_weights_refuses_regression",
    "reload_refused": "load_weights_is_idempotent",
    "forgets_request_ids": "load_weights_refuses_reused_request_id",
    "stamps_version_zero": "tokens_carry_the_loaded_version",
    "ids_past_vocab": "tokens_within_the_vocabulary",
    "skips_verification": "load_weights_refuses_corrupt_data",
    "loses_a_slot": "settles",
    "collect_accepts_zero_max_groups": "collect_rejects_zero_max_groups",
    "cancel_drops_finished": "cancel_keeps_a_finished_result",
    "loaded_by_counter_only": "load_weights_matches_by_identity",
    **BATCH_CATCHES,
    **REGISTRATION_CATCHES,
}


async def start_broken_raas(
    switch: str, backend: RolloutBackend | None = None, *, capacity: int = 4
) -> tuple[GrpcServer, RolloutServicer]:
    """Astra's RolloutService with SWITCHES[switch] applied ("" for none), on 127.0.0.1:0.
    A registration switch applies when it registers (broken_registrar.start_registering)."""
    if switch and switch not in SWITCHES:
        raise ValueError(f"unknown switch {switch!r}; one of {sorted(SWITCHES)}")
    servicer = RolloutServicer(backend or FetchingScripted(delay_s=0.05), capacity)
    server = GrpcServer("127.0.0.1", 0, grace_s=0.0)
    if switch:
        SWITCHES[switch](servicer, server)
    name = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
    add = with_raw_responses(
        pb_grpc.add_RolloutServiceServicer_to_server, name, ("CollectResults", "CollectResultBatch")
    )
    server.add_service(add, servicer, name)
    await server.start(serving=False)
    servicer.instance_id = f"broken-raas-{switch or 'none'}-{server.address}"
    await server.set_serving(True)
    return server, servicer
