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

    async def collect(self, max_groups: int, max_wait_s: float) -> list[bytes]:
        with _call():
            return await self.client.collect_results_raw(max_groups, max_wait_s)

    def decode(self, received: Sequence[bytes]) -> list[IncomingGroup]:
        return decode_results(received, self.vocab)

    async def ack(self, group_ids: Sequence[str]) -> None:
        with _call():
            for start in range(0, len(group_ids), 4096):
                await self.client.ack_results(group_ids[start : start + 4096])

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
        await self.client.close()


def decode_results(
    received: Sequence[bytes], vocab: Mapping[str, int] | None = None
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


def connect(timeout_s: float, vocab: Mapping[str, int] | None = None):
    def make(address: str) -> GrpcRolloutPort:
        return GrpcRolloutPort(address, timeout_s=timeout_s, vocab=vocab)

    return make


def _undecodable(msg: bytes, exc: Exception) -> IncomingGroup:
    """An IncomingGroup marked invalid for a result that does not parse, with the group id
    when its field (GroupResult.group_id = 1) is readable on its own."""
    group_id = ""
    with contextlib.suppress(Exception):
        (raw,) = field_slices(msg, 1)
        group_id = bytes(field_slices(raw, 1)[0]).decode()
    digest = hashlib.blake2b(msg, digest_size=8).hexdigest()
    return IncomingGroup(group_id, "", invalid=f"result {digest} does not parse: {exc}"[:512])
