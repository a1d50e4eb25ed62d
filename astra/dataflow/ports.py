"""What Dataflow needs from a rollout service, stated without gRPC.

The server layer implements `RolloutPort` over astra.raas.v1.RolloutService;
tests may implement it in memory. Results arrive already split per policy
and reduced to the facts the buffer needs (`IncomingGroup`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from astra.dataflow.config import StreamSettings
from astra.dataflow.records import TrajectoryRecord, WorkItem


@dataclass(slots=True)
class IncomingGroup:
    """One finished group as a RaaS returned it.

    `error` is set when the whole group failed; `invalid` when the result was
    malformed (it names the field). Either way the group is a counted outcome.
    """

    group_id: str
    instance_id: str
    per_policy: dict[str, list[TrajectoryRecord]] = field(default_factory=dict)
    error: str | None = None
    invalid: str | None = None


class RolloutPort(Protocol):
    """Calls Dataflow makes on one RaaS. Any failure raises `PortError`."""

    async def submit(
        self, work: Sequence[tuple[WorkItem, StreamSettings]]
    ) -> tuple[list[str], int]:
        """Returns the accepted group ids and the free slots left."""

    async def collect(self, max_groups: int, max_wait_s: float) -> list[object]:
        """Finished groups as received, not yet decoded (see `decode`)."""

    def decode(self, received: Sequence[object]) -> list[IncomingGroup]:
        """Validates and splits received groups; CPU work the caller schedules."""

    async def ack(self, group_ids: Sequence[str]) -> None: ...

    async def cancel(self, group_ids: Sequence[str]) -> None: ...

    async def load_weights(
        self, versions: dict[str, tuple[int, str, str]], request_id: str
    ) -> dict[str, int]:
        """Loads {policy: (version, version_id, weights address)} as one set.

        Returns the versions held after the call.
        """

    async def check_health(self) -> bool: ...

    async def close(self) -> None: ...


class PortError(Exception):
    """A call to a RaaS failed. `busy` means it refused for lack of capacity."""

    def __init__(self, message: str, *, busy: bool = False, fatal: bool = False) -> None:
        super().__init__(message)
        self.busy = busy
        self.fatal = fatal


Connector = Callable[[str], RolloutPort]
