"""The broken RolloutService's CollectResultBatch switches.

Part of astra.testing.broken_raas (its SWITCHES and CATCHES tables name these too): each
function breaks one CollectResultBatch rule of rollout_service.proto, as its docstring says,
by rewriting the request before Astra's own servicer answers it or by acting on its answer.
Never used outside tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from astra.raas.v1 import rollout_service_pb2 as pb
from astra.servers.raas import RolloutServicer


def _rewrite(servicer: RolloutServicer, edit: Callable[[Any], None]) -> None:
    """CollectResultBatch answers `edit(request)` instead of the request that came."""
    call = servicer.CollectResultBatch

    async def edited(request, context) -> bytes:
        edit(request)
        return await call(request, context)

    servicer.CollectResultBatch = edited  # type: ignore[method-assign]


def batch_accepts_zero_max_groups(servicer, server) -> None:
    """Takes CollectResultBatch's max_groups 0 as 1 (rule: 1-4096, else INVALID_ARGUMENT
    INVALID_FIELD naming max_groups)."""

    def default(request) -> None:
        request.max_groups = request.max_groups or 1

    _rewrite(servicer, default)


def batch_returns_at_once(servicer, server) -> None:
    """Answers at once, empty when none is ready (rule: with none ready a call waits up to
    max_wait for one)."""

    def at_once(request) -> None:
        if request.max_wait.seconds <= 30:  # a wait out of bounds is still refused
            request.max_wait.FromSeconds(0)

    _rewrite(servicer, at_once)


def batch_ignores_max_groups(servicer, server) -> None:
    """Answers every pending result whatever max_groups says (rule: at most max_groups)."""

    def every(request) -> None:
        if 1 <= request.max_groups <= 4096:  # one out of bounds is still refused
            request.max_groups = 4096

    _rewrite(servicer, every)


def batch_ignores_acks(servicer, server) -> None:
    """Answers but never drops ack_group_ids (rule: they are dropped, as AckResults drops)."""
    _rewrite(servicer, lambda request: request.ClearField("ack_group_ids"))


def batch_collects_before_acking(servicer, server) -> None:
    """Collects first, drops ack_group_ids after (rule: acknowledgements first, so the call
    never answers a result it acknowledges)."""
    call = servicer.CollectResultBatch

    async def late(request, context) -> bytes:
        acks = list(request.ack_group_ids)
        request = pb.CollectResultBatchRequest(
            max_groups=request.max_groups, max_wait=request.max_wait
        )
        out = await call(request, context)
        servicer.store.ack(acks)
        return out

    servicer.CollectResultBatch = late  # type: ignore[method-assign]


def batch_forgets_unacknowledged(servicer, server) -> None:
    """Drops each result it answers, acknowledged or not (rule: results are not removed by
    being sent; they come again until acknowledged)."""
    call = servicer.CollectResultBatch

    async def once(request, context) -> bytes:
        out = await call(request, context)
        sent = pb.CollectResultBatchResponse.FromString(out).results
        servicer.store.ack([r.group_id for r in sent])
        return out

    servicer.CollectResultBatch = once  # type: ignore[method-assign]


BATCH_SWITCHES = (
    batch_accepts_zero_max_groups,
    batch_returns_at_once,
    batch_ignores_max_groups,
    batch_ignores_acks,
    batch_collects_before_acking,
    batch_forgets_unacknowledged,
)

# The check that must fail for each switch.
BATCH_CATCHES = {
    "batch_accepts_zero_max_groups": "batch_rejects_bad_fields",
    "batch_returns_at_once": "batch_collect",
    "batch_ignores_max_groups": "batch_oldest_first_within_max_groups",
    "batch_ignores_acks": "batch_ack_removes_the_result",
    "batch_collects_before_acking": "batch_acks_before_collecting",
    "batch_forgets_unacknowledged": "batch_repeats_until_ack",
}
