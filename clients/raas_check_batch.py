"""The CollectResultBatch checks of `astra raas check` (rollout_service.proto, CollectResultBatch).

A set of checks on astra.clients.raas_check_session.CheckSession, joined in
astra.clients.raas_check.RaasChecker. The RPC is optional: a server that answers
UNIMPLEMENTED (what gRPC answers for a method not served) has these checks skipped, not
failed, since Dataflow then collects with CollectResults and AckResults. A server that serves
it keeps its rules: bad fields refused naming them (INVALID_FIELD); a call with none ready
waits for a result (up to max_wait); results answered until acknowledged, oldest first, at
most max_groups; ack_group_ids dropped before the results are collected, as AckResults drops
them (unknown ids ignored), and never answered again. Responses are read with Dataflow's own
framing and decoder (framed_results, decode_results).

Not checked: the cut at the 64 MiB message limit (it needs results that large).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from astra.clients.raas_check_session import CheckSession
from astra.clients.raas_rules import CheckFailed, Rpc, Skipped, rpc
from astra.clients.rollout_port import MAX_IDS, decode_results, framed_results
from astra.raas.v1 import rollout_service_pb2 as pb

ABSENT = (
    "CollectResultBatch answers UNIMPLEMENTED: optional, not served (Dataflow collects with "
    "CollectResults and AckResults instead)"
)
MAX_COLLECT, MAX_WAIT_S = 4096, 30.0  # max_groups and max_wait bounds (rollout_service.proto)
# A call answering nothing must have waited this share of its max_wait at least (the client's
# clock runs from before the call leaves to after its answer arrives: never less than the
# server's wait).
WAITED = 0.8
IDLE_WAIT_S = 0.5  # max_wait of the call made with nothing to answer


@dataclass
class Batch:
    """What one CollectResultBatch answered: the checker's group ids in the order answered,
    how many results in all, and how long the call took."""

    ours: list[str]
    total: int
    took_s: float


class BatchChecks(CheckSession):
    async def batch_rejects_bad_fields(self) -> str:
        """max_groups outside 1-4096, max_wait over 30 s and more than 4096 ack_group_ids are
        INVALID_ARGUMENT, reason INVALID_FIELD, naming the field."""
        unknown = [f"conformance/{self.run_id}/unknown-{i}" for i in range(MAX_IDS + 1)]
        cases = (
            ("max_groups 0", "max_groups", (), 0, 0.0),
            (f"max_groups {MAX_COLLECT + 1}", "max_groups", (), MAX_COLLECT + 1, 0.0),
            (f"max_wait {MAX_WAIT_S + 1:g} s", "max_wait", (), 1, MAX_WAIT_S + 1),
            (f"{len(unknown)} ack_group_ids", "ack_group_ids", unknown, 1, 0.0),
        )
        for what, field, acks, max_groups, max_wait_s in cases:
            r = await self._call_batch(acks, max_groups, max_wait_s)
            try:
                text = r.expect(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
            except CheckFailed as exc:
                raise CheckFailed(f"{what}: {exc}") from None
            if field not in r.fields:
                raise CheckFailed(
                    f"{what}: {text}, but naming fields {list(r.fields)}, not {field} "
                    "(ErrorInfo metadata 'field' or BadRequest)"
                )
        return f"{', '.join(c[0] for c in cases)}: INVALID_ARGUMENT INVALID_FIELD naming the field"

    async def batch_collect(self) -> str:
        """With none ready a call waits out its max_wait; a group's result then arrives, as
        Dataflow decodes it."""
        self._needs("policy", "capacity")
        idle = await self._batch(max_wait_s=IDLE_WAIT_S)  # Skipped here, before any group
        if not idle.total and idle.took_s < WAITED * IDLE_WAIT_S:
            raise CheckFailed(
                f"answered nothing {idle.took_s:.2f} s into a max_wait of {IDLE_WAIT_S:g} s "
                "with none ready: a call waits for a result up to max_wait"
            )
        g = self._group(num_samples=min(2, self.capacity))
        (await self._submit(g)).expect(grpc.StatusCode.OK)
        self.batch_groups.append(g.group_id)
        await self._until_batched(g.group_id)
        self.batch_first = g.group_id
        text = self._well_formed(g.group_id, g.num_samples)
        return f"nothing ready: waited {idle.took_s:.2f} s of {IDLE_WAIT_S:g}; then {text}"

    async def batch_repeats_until_ack(self) -> str:
        self._served()
        self._needs("batch_first")
        got = await self._batch(max_wait_s=0.0)
        if self.batch_first not in got.ours:
            raise CheckFailed(
                f"{self.batch_first}, answered and not acknowledged, was not answered again "
                "(results are not removed by being sent)"
            )
        return "answered again until acknowledged"

    async def batch_oldest_first_within_max_groups(self) -> str:
        self._served()
        self._needs("batch_first", "policy")
        first, g = self.batch_first, self._group(num_samples=1)
        (await self._submit(g)).expect(grpc.StatusCode.OK)
        self.batch_groups.append(g.group_id)
        await self._until_batched(g.group_id)
        self.batch_second = g.group_id
        one = await self._batch(max_groups=1)
        if one.total != 1 or one.ours != [first]:
            raise CheckFailed(
                f"max_groups 1 answered {one.ours} ({one.total} results in all): expected "
                f"[{first!r}], the oldest ({g.group_id} was submitted after it finished)"
            )
        two = await self._batch(max_groups=2)
        if two.ours != [first, g.group_id]:
            raise CheckFailed(
                f"max_groups 2 answered {two.ours}: expected [{first!r}, {g.group_id!r}], "
                "oldest first"
            )
        return "max_groups 1: the oldest alone; 2: both, oldest first"

    async def batch_acks_before_collecting(self) -> str:
        self._served()
        self._needs("batch_first", "batch_second")
        first, second = self.batch_first, self.batch_second
        got = await self._batch([first, f"conformance/{self.run_id}/unknown"], max_groups=1)
        if got.ours != [second]:
            raise CheckFailed(
                f"ack_group_ids [{first!r}, an unknown id] with max_groups 1 answered "
                f"{got.ours}: expected [{second!r}] (the acknowledged are dropped first, then "
                "the oldest left is answered)"
            )
        return "the acknowledged result dropped before collecting, an unknown id ignored"

    async def batch_ack_removes_the_result(self) -> str:
        self._served()
        self._needs("batch_first")
        ids = list(self.batch_groups)
        same = await self._batch(ids, max_wait_s=0.5)
        later = await self._batch(max_wait_s=0.0)
        acked = await rpc(self.client.ack_results(ids))  # also clears what a broken one kept
        if again := [g for g in same.ours if g in ids]:
            raise CheckFailed(f"{again} answered by the very call whose ack_group_ids name them")
        if again := [g for g in later.ours if g in ids]:
            raise CheckFailed(f"{again} answered again after ack_group_ids acknowledged them")
        acked.expect(grpc.StatusCode.OK)
        assert isinstance(acked.response, pb.AckResultsResponse)
        if n := acked.response.acknowledged:
            raise CheckFailed(
                f"AckResults afterwards acknowledged {n} of {ids}: ack_group_ids had not "
                "dropped them"
            )
        return (
            f"{len(ids)} acknowledged by ack_group_ids: never answered again, gone for AckResults"
        )

    # ----- calls -----------------------------------------------------------------------------

    def _served(self) -> None:
        """Skipped, saying why, where an earlier call was answered UNIMPLEMENTED."""
        if self.batch is False:
            raise Skipped(ABSENT)

    async def _call_batch(self, acks: Sequence[str], max_groups: int, max_wait_s: float) -> Rpc:
        """One CollectResultBatch, however it ends; Skipped where the server lacks it."""
        self._served()
        call = self.client.collect_result_batch_raw(list(acks), max_groups, max_wait_s)
        r = await rpc(call)
        if r.code == grpc.StatusCode.UNIMPLEMENTED:
            if self.batch:
                raise CheckFailed(
                    f"UNIMPLEMENTED ({r.details!r}) after serving earlier calls: Dataflow would "
                    "fall back to CollectResults for good"
                )
            self.batch = False
            raise Skipped(ABSENT)
        self.batch = True
        return r

    async def _batch(
        self, acks: Sequence[str] = (), *, max_groups: int = 64, max_wait_s: float = 0.0
    ) -> Batch:
        """One CollectResultBatch that must end OK; what it answered, decoded as Dataflow does."""
        start = time.monotonic()
        r = await self._call_batch(acks, max_groups, max_wait_s)
        took = time.monotonic() - start
        r.expect(grpc.StatusCode.OK)
        raw = r.response
        assert isinstance(raw, bytes)
        try:
            pb.CollectResultBatchResponse.FromString(raw)
            framed = framed_results(raw)
        except (DecodeError, ValueError) as exc:
            raise CheckFailed(f"not a CollectResultBatchResponse: {exc}") from None
        ours = []
        for msg, group in zip(framed, decode_results(framed), strict=True):
            if group.group_id.startswith(f"conformance/{self.run_id}/"):
                ours.append(group.group_id)
                wire = pb.CollectResultsResponse.FromString(bytes(msg))
                self.decoded[group.group_id] = (group, wire)
        return Batch(ours, len(framed), took)

    async def _until_batched(self, group_id: str) -> None:
        """Calls (acknowledging nothing) until one answers `group_id`. A call that answers
        nothing must have waited out its max_wait: none was ready."""
        deadline = time.monotonic() + self.options.result_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckFailed(f"no result within {self.options.result_timeout_s:g} s")
            wait = min(5.0, max(0.5, left))
            got = await self._batch(max_wait_s=wait)
            if got.ours.count(group_id) > 1:
                raise CheckFailed(f"{group_id} answered {got.ours.count(group_id)} times at once")
            if group_id in got.ours:
                return
            if not got.total and got.took_s < WAITED * wait:
                raise CheckFailed(
                    f"answered nothing {got.took_s:.2f} s into a max_wait of {wait:g} s while "
                    f"{group_id} ran: with none ready, a call waits for one up to max_wait"
                )
            if got.total:  # others are ready (ours not yet): no long poll to wait in
                await asyncio.sleep(0.05)
