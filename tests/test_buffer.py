"""PolicyBuffer: try to break staleness, accounting, ordering, replay and advantage invariants."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from astra.dataflow.buffer import FILTERS, PolicyBuffer, register_filter, registered_filters
from astra.dataflow.config import BufferSettings
from astra.dataflow.records import GroupRecord, TrajectoryRecord
from tests.conftest import entry_point_package

_ids = itertools.count()


def traj(reward: float, version: int = 0, failed: bool = False) -> TrajectoryRecord:
    return TrajectoryRecord(f"t{next(_ids)}", reward, version, version, 8, b"x", failed)


def group(gid: str, rewards: list[float], version: int = 0) -> GroupRecord:
    return GroupRecord(gid, "policy", 0, [traj(r, version) for r in rewards])


# Counters that say where a group that entered went; `filtered_*` are added in `accounted`.
_SINKS = ("taken", "rejected_full", "evicted_full", "failed_groups", "duplicate", "removed")


def accounted(buf: PolicyBuffer) -> None:
    """Every group given to the buffer is still inside or counted by exactly one sink."""
    c = buf.counters
    given = c["added"] + c["restored"] + c["put_back"]
    filtered = sum(v for k, v in c.items() if k.startswith(("filtered_", "filter_error_")))
    assert given == len(buf) + filtered + sum(c[k] for k in _SINKS)


def test_equal_reward_groups_are_dropped_and_counted() -> None:
    buf = PolicyBuffer()
    assert buf.add(group("a", [1.0, 1.0, 1.0]), 0) == "filtered_equal_reward"
    assert buf.add(group("b", [0.0, 0.0]), 0) == "filtered_equal_reward"
    assert buf.add(group("c", [0.0, 1.0]), 0) == "accepted"
    assert buf.counters["filtered_equal_reward"] == 2
    assert len(buf) == 1
    accounted(buf)


def test_drops_in_a_row_grow_on_drops_and_end_on_an_accepted_group() -> None:
    """A duplicate and a group refused by a full buffer neither extend nor end the run."""
    buf = PolicyBuffer(BufferSettings(capacity_groups=1, eviction="reject_new"))
    assert (buf.dropped_in_a_row, buf.last_drop) == (0, "")
    buf.add(group("a", [1.0, 1.0]), 0)
    buf.add(group("b", [0.0, 0.0]), 0)
    assert (buf.dropped_in_a_row, buf.last_drop) == (2, "filtered_equal_reward")
    assert buf.add(group("c", [0.0, 1.0]), 0) == "accepted"
    assert buf.dropped_in_a_row == 0
    buf.add(group("d", [1.0, 1.0]), 0)
    assert buf.add(group("c", [0.0, 1.0]), 0) == "duplicate"
    assert buf.add(group("e", [0.0, 1.0]), 0) == "rejected_full"
    assert (buf.dropped_in_a_row, buf.last_drop) == (1, "filtered_equal_reward")
    buf.note("failed")  # a failed result the buffer never saw (Dataflow notes it)
    assert (buf.dropped_in_a_row, buf.last_drop) == (2, "failed")


def test_equal_rewards_kept_when_dynamic_sampling_off() -> None:
    buf = PolicyBuffer(BufferSettings(drop_equal_rewards=False))
    assert buf.add(group("a", [1.0, 1.0]), 0) == "accepted"


def test_single_trajectory_group_is_kept_with_zero_group_advantage() -> None:
    buf = PolicyBuffer()
    assert buf.add(group("a", [0.7]), 0) == "accepted"
    (g,) = buf.take(1, 0) or []
    assert g.advantages == [0.0]


def test_failed_trajectories_removed_before_filtering() -> None:
    buf = PolicyBuffer()
    g = group("a", [1.0, 0.0, 1.0])
    g.trajectories[1].failed = True  # without it the rest are all equal
    assert buf.add(g, 0) == "filtered_equal_reward"
    assert buf.counters["failed_trajectories"] == 1
    all_failed = GroupRecord("b", "policy", 0, [traj(1.0, failed=True), traj(0.0, failed=True)])
    assert buf.add(all_failed, 0) == "failed"
    assert buf.counters["failed_groups"] == 1
    assert buf.counters["failed_trajectories"] == 3
    accounted(buf)


def test_duplicate_id_counted_not_added_twice() -> None:
    buf = PolicyBuffer()
    assert buf.add(group("a", [0.0, 1.0]), 0) == "accepted"
    assert buf.add(group("a", [0.0, 1.0]), 0) == "duplicate"
    assert len(buf) == 1
    accounted(buf)


def test_stale_group_dropped_on_add() -> None:
    buf = PolicyBuffer(BufferSettings(max_version_lag=2))
    assert buf.add(group("a", [0.0, 1.0], version=1), 4) == "filtered_stale"
    assert buf.add(group("b", [0.0, 1.0], version=2), 4) == "accepted"
    assert buf.counters["filtered_stale"] == 1


def test_nothing_stale_leaves_take_after_versions_advance() -> None:
    buf = PolicyBuffer(BufferSettings(max_version_lag=2, ordering="fifo"))
    for v in range(6):
        assert buf.add(group(f"g{v}", [0.0, 1.0], version=v), v) == "accepted"
    assert buf.take(3, 7) is None  # only g5 is fresh enough at version 7
    dropped = buf.pop_dropped()
    assert [g.group_id for g in dropped] == ["g0", "g1", "g2", "g3", "g4"]
    assert all(g.staleness(7) > 2 for g in dropped)
    assert buf.counters["filtered_stale"] == 5 and len(buf) == 1
    assert buf.take(1, 8) is None  # g5 is now 3 versions old
    assert buf.counters["filtered_stale"] == 6 and len(buf) == 0
    accounted(buf)


def test_take_expires_waiting_groups() -> None:
    buf = PolicyBuffer(BufferSettings(max_version_lag=1))
    for v in range(4):
        buf.add(group(f"g{v}", [0.0, 1.0], version=v), v)
    batch = buf.take(2, 3)
    assert batch is not None
    assert [g.group_id for g in batch] == ["g2", "g3"]
    assert [g.group_id for g in buf.pop_dropped()] == ["g0", "g1"]
    assert buf.pop_dropped() == []


def test_max_version_lag_zero_is_synchronous() -> None:
    buf = PolicyBuffer(BufferSettings(max_version_lag=0))
    buf.add(group("old", [0.0, 1.0], version=0), 0)
    buf.add(group("new", [0.0, 1.0], version=1), 1)
    batch = buf.take(1, 1)
    assert batch is not None and batch[0].group_id == "new"
    assert buf.take(1, 1) is None


def test_drop_stale_returns_removed_groups() -> None:
    buf = PolicyBuffer(BufferSettings(max_version_lag=1))
    for v in range(3):
        buf.add(group(f"g{v}", [0.0, 1.0], version=v), v)
    removed = buf.drop_stale(3)
    assert [g.group_id for g in removed] == ["g0", "g1"]
    assert len(buf) == 1 and buf.counters["filtered_stale"] == 2
    assert buf.drop_stale(3) == []
    assert PolicyBuffer().drop_stale(10**6) == []


def test_drop_oldest_evicts_oldest_version_then_lowest_seq() -> None:
    buf = PolicyBuffer(BufferSettings(capacity_groups=3, eviction="drop_oldest"))
    buf.add(group("v3", [0.0, 1.0], version=3), 3)
    buf.add(group("v1a", [0.0, 1.0], version=1), 3)
    buf.add(group("v1b", [0.0, 1.0], version=1), 3)
    assert buf.add(group("v2", [0.0, 1.0], version=2), 3) == "accepted"
    assert [g.group_id for g in buf.pop_dropped()] == ["v1a"]
    assert buf.add(group("v4", [0.0, 1.0], version=4), 4) == "accepted"
    assert [g.group_id for g in buf.pop_dropped()] == ["v1b"]
    assert buf.counters["evicted_full"] == 2
    assert len(buf) == 3 and buf.fill_ratio == 1.0
    accounted(buf)


def test_reject_new_when_full() -> None:
    buf = PolicyBuffer(BufferSettings(capacity_groups=1, eviction="reject_new"))
    assert buf.add(group("a", [0.0, 1.0]), 0) == "accepted"
    assert buf.add(group("b", [0.0, 1.0]), 0) == "rejected_full"
    assert buf.counters["rejected_full"] == 1
    assert "a" in buf and "b" not in buf
    accounted(buf)


def test_fifo_versus_oldest_version_first() -> None:
    versions = [5, 2, 7, 2, 1]
    fifo = PolicyBuffer(BufferSettings(ordering="fifo"))
    oldest = PolicyBuffer(BufferSettings(ordering="oldest_version_first"))
    for i, v in enumerate(versions):
        fifo.add(group(f"g{i}", [0.0, 1.0], version=v), 7)
        oldest.add(group(f"g{i}", [0.0, 1.0], version=v), 7)
    assert [g.group_id for g in fifo.take(5, 7) or []] == ["g0", "g1", "g2", "g3", "g4"]
    assert [g.group_id for g in oldest.take(5, 7) or []] == ["g4", "g1", "g3", "g0", "g2"]


def test_take_returns_none_and_removes_nothing_when_short() -> None:
    buf = PolicyBuffer()
    buf.add(group("a", [0.0, 1.0]), 0)
    assert buf.take(2, 0) is None
    assert len(buf) == 1
    with pytest.raises(ValueError):
        buf.take(0, 0)


@pytest.mark.parametrize("ordering", ["fifo", "oldest_version_first"])
def test_put_back_restores_original_order(ordering: str) -> None:
    def filled() -> PolicyBuffer:
        buf = PolicyBuffer(BufferSettings(ordering=ordering))  # type: ignore[arg-type]
        for i, v in enumerate([3, 1, 2, 0]):
            buf.add(group(f"g{i}", [0.0, 1.0], version=v), 3)
        return buf

    twin = filled()
    twin.add(group("late", [0.0, 1.0], version=0), 3)
    expected = [g.group_id for g in twin.take(5, 3) or []]
    buf = filled()
    first = buf.take(2, 3)
    assert first is not None
    buf.add(group("late", [0.0, 1.0], version=0), 3)
    buf.put_back(first)
    assert all(g.advantages == [] for g in first)
    assert [g.group_id for g in buf.take(5, 3) or []] == expected
    accounted(buf)


def test_restore_keeps_seq_and_skips_filters() -> None:
    buf = PolicyBuffer(BufferSettings(max_version_lag=0))
    old = group("old", [1.0, 1.0], version=0)
    old.seq = 41
    assert buf.restore(old)
    assert not buf.restore(group("old", [0.0, 1.0]))
    buf.add(group("new", [0.0, 1.0], version=0), 0)
    batch = buf.take(2, 0) or []
    assert [(g.group_id, g.seq) for g in batch] == [("old", 41), ("new", 42)]
    accounted(buf)


def test_remove_by_id() -> None:
    buf = PolicyBuffer()
    for i in range(3):
        buf.add(group(f"g{i}", [0.0, 1.0]), 0)
    assert buf.remove(["g0", "g2", "missing"]) == 2
    assert buf.counters["removed"] == 2 and len(buf) == 1
    accounted(buf)


def test_custom_filter_registry() -> None:
    register_filter("short_only", lambda g: all(t.num_tokens < 5 for t in g.trajectories))
    buf = PolicyBuffer(BufferSettings(filters=["short_only"]))
    assert buf.counters["filtered_short_only"] == 0
    assert buf.add(group("a", [0.0, 1.0]), 0) == "filtered_short_only"
    assert buf.counters["filtered_short_only"] == 1
    with pytest.raises(ValueError, match="no_such_filter"):
        PolicyBuffer(BufferSettings(filters=["short_only", "no_such_filter"]))
    with pytest.raises(ValueError):
        register_filter("short_only", lambda g: True)
    with pytest.raises(ValueError):
        register_filter("stale", lambda g: True)
    with pytest.raises(ValueError):
        register_filter("not a name", lambda g: True)
    accounted(buf)


def test_a_filter_from_an_entry_point_is_found_by_name(tmp_path, monkeypatch) -> None:
    # How `astra serve dataflow` gets a custom filter its config names: a package's entry
    # point in the group `astra.filters` (nothing registers it in that process).
    entry_point_package(
        tmp_path,
        "astra-filter-plugin",
        "astra_filter_plugin_mod",
        "def no_singletons(group):\n    return len(group.trajectories) > 1\n",
        "astra.filters",
        {"no_singletons": "astra_filter_plugin_mod:no_singletons"},
    )
    config = BufferSettings(drop_equal_rewards=False, filters=["no_singletons"])
    with pytest.raises(ValueError, match="no_singletons"):
        PolicyBuffer(config)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        buf = PolicyBuffer(config)
        assert buf.add(group("a", [1.0]), 0) == "filtered_no_singletons"
        assert buf.add(group("b", [0.0, 1.0]), 0) == "accepted"
        assert "no_singletons" in registered_filters()
    finally:
        FILTERS.remove("no_singletons")


def test_a_filter_that_raises_drops_the_group_and_counts_it(caplog) -> None:
    """A custom filter is user code: its exception must not escape `add` (Dataflow calls it
    inside its ingest transaction) but drop the group, counted and logged."""

    def picky(g: GroupRecord) -> bool:
        if g.group_id == "b":
            raise KeyError("metadata missing")
        return True

    register_filter("picky", picky, replace_existing=True)
    buf = PolicyBuffer(BufferSettings(drop_equal_rewards=False, filters=["picky"]))
    assert buf.counters["filter_error_picky"] == 0
    assert buf.add(group("a", [0.0, 1.0]), 0) == "accepted"
    assert buf.add(group("b", [0.0, 1.0]), 0) == "filter_error_picky"
    assert buf.add(group("c", [0.0, 1.0]), 0) == "accepted"
    assert "b" not in buf and len(buf) == 2
    assert buf.counters["filter_error_picky"] == 1 and buf.counters["filtered_picky"] == 0
    assert "picky" in caplog.text and "metadata missing" in caplog.text
    accounted(buf)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_groups": 0},
        {"eviction": "random"},
        {"ordering": "lifo"},
        {"normalization": "rank"},
        {"max_version_lag": -1},
        {"replay_ratio": 1.0},
        {"replay_ratio": 0.5},
        {"max_version_lag": 1, "replay_max_version_lag": 2, "replay_capacity_groups": 4},
        {"adv_eps": -1.0},
    ],
)
def test_bad_config_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        BufferSettings(**kwargs)


def test_staleness_counts_from_the_oldest_token_of_any_trajectory_in_the_group() -> None:
    """Every other fixture stamps one version a group: here one sample finished on a newer
    version (a swap mid-group) and one did not; the group is as old as its oldest token."""

    def mixed(gid: str) -> GroupRecord:
        old = TrajectoryRecord(f"{gid}/0", 0.0, 3, 3, 8, b"x")
        swapped = TrajectoryRecord(f"{gid}/1", 1.0, 4, 5, 8, b"x")  # tokens of 4 and of 5
        return GroupRecord(gid, "policy", 0, [swapped, old])

    buf = PolicyBuffer(BufferSettings(max_version_lag=1))
    assert mixed("a").min_version == 3 and mixed("a").staleness(5) == 2
    assert buf.add(mixed("a"), 5) == "filtered_stale"  # newest token 5: staleness 0 if wrong
    assert buf.add(mixed("b"), 4) == "accepted"  # 4 - 3 = 1, within the bound
    assert buf.take(1, 5) is None  # 5 - 3 = 2 by the time a batch is cut: dropped
    assert buf.counters["filtered_stale"] == 2 and len(buf) == 0
    accounted(buf)


def test_replay_ratio_honoured_and_copies_marked() -> None:
    cfg = BufferSettings(replay_ratio=0.5, replay_capacity_groups=8)
    buf = PolicyBuffer(cfg, rng=random.Random(0))
    for i in range(12):
        buf.add(group(f"g{i}", [0.0, float(i + 1)]), 0)
    first = buf.take(4, 0)
    assert first is not None and not any(g.replay for g in first)  # replay empty yet
    assert buf.replay_len == 0  # not trained yet
    assert buf.remember(first) == [g.group_id for g in first]
    assert buf.replay_len == 4
    originals = {g.group_id: g for g in first}
    snapshot = {k: (list(g.advantages), g.replay) for k, g in originals.items()}
    second = buf.take(4, 0)
    assert second is not None and len(second) == 4
    replayed = [g for g in second if g.replay]
    assert len(replayed) == 2
    for g in replayed:
        assert g.group_id in originals and g is not originals[g.group_id]
        assert g.trajectories is not originals[g.group_id].trajectories
        assert g.trajectories[0] is not originals[g.group_id].trajectories[0]
    for k, g in originals.items():
        assert (g.advantages, g.replay) == snapshot[k]
    assert buf.counters["taken_replay"] == 2 and buf.counters["taken"] == 6


def test_replay_short_means_more_fresh() -> None:
    buf = PolicyBuffer(BufferSettings(replay_ratio=0.5, replay_capacity_groups=8))
    for i in range(6):
        buf.add(group(f"g{i}", [0.0, 1.0]), 0)
    one = buf.take(1, 0)  # replay_ratio 0.5 of 1 = 0 replay
    assert one is not None
    buf.remember(one)
    batch = buf.take(4, 0)
    assert batch is not None and sum(g.replay for g in batch) == 1
    assert len(batch) == 4


def test_replay_capacity_bounded_and_counted() -> None:
    buf = PolicyBuffer(BufferSettings(replay_ratio=0.25, replay_capacity_groups=2))
    for i in range(5):
        buf.add(group(f"g{i}", [0.0, 1.0]), 0)
    taken = buf.take(3, 0)
    buf.remember(taken)
    assert buf.replay_len == 2 and buf.counters["replay_evicted"] == 1
    assert buf.pop_replay_gone() == [taken[0].group_id]  # the oldest to enter left first
    assert buf.pop_replay_gone() == []


def test_replay_respects_its_own_staleness_bound() -> None:
    cfg = BufferSettings(
        max_version_lag=3, replay_ratio=0.5, replay_capacity_groups=8, replay_max_version_lag=1
    )
    buf = PolicyBuffer(cfg)
    for i in range(2):
        buf.add(group(f"old{i}", [0.0, 1.0], version=0), 0)
    buf.remember(buf.take(2, 0))
    for i in range(2):
        buf.add(group(f"new{i}", [0.0, 1.0], version=2), 2)
    batch = buf.take(2, 2)
    assert batch is not None and not any(g.replay for g in batch)
    assert buf.counters["replay_filtered_stale"] == 2
    assert sorted(buf.pop_replay_gone()) == ["old0", "old1"]


def test_replay_inherits_max_version_lag() -> None:
    cfg = BufferSettings(max_version_lag=1, replay_ratio=0.5, replay_capacity_groups=8)
    assert cfg.replay_bound == 1
    buf = PolicyBuffer(cfg)
    buf.add(group("a", [0.0, 1.0], version=0), 0)
    buf.remember(buf.take(1, 0))
    for i in range(2):
        buf.add(group(f"b{i}", [0.0, 1.0], version=2), 2)
    batch = buf.take(2, 2)
    assert batch is not None and not any(g.replay for g in batch)


def second_batch_with_replay() -> tuple[PolicyBuffer, list[GroupRecord]]:
    """4 groups buffered at replay ratio 0.5; the first batch of 2 trained (remembered), the
    second taken: g2 fresh, one of g0/g1 replayed; g3 still buffered."""
    buf = PolicyBuffer(BufferSettings(replay_ratio=0.5, replay_capacity_groups=8))
    for i in range(4):
        buf.add(group(f"g{i}", [0.0, 1.0]), 0)
    buf.remember(buf.take(2, 0))
    batch = buf.take(2, 0)
    assert batch is not None and sum(g.replay for g in batch) == 1
    return buf, batch


def test_put_back_ignores_replay_and_an_untrained_group_never_enters_it() -> None:
    buf, batch = second_batch_with_replay()
    buf.put_back(batch)
    assert len(buf) == 2  # g2 back, plus the untouched one; the replay copy is not inserted
    assert buf.counters["put_back"] == 1
    assert buf.replay_len == 2  # g0, g1 only: the put-back group was never trained
    accounted(buf)


def test_remember_keeps_fresh_groups_only_and_nothing_without_replay() -> None:
    buf, batch = second_batch_with_replay()
    fresh = [g.group_id for g in batch if not g.replay]
    assert buf.remember(batch) == fresh  # the replayed copy does not enter again
    assert buf.replay_len == 3 and buf.counters["replay_added"] == 3
    off = PolicyBuffer(BufferSettings())
    off.add(group("a", [0.0, 1.0]), 0)
    assert off.remember(off.take(1, 0)) == [] and off.replay_len == 0


def test_restore_replay_keeps_order_and_trims_to_this_capacity() -> None:
    buf = PolicyBuffer(BufferSettings(replay_ratio=0.5, replay_capacity_groups=2))
    for i in range(3):
        buf.restore_replay(group(f"r{i}", [0.0, 1.0]))
    assert buf.replay_len == 2 and buf.pop_replay_gone() == ["r0"]
    assert buf.counters["replay_evicted"] == 1 and buf.counters["replay_added"] == 0
    off = PolicyBuffer(BufferSettings())
    off.restore_replay(group("x", [0.0, 1.0]))
    assert off.replay_len == 0 and off.pop_replay_gone() == ["x"]


def _group_adv(rewards: list[float], eps: float) -> list[float]:
    r = np.asarray(rewards, dtype=np.float64)
    return list((r - r.mean()) / (r.std(ddof=0) + eps))


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_group_advantages_match_numpy(eps: float) -> None:
    buf = PolicyBuffer(BufferSettings(normalization="group", adv_eps=eps))
    rewards = [[0.0, 1.0, 1.0, 3.5], [2.0, -1.0], [0.25, 0.5, 0.75]]
    for i, r in enumerate(rewards):
        buf.add(group(f"g{i}", r), 0)
    batch = buf.take(3, 0)
    assert batch is not None
    for g, r in zip(batch, rewards, strict=True):
        np.testing.assert_allclose(g.advantages, _group_adv(r, eps), rtol=1e-12)


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_batch_advantages_match_numpy(eps: float) -> None:
    buf = PolicyBuffer(BufferSettings(normalization="batch", adv_eps=eps))
    rewards = [[0.0, 1.0, 1.0, 3.5], [2.0, -1.0], [0.25, 0.5, 0.75]]
    for i, r in enumerate(rewards):
        buf.add(group(f"g{i}", r), 0)
    batch = buf.take(3, 0)
    assert batch is not None
    every = np.concatenate([np.asarray(r) for r in rewards])
    mean, std = every.mean(), every.std(ddof=0)
    for g, r in zip(batch, rewards, strict=True):
        np.testing.assert_allclose(g.advantages, (np.asarray(r) - mean) / (std + eps), rtol=1e-12)


@pytest.mark.parametrize("sizes", [(3, 3), (3, 2)])  # one size: the row-wise path; two: per group
def test_equal_rewards_with_eps_zero_give_zero_advantages_not_nan(sizes) -> None:
    """Also where the mean of equal rewards rounds (3 x 0.1): no +-1 from dividing the rounding."""
    buf = PolicyBuffer(BufferSettings(normalization="group", adv_eps=0.0, drop_equal_rewards=False))
    buf.add(group("same", [0.1] * sizes[0]), 0)
    mixed = [0.0, 1.0, 2.0][: sizes[1]]
    buf.add(group("mixed", mixed), 0)
    batch = buf.take(2, 0)
    assert batch is not None
    assert batch[0].advantages == [0.0] * sizes[0]
    np.testing.assert_allclose(batch[1].advantages, _group_adv(mixed, 0.0), rtol=1e-12)


def test_mean_only_and_no_normalisation() -> None:
    centred = PolicyBuffer(BufferSettings(std_normalize=False))
    centred.add(group("a", [1.0, 3.0]), 0)
    assert (centred.take(1, 0) or [])[0].advantages == [-1.0, 1.0]
    raw = PolicyBuffer(BufferSettings(normalization="none"))
    raw.add(group("a", [1.0, 3.0]), 0)
    assert (raw.take(1, 0) or [])[0].advantages == [1.0, 3.0]


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    bound = rng.choice([0, 1, 3])
    cfg = BufferSettings(
        capacity_groups=rng.choice([3, 8]),
        eviction=rng.choice(["drop_oldest", "reject_new"]),
        max_version_lag=bound,
        ordering=rng.choice(["fifo", "oldest_version_first"]),
        replay_ratio=rng.choice([0.0, 0.3, 0.5]),
        replay_capacity_groups=6,
        replay_max_version_lag=rng.choice([None, 0]),
        normalization=rng.choice(["group", "batch"]),
    )
    replay_bound = cfg.replay_bound
    buf = PolicyBuffer(cfg, rng=random.Random(seed))
    version = 0
    leased: list[list[GroupRecord]] = []
    previous = buf.counters
    for step in range(400):
        op = rng.random()
        if op < 0.55:
            v = max(0, version - rng.choice([0, 0, 1, 1, 2, 4]))
            rewards = [float(rng.randint(0, 2)) for _ in range(rng.randint(1, 4))]
            g = group(f"g{rng.randint(0, 60)}", rewards, version=v)
            for t in g.trajectories:
                t.failed = rng.random() < 0.1
            buf.add(g, version)
        elif op < 0.75:
            batch = buf.take(rng.randint(1, 4), version)
            if batch is not None:
                for g in batch:
                    limit = replay_bound if g.replay else bound
                    assert g.staleness(version) <= limit
                    assert len(g.advantages) == len(g.trajectories)
                    assert not any(t.failed for t in g.trajectories)
                ids = [g.group_id for g in batch if not g.replay]
                assert len(ids) == len(set(ids))
                leased.append(batch)
        elif op < 0.82 and leased:
            buf.put_back(leased.pop(rng.randrange(len(leased))))
        elif op < 0.87:
            buf.remove([f"g{rng.randint(0, 60)}"])
        elif op < 0.97:
            version += 1
        else:
            buf.drop_stale(version)
        accounted(buf)
        now = buf.counters
        assert all(now[k] >= previous.get(k, 0) for k in now), step
        previous = now
    assert buf.replay_len <= cfg.replay_capacity_groups
