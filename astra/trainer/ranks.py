"""How rank 0 leads its followers: a plan is broadcast before every collective.

Rank 0 alone talks to the services and decides (fetch, validation,
checkpoint requests, shutdown); it broadcasts a plan, and then every rank
enters the same collectives (FSDP forward/backward, the full-state gather)
in the same order. Plans:
    {"kind": "train", "batch": [serialized Trajectory], "version": V, "publish": bool}
    {"kind": "checkpoint", "root": path}
    {"kind": "idle"}      (rank 0 is paused: nothing to do, the collective stays alive)
    {"kind": "stop"}
A follower validates the same bytes with the same code, so it builds the
same batch; it never publishes, acknowledges or writes files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from astra.common.v1 import rollout_pb2
from astra.trainer.feed import Feed
from astra.trainer.parallel import broadcast_object


class Follower(Protocol):
    """What a follower rank needs of its trainer (astra.trainer.loop.Trainer)."""

    feed: Feed
    step: int
    version: int

    async def _compute(self, fn: Any, *args: Any) -> Any: ...
    def _write_checkpoint(self, root: str) -> Any: ...
    def _train(self, batch: Any, version: int, publish: bool) -> Any: ...


def train_plan(
    trajectories: Sequence[rollout_pb2.Trajectory], version: int, publish: bool
) -> dict[str, Any]:
    wire = [t.SerializeToString() for t in trajectories]
    return {"kind": "train", "batch": wire, "version": version, "publish": publish}


async def follow(trainer: Follower) -> None:
    """Runs rank 0's plans on this rank until a "stop" plan."""
    while True:
        plan = await trainer._compute(broadcast_object, None)
        if plan["kind"] == "stop":
            return
        if plan["kind"] == "idle":
            continue
        if plan["kind"] == "checkpoint":
            await trainer._compute(trainer._write_checkpoint, plan["root"])
            continue
        trajectories = [rollout_pb2.Trajectory.FromString(b) for b in plan["batch"]]
        batch = trainer.feed.build(trajectories)
        result, *_ = await trainer._compute(trainer._train, batch, plan["version"], plan["publish"])
        if result.applied:
            trainer.step, trainer.version = trainer.step + 1, trainer.version + 1
