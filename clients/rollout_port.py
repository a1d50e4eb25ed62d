"""Dataflow's outbound side: `RolloutPort` over astra.raas.v1.RolloutService.

Every failed call is a `PortError`, including a call that grpc cancels because its
channel was closed (an instance that registered again from another address gets a
new channel, and the old one is closed under calls still waiting on it): only the
cancellation of the calling task itself goes through as CancelledError, so a
Dataflow loop never dies of another channel's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterator, Mapping, Sequence

import grpc
from google.protobuf.message import DecodeError

from astra.clients.raas import RolloutClient
from astra.common.arrays import Malformed
from astra.common.group_convert import field_slices, incoming_group, prompt_group
from astra.common.v1 import rollout_pb2, version_pb2
from astra.dataflow.config import StreamSettings
from astra.dataflow.ports import IncomingGroup, PortError
from astra.dataflow.records import WorkItem
from astra.protowire import read_varint

MAX_IDS = 4096  # group ids per AckResults / CollectResultBatch
CLOSE_ACK_S = 0.5  # how long closing waits to send the acknowledgements still queued


@contextlib.contextmanager
def _call() -> Iterator[None]:
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise GrpcRolloutPort._error(exc) from exc
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller itself is being cancelled
        raise PortError("CANCELLED: the channel to the instance was closed") from None


class GrpcRolloutPort:
    def __init__(
        self, address: str, *, timeout_s: float = 10.0, vocab: Mapping[str, int] | None = None
    ) -> None:
        self.client = RolloutClient(address, timeout_s=timeout_s)
        self.instance_id = ""
        self.vocab = dict(vocab or {})  # policy -> vocabulary size, checked at ingest
        self.batched: bool | None = None  # has CollectResultBatch; None: not tried yet
        self._acks: list[str] = []  # acknowledgements for the next CollectResultBatch

    @staticmethod
    def _error(exc: grpc.aio.AioRpcError) -> PortError:
        code = exc.code()
        return PortError(
            f"{code.name}: {exc.details()}",
            busy=code is grpc.StatusCode.RESOURCE_EXHAUSTED,
            fatal=code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION),
        )

    async def submit(
        self, work: Sequence[tuple[WorkItem, StreamSettings]]
    ) -> tuple[list[str], int]:
        with _call():
            resp = await self.client.submit_groups([prompt_group(i, s) for i, s in work])
        return list(resp.accepted_group_ids), resp.free_slots

    async def collect(self, max_groups: int, max_wait_s: float) -> Sequence[bytes | memoryview]:
        """Serialized CollectResultsResponse messages. Through CollectResultBatch, which
        carries the acknowledgements `ack` queued, unless the RaaS lacks it (UNIMPLEMENTED:
        then CollectResults, and AckResults from then on)."""
        if self.batched is not False:
            acks, self._acks = self._acks[:MAX_IDS], self._acks[MAX_IDS:]
            try:
                with _call():
                    raw = await self.client.collect_result_batch_raw(acks, max_groups, max_wait_s)
            except BaseException as exc:
                self._acks[:0] = acks  # not known to have arrived: they go with the next call
                cause = exc.__cause__
                if not (
                    isinstance(exc, PortError)
                    and isinstance(cause, grpc.aio.AioRpcError)
                    and cause.code() is grpc.StatusCode.UNIMPLEMENTED
                ):
                    raise
                self.batched = False
                await self._flush_acks()
            else:
                self.batched = True
                try:
                    return framed_results(raw)
                except ValueError:
                    return [raw]  # undecodable as a whole: `decode` counts it as such
        with _call():
            return await self.client.collect_results_raw(max_groups, max_wait_s)

    def decode(self, received: Sequence[bytes | memoryview]) -> list[IncomingGroup]:
        return decode_results(received, self.vocab)

    async def ack(self, group_ids: Sequence[str]) -> None:
        """Acknowledges results stored durably. Where the RaaS has CollectResultBatch the ids
        leave with the next collect (a crash before then delivers those results again, and
        they are dropped as duplicates); else at once, with AckResults."""
        self._acks += group_ids
        if not self.batched or len(self._acks) > MAX_IDS:
            await self._flush_acks()

    async def _flush_acks(self, timeout_s: float | None = None) -> None:
        with _call():
            while self._acks:
                await self.client.ack_results(self._acks[:MAX_IDS], timeout_s=timeout_s)
                del self._acks[:MAX_IDS]

    async def cancel(self, group_ids: Sequence[str]) -> None:
        with _call():
            await self.client.cancel_groups(group_ids)

    async def load_weights(
        self, versions: dict[str, tuple[int, str, str]], request_id: str
    ) -> dict[str, int]:
        req = [
            version_pb2.PolicyVersion(policy_id=p, version=v, version_id=vid)
            for p, (v, vid, _addr) in versions.items()
        ]
        addresses = {p: addr for p, (_v, _vid, addr) in versions.items()}
        default = min(addresses.values())
        overrides = {p: a for p, a in addresses.items() if a != default}
        with _call():
            resp = await self.client.load_weights(
                req, default, request_id, policy_weights_addresses=overrides, timeout_s=600
            )
        return {v.policy_id: v.version for v in resp.loaded_versions}

    async def check_health(self) -> bool:
        try:
            with _call():
                return await self.client.check_health(timeout_s=2.0)
        except PortError:
            return False

    async def close(self) -> None:
        if self._acks:  # best effort, briefly: unacknowledged results come again (duplicates)
            with contextlib.suppress(PortError):
                await self._flush_acks(timeout_s=CLOSE_ACK_S)
        await self.client.close()


def decode_results(
    received: Sequence[bytes | memoryview], vocab: Mapping[str, int] | None = None
) -> list[IncomingGroup]:
    """Serialized CollectResultsResponse messages as Dataflow takes them in (each validated;
    with `vocab`, each policy's token ids against its vocabulary size)."""
    out = []
    for msg in received:
        try:
            (raw,) = field_slices(msg, 1, copy=False) or [b""]
            result = rollout_pb2.GroupResult.FromString(raw)
        except (DecodeError, Malformed, ValueError, IndexError) as exc:
            # A RaaS bug, not Dataflow's: the collector must not die of it (it would
            # collect the same bytes again forever). Named by its group id where that
            # much parses: the group ends counted as malformed and is acknowledged.
            # Else it cannot be acknowledged: counted once (by digest), its lease
            # expires and the group is dispatched again elsewhere.
            out.append(_undecodable(msg, exc))
            continue
        out.append(incoming_group(result, result.instance_id, raw, vocab))
    return out


def framed_results(response: bytes) -> list[memoryview]:
    """Each `results` entry of a serialized CollectResultBatchResponse with its own field
    key and length: a serialized CollectResultsResponse (whose `result` is field 1 too),
    so both RPCs' results decode alike. Views, not copies: a buffered trajectory's bytes
    keep its response alive, as they kept its CollectResults message alive (the groups of
    a response are buffered and trained in about the same order). Other fields are
    skipped; a malformed response is Malformed."""
    out = []
    pos, end = 0, len(response)
    view = memoryview(response)
    while pos < end:
        start = pos
        key, pos = read_varint(response, pos)
        if key & 7 != 2:
            raise Malformed(f"CollectResultBatchResponse: field {key >> 3}, wire type {key & 7}")
        length, pos = read_varint(response, pos)
        if pos + length > end:
            raise Malformed("CollectResultBatchResponse: a field runs past the message")
        if key >> 3 == 1:
            out.append(view[start : pos + length])
        pos += length
    return out


def connect(timeout_s: float, vocab: Mapping[str, int] | None = None):
    def make(address: str) -> GrpcRolloutPort:
        return GrpcRolloutPort(address, timeout_s=timeout_s, vocab=vocab)

    return make


def _undecodable(msg: bytes | memoryview, exc: Exception) -> IncomingGroup:
    """An IncomingGroup marked invalid for a result that does not parse, with the group id
    when its field (GroupResult.group_id = 1) is readable on its own."""
    group_id = ""
    with contextlib.suppress(Exception):
        (raw,) = field_slices(msg, 1)
        group_id = bytes(field_slices(raw, 1)[0]).decode()
    digest = hashlib.blake2b(msg, digest_size=8).hexdigest()
    return IncomingGroup(group_id, "", invalid=f"result {digest} does not parse: {exc}"[:512])
