"""OffPolicyBudget on its own: AReaL's bound eta per policy, the version floor, the room an
instance has from the weights it holds, and replayed copies filling slots. Real config,
versions, buffers and ledger; the work table and the batch desk are stood in for by the two
counts each gives the budget (that is all it reads of them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from astra.dataflow.buffer import PolicyBuffer
from astra.dataflow.config import BufferSettings
from astra.dataflow.ledger import Ledger
from astra.dataflow.offpolicy import OffPolicyBudget
from astra.dataflow.pool import Instance
from astra.dataflow.records import GroupRecord, TrajectoryRecord
from astra.dataflow.versions import VersionBook
from tests.conftest import make_config


class Table:
    """What the budget reads of the work table: groups in flight per stream and policy."""

    def __init__(self) -> None:
        self.in_flight = 0

    def running(self, stream: str) -> int:
        return self.in_flight

    def running_for(self, policy_id: str) -> int:
        return self.in_flight


class Batches:
    """What the budget reads of the batch desk: fresh groups leased, and versions taken."""

    def __init__(self) -> None:
        self.taken: set[int] = set()

    def leased_fresh(self, policy_id: str) -> int:
        return 0

    def taken_for(self, policy_id: str, version: int) -> bool:
        return version in self.taken


def budget_for(tmp_path: Path, eta, batch_groups=2, max_concurrent=1024, **buffer):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "x"}\n')
    config = make_config(
        data,
        tmp_path / "state",
        policies=[{"id": "p", "batch_groups": batch_groups, "buffer": buffer}],
        streams=[
            {
                "name": "s",
                "dataset": {"path": str(data)},
                "policy_ids": ["p"],
                "group_size": 2,
                "sampling": {"max_new_tokens": 4},
            }
        ],
        gate={"max_version_lag": eta, "max_concurrent_groups": max_concurrent},
    )
    buffers = {"p": PolicyBuffer(BufferSettings(**config.policies[0].buffer.model_dump()))}
    versions = VersionBook(["p"], config.versions.barrier)
    ledger, table, batches = Ledger(buffers), Table(), Batches()
    budget = OffPolicyBudget(
        config, versions, buffers, batches, ledger, table, is_eval=lambda name: False
    )
    return budget, config.streams[0], versions, ledger, table, batches


def to_version(versions: VersionBook, n: int) -> None:
    for v in range(1, n + 1):  # announced one after another, with their WeightService
        versions.announce("p", v, f"v{v}", "127.0.0.1:1")


def test_without_eta_only_the_concurrency_limit_bounds(tmp_path):
    budget, stream, _, ledger, table, _ = budget_for(tmp_path, None, max_concurrent=5)
    ledger.accepted["p"] = 1000  # never counted without eta
    table.in_flight = 3
    assert budget.stream_capacity(stream) == 2
    assert budget.version_floor(stream) == {} and budget.version_room({}) is None


def test_eta_zero_allows_one_batch_per_version(tmp_path):
    budget, stream, versions, ledger, table, _ = budget_for(tmp_path, 0, batch_groups=2)
    assert budget.stream_capacity(stream) == 2
    table.in_flight = 1
    assert budget.stream_capacity(stream) == 1
    table.in_flight, ledger.accepted["p"] = 0, 2
    assert budget.stream_capacity(stream) == 0  # version 0's batch is spoken for
    versions.announce("p", 1, "v1", "127.0.0.1:1")
    assert budget.stream_capacity(stream) == 2


def test_eta_lets_that_many_versions_ahead_be_generated(tmp_path):
    budget, stream, versions, ledger, _, _ = budget_for(tmp_path, 2, batch_groups=3)
    assert budget.stream_capacity(stream) == 9  # versions 0, 1, 2
    ledger.accepted["p"] = 7
    assert budget.stream_capacity(stream) == 2
    to_version(versions, 4)
    assert budget.stream_capacity(stream) == (2 + 4 + 1) * 3 - 7


def test_the_floor_is_the_target_less_eta_once_weights_are_published(tmp_path):
    budget, stream, versions, _, _, _ = budget_for(tmp_path, 1)
    assert budget.version_floor(stream) == {}  # no version announced with an address yet
    to_version(versions, 3)
    assert budget.version_floor(stream) == {"p": 2}


def test_an_instance_may_start_only_what_its_own_version_leaves_room_for(tmp_path):
    budget, stream, versions, ledger, table, _ = budget_for(tmp_path, 1, batch_groups=2)
    to_version(versions, 3)
    ledger.accepted["p"] = 5
    table.in_flight = 1
    room = budget.version_room(budget.version_floor(stream))

    def holding(v: int) -> Instance:
        inst = Instance("i", "127.0.0.1:2", 4, frozenset("p"), frozenset("w"), {}, port=None)
        inst.loaded_versions["p"] = v
        return inst

    # Holding u, a group must be among the first (eta + u + 1) * batch_groups: trained by u + eta.
    assert room(holding(3)) == (1 + 3 + 1) * 2 - 6
    assert room(holding(2)) == (1 + 2 + 1) * 2 - 6
    assert room(holding(1)) == 0  # below the floor: too old for anything
    assert room(holding(9)) == room(holding(3))  # never counted past the trainer's version


def test_replayed_copies_of_batches_to_come_take_slots(tmp_path):
    buffer = {"replay_ratio": 0.5, "replay_capacity_groups": 8}
    budget, stream, _, ledger, _, batches = budget_for(tmp_path, 1, batch_groups=4, **buffer)
    # Replay holds nothing yet: version 0's batch takes no copy; version 1's takes 2 of the
    # 4 fresh groups version 0's batch will have put into replay by then.
    assert budget.slots_by_version("p") == [0, 2]
    for i in range(3):  # three groups trained: in replay now
        budget.buffers["p"].remember([_group(i)])
    # Each batch to come takes 2 copies (half of 4) while replay holds them.
    assert budget.slots_by_version("p") == [2, 4]
    batches.taken.add(0)  # version 0's batch was taken already (its copies are counted)
    assert budget.slots_by_version("p") == [0, 2]
    ledger.replay_slots["p"] = 2
    assert budget.slots_used("p") == 4
    assert budget.stream_capacity(stream) == (1 + 0 + 1) * 4 - 4


def _group(i: int) -> GroupRecord:
    trajectories = [TrajectoryRecord(f"t{i}{k}", float(k), 0, 0, 3) for k in range(2)]
    return GroupRecord(f"s/0/{i}", "p", 0, trajectories)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_capacity_never_goes_below_zero(tmp_path, eta):
    budget, stream, _, ledger, _, _ = budget_for(tmp_path, eta)
    ledger.accepted["p"] = 10_000
    assert budget.stream_capacity(stream) == 0
