"""Domain records that flow through Dataflow: work items, trajectories, groups.

Plain dataclasses with no gRPC or protobuf in them. A trajectory's token
arrays travel as an opaque `payload` (the serialized wire message): Dataflow
only needs the scalar facts below to filter, order and normalise, so it never
decodes or re-encodes the arrays on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One prompt group to dispatch; `group_id` is its stable work id."""

    group_id: str
    policy_ids: tuple[str, ...]
    workflow: str
    record: dict
    num_samples: int
    epoch: int
    index: int
    # Generated again: its stored result was corrupt (astra.dataflow.quarantine).
    regenerate: bool = False


@dataclass(slots=True)
class TrajectoryRecord:
    """The facts about one episode that Dataflow needs, plus its wire bytes.

    `min_version` is the oldest weight version of any generated token of the
    policy this record belongs to (-1 if none was generated), `max_version`
    the newest.
    """

    trajectory_id: str
    reward: float
    min_version: int
    max_version: int
    num_tokens: int
    payload: bytes = b""
    failed: bool = False


@dataclass(slots=True)
class GroupRecord:
    """The trajectories of one prompt group that belong to one policy's buffer."""

    group_id: str
    policy_id: str
    epoch: int
    trajectories: list[TrajectoryRecord]
    seq: int = 0
    replay: bool = False
    advantages: list[float] = field(default_factory=list)
    # Cache of min_version: ordering and staleness checks read it often. Removing failed
    # trajectories cannot change it (they carry no generated versions).
    _oldest: int | None = field(default=None, repr=False, compare=False)

    @property
    def min_version(self) -> int:
        if self._oldest is None:
            versions = [t.min_version for t in self.trajectories if t.min_version >= 0]
            self._oldest = min(versions) if versions else -1
        return self._oldest

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def staleness(self, current_version: int) -> int:
        """Current trainer version minus the oldest token version (0 if none)."""
        oldest = self.min_version
        return 0 if oldest < 0 else current_version - oldest
