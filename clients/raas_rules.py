"""The vocabulary of `astra raas check`: a check's outcome, how a rule fails or does not
apply, and how an RPC ended (its code, ErrorInfo reason and RetryInfo), read from the wire."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import asdict, dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2


@dataclass
class Check:
    name: str
    status: str  # "pass", "fail", "warn" or "skip"
    detail: str


class CheckFailed(Exception):
    """A rule broken; the message says what was expected and what came."""


class Skipped(Exception):
    """A check that does not apply (a feature not listed, an earlier check failed)."""


class Warned(Exception):
    """A recommendation the server does not follow."""


class InstanceInUse(Exception):
    """The instance runs or holds groups the checker did not submit (a live Dataflow's)."""


@dataclass
class Rpc:
    """How a call ended: OK, or its code with the ErrorInfo and RetryInfo it carried."""

    code: grpc.StatusCode
    details: str = ""
    reason: str = ""  # ErrorInfo.reason; "" when the status carries no ErrorInfo
    retry: bool = False  # RetryInfo present
    fields: tuple[str, ...] = ()  # ErrorInfo.metadata["field"] and BadRequest field paths
    response: object = None

    def expect(self, code: grpc.StatusCode, reason: str | None = None) -> str:
        if self.code != code:
            raise CheckFailed(f"expected {code.name}, got {self.code.name} {self.details!r}")
        if code == grpc.StatusCode.OK:
            return "OK"
        if not self.reason:
            raise CheckFailed(f"{code.name} without a google.rpc.ErrorInfo in the status details")
        if reason is not None and self.reason != reason:
            raise CheckFailed(f"{code.name} with reason {self.reason}, expected {reason}")
        return f"{code.name} {self.reason}"


async def rpc(call: Awaitable) -> Rpc:
    try:
        return Rpc(grpc.StatusCode.OK, response=await call)
    except grpc.aio.AioRpcError as exc:
        out = Rpc(exc.code(), exc.details() or "")
        raw = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
        for detail in status_pb2.Status.FromString(raw).details if raw else ():
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                out.reason = info.reason
                out.fields += (info.metadata["field"],) if "field" in info.metadata else ()
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                out.fields += tuple(v.field for v in bad.field_violations)
            out.retry = out.retry or detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR)
        return out


def summary(results: list[Check]) -> dict:
    counts = {k: sum(r.status == k for r in results) for k in ("pass", "fail", "warn", "skip")}
    return {"ok": counts["fail"] == 0, **counts, "checks": [asdict(r) for r in results]}
