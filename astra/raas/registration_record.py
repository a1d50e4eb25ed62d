"""What a RaaS told a checking Dataflow: every RegisterInstance, HeartbeatInstance and
DeregisterInstance, in order, with its time; and the one thing the checker may ask of the
checking Dataflow: to forget the instance (answer its next heartbeat NOT_FOUND).

Filled by the checking DataflowService of `astra raas check --as-dataflow`
(astra.servers.raas_registration_check), read by its registration checks
(astra.clients.raas_check_registration). Knows nothing of gRPC: a request is kept as the
message it came as.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    kind: str  # "register", "heartbeat" or "deregister"
    at: float  # time.monotonic() when it arrived
    request: Any  # the request message
    answered: str = "OK"  # "OK" or "NOT_FOUND"


class Recording:
    """Calls as they arrive; `interval_s` is the heartbeat interval the checking Dataflow gives."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.calls: list[Call] = []
        self.registered: set[str] = set()  # instance ids, until forgotten
        self._forget = False

    def register(self, request: Any) -> None:
        self.registered.add(request.instance_id)
        self.calls.append(Call("register", time.monotonic(), request))

    def heartbeat(self, request: Any) -> bool:
        """Records it; True when it is to be answered NOT_FOUND (unknown or forgotten)."""
        known = request.instance_id in self.registered and not self._forget
        if self._forget:
            self.registered.discard(request.instance_id)
            self._forget = False
        self.calls.append(
            Call("heartbeat", time.monotonic(), request, "OK" if known else "NOT_FOUND")
        )
        return not known

    def deregister(self, request: Any) -> None:
        self.registered.discard(request.instance_id)
        self.calls.append(Call("deregister", time.monotonic(), request))

    def forget_at_next_heartbeat(self) -> None:
        self._forget = True

    def of(self, kind: str, since: float = 0.0) -> list[Call]:
        return [c for c in self.calls if c.kind == kind and c.at >= since]

    async def wait_for(
        self, kind: str, timeout_s: float, since: float = 0.0, where: Callable[[Call], bool] = bool
    ) -> Call | None:
        """The first call of `kind` since `since` for which `where` holds, or None at timeout."""
        found = await self.wait_for_many(kind, 1, timeout_s, since, where)
        return found[0] if found else None

    async def wait_for_many(
        self,
        kind: str,
        n: int,
        timeout_s: float,
        since: float = 0.0,
        where: Callable[[Call], bool] = bool,
    ) -> list[Call]:
        """The first `n` such calls, or as many as came when `timeout_s` ran out."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [c for c in self.of(kind, since) if where(c)]
            if len(found) >= n or time.monotonic() >= deadline:
                return found[:n]
            await asyncio.sleep(0.02)
