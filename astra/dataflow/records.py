"""Domain records that flow through Dataflow: work items, trajectories, groups, batches.

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


@dataclass(slots=True)
class BatchRow:
    batch_id: str
    policy_id: str
    request_id: str
    trainer_id: str
    state: str
    lease_expire: float
    policy_version: int
    # (group_id, replay, advantages) in batch order; advantages None in a schema-1 row and
    # in a finished batch's row.
    group_keys: list[tuple[str, bool, list[float] | None]]
    # An acknowledged batch's groups not in the trainer's weights: why ("" trained).
    untrained_reason: str = ""


@dataclass(slots=True)
class Batch:
    batch_id: str
    policy_id: str
    request_id: str
    trainer_id: str
    groups: list[GroupRecord]
    policy_version: int
    lease_expire: float
    state: str = "leased"
    # Once acknowledged: its fresh groups (its `groups` are dropped), and why they are not
    # in the trainer's weights ("": trained; an AckBatch untrained_reason; TRAINER_RESTART).
    fresh: int = 0
    untrained_reason: str = ""

    @property
    def num_trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)

    def row(self) -> BatchRow:
        return BatchRow(
            self.batch_id,
            self.policy_id,
            self.request_id,
            self.trainer_id,
            self.state,
            self.lease_expire,
            self.policy_version,
            # Advantages only while they may have to be served again.
            [
                (g.group_id, g.replay, list(g.advantages) if self.state == "leased" else None)
                for g in self.groups
            ],
            self.untrained_reason,
        )

    def stored_keys(self) -> list[tuple[str, str]]:
        return [(g.group_id, g.policy_id) for g in self.groups if not g.replay]


def rebuild(
    row: BatchRow, stored: list[GroupRecord], replays: dict[int, GroupRecord]
) -> list[GroupRecord] | None:
    """The groups of a leased batch in the order served, with their advantages; None if the
    store does not hold every one of them (or holds fresh groups the row does not list)."""
    fresh = {g.group_id: g for g in stored}
    out = []
    for pos, (group_id, replay, advantages) in enumerate(row.group_keys):
        group = replays.get(pos) if replay else fresh.pop(group_id, None)
        if group is None or group.group_id != group_id:
            return None
        group.replay = replay
        group.advantages = [] if advantages is None else list(advantages)
        if advantages is not None and len(advantages) != len(group.trajectories):
            return None
        out.append(group)
    return None if fresh else out
