"""The training buffer of one policy: admission, order, replay and advantages.

`PolicyBuffer` holds the finished `GroupRecord`s of a single policy between rollout and
training. On `add` it drops failed trajectories, then rejects groups that are too stale, whose
rewards are all equal (dynamic sampling) or that a custom filter refuses, and enforces its
capacity. `take` hands out a batch in FIFO or oldest-version-first order, mixes in a share of
replayed copies, and stamps group- or batch-normalised advantages. Nothing with staleness above
the configured bound ever leaves `take`, and every group it is given is either still inside or
accounted for by exactly one counter (see INVARIANTS.md, "Nothing disappears without a counter
moving").

This module never touches gRPC, protobuf, the network, disk, clocks or locks: the caller
serialises access, persists admissions and removals (`drop_stale`, `pop_dropped`,
`pop_replay_gone`), and says which trainer version is current.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np

from astra.dataflow.config import BufferSettings
from astra.dataflow.records import GroupRecord
from astra.plugins import Registry

log = logging.getLogger(__name__)

FilterFn = Callable[[GroupRecord], bool]

ACCEPTED = "accepted"
DUPLICATE = "duplicate"
FAILED = "failed"
FILTERED_STALE = "filtered_stale"
FILTERED_EQUAL_REWARD = "filtered_equal_reward"
REJECTED_FULL = "rejected_full"

# Every counter exists from the start, so a dashboard sees zeros rather than gaps.
_COUNTERS = (
    "added",
    "accepted",
    "restored",
    "put_back",
    "taken",
    "taken_replay",
    "removed",
    DUPLICATE,
    "failed_groups",
    "failed_trajectories",
    FILTERED_STALE,
    FILTERED_EQUAL_REWARD,
    REJECTED_FULL,
    "evicted_full",
    "replay_added",
    "replay_evicted",
    "replay_filtered_stale",
)

# Custom filters: registered in process, or plugins of the entry-point group `astra.filters`
# (how `astra serve dataflow` finds a filter a config names).
FILTERS: Registry[FilterFn] = Registry("buffer filter", "astra.filters")
_RESERVED_FILTER_NAMES = frozenset({"stale", "equal_reward"})
# Floating error in `n * ratio` (0.29 * 100 = 28.999...) must not lose a replay slot.
_RATIO_SLACK = 1e-9


def register_filter(name: str, fn: FilterFn, *, replace_existing: bool = False) -> None:
    """Register a custom group filter; `fn(group)` returns True to keep the group.

    Drops are counted as `filtered_<name>`, so `name` must be a Python identifier and must not
    shadow a built-in filter. A filter that raises drops the group too, counted as
    `filter_error_<name>` and logged. Registering a taken name raises unless `replace_existing`.
    A package can ship one as an entry point instead (group `astra.filters`, the same rules).
    """
    _check_filter_name(name)
    if name in FILTERS and not replace_existing:
        raise ValueError(f"filter {name!r} is already registered")
    FILTERS.add(name, fn, replace=True)


def _check_filter_name(name: str) -> None:
    if not name.isidentifier() or name in _RESERVED_FILTER_NAMES:
        raise ValueError(f"invalid filter name {name!r}")


def registered_filters() -> list[str]:
    """Names of all custom filters, entry-point plugins included."""
    return list(FILTERS.names())


def _is_stale(group: GroupRecord, bound: int | None, current_version: int) -> bool:
    return bound is not None and group.staleness(current_version) > bound


def _copy(group: GroupRecord, *, replay: bool) -> GroupRecord:
    trajectories = [replace(t) for t in group.trajectories]
    return replace(group, trajectories=trajectories, replay=replay, advantages=[])


class PolicyBuffer:
    """The buffer of one policy. Not thread-safe: the caller serialises calls."""

    def __init__(self, config: BufferSettings | None = None, rng: random.Random | None = None):
        self.config = config or BufferSettings()
        self._filters = []
        for name in self.config.filters:
            _check_filter_name(name)
            fn = FILTERS.find(name)
            if fn is None:
                raise ValueError(str(FILTERS.missing(name)))
            self._filters.append((name, fn))
        self._rng = rng or random.Random()
        self._groups: dict[str, GroupRecord] = {}
        self._replay: OrderedDict[str, GroupRecord] = OrderedDict()
        self._dropped: list[GroupRecord] = []
        self._replay_gone: list[str] = []
        self._next_seq = 0
        self._eviction: list[tuple[int, int, str]] = []
        # Take order as a heap of (min_version or 0 for fifo, seq, group id); entries of
        # groups that left are skipped when popped, as in the eviction heap.
        self._order: list[tuple[int, int, str]] = []
        self._counters: Counter[str] = Counter()
        # Finished groups dropped one after another since the last one accepted, and why the
        # newest was: a count that keeps growing means no batch can form (every group filtered
        # as equal-reward once the policy has learned its data, say). Dataflow keeps it durably.
        self.dropped_in_a_row = 0
        self.last_drop = ""
        for key in _COUNTERS + tuple(
            f"{kind}_{name}" for name, _ in self._filters for kind in ("filtered", "filter_error")
        ):
            self._counters[key] = 0

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    @property
    def replay_len(self) -> int:
        return len(self._replay)

    @property
    def fill_ratio(self) -> float:
        return len(self._groups) / self.config.capacity_groups

    @property
    def counters(self) -> dict[str, int]:
        """Monotonic counts of every outcome (a copy)."""
        return dict(self._counters)

    def restore_counters(self, saved: dict[str, int]) -> None:
        """Counters as durably recorded before a restart (before any `restore`)."""
        for key, value in saved.items():
            self._counters[key] = int(value)

    def add(self, group: GroupRecord, current_version: int) -> str:
        """Admit a finished group, or say why not. The buffer takes ownership of `group`.

        Checks in order: duplicate id, failed trajectories (removed; none left -> "failed"),
        staleness, equal rewards, custom filters, capacity. Returns the outcome name.
        """
        outcome = self._add(group, current_version)
        self.note(outcome)
        return outcome

    def note(self, outcome: str) -> None:
        """Keeps `dropped_in_a_row`: an accepted group ends a run of drops; a duplicate or a
        group refused by a full buffer (batches can form) neither ends nor extends it."""
        if outcome == ACCEPTED:
            self.dropped_in_a_row = 0
        elif outcome not in (DUPLICATE, REJECTED_FULL):
            self.dropped_in_a_row += 1
            self.last_drop = outcome

    def _add(self, group: GroupRecord, current_version: int) -> str:
        self._counters["added"] += 1
        if group.group_id in self._groups:
            return self._count(DUPLICATE)
        kept = [t for t in group.trajectories if not t.failed]
        self._counters["failed_trajectories"] += len(group.trajectories) - len(kept)
        group.trajectories = kept
        if not kept:
            self._counters["failed_groups"] += 1
            return FAILED
        if _is_stale(group, self.config.max_version_lag, current_version):
            return self._count(FILTERED_STALE)
        if self.config.drop_equal_rewards and len(kept) >= 2 and len(set(group.rewards)) == 1:
            return self._count(FILTERED_EQUAL_REWARD)
        for name, keep in self._filters:
            try:
                kept_by_filter = keep(group)
            except Exception:
                # User code: its bug must not escape into the caller's transaction.
                log.exception("buffer filter %r failed on group %s: dropped", name, group.group_id)
                return self._count(f"filter_error_{name}")
            if not kept_by_filter:
                return self._count(f"filtered_{name}")
        while len(self._groups) >= self.config.capacity_groups:
            if self.config.eviction == "reject_new":
                return self._count(REJECTED_FULL)
            victim = self._pop_eviction_victim()
            del self._groups[victim.group_id]
            self._dropped.append(victim)
            self._counters["evicted_full"] += 1
            self._compact_eviction()
        group.seq = self._next_seq
        self._next_seq += 1
        group.replay = False
        group.advantages = []
        self._insert(group)
        return self._count(ACCEPTED)

    def likely_accepts(self, trajectories: list, current_version: int) -> bool:
        """A guess, with no effect, whether `add` would accept a group of these (non-failed)
        trajectories: not empty, not stale, not all rewards equal when those are dropped.
        Lets a caller prepare work ahead (Dataflow writes the bytes) for what will likely
        be kept; `add` alone decides."""
        if not trajectories:
            return False
        group = GroupRecord("", "", 0, trajectories)
        if _is_stale(group, self.config.max_version_lag, current_version):
            return False
        return not (
            self.config.drop_equal_rewards
            and len(trajectories) >= 2
            and len(set(group.rewards)) == 1
        )

    def take(self, n_groups: int, current_version: int) -> list[GroupRecord] | None:
        """A batch of exactly `n_groups` groups with advantages, fresh first, or None.

        Groups above the staleness bound are dropped first (see `pop_dropped`). If fewer fresh
        groups remain than the batch needs, returns None and takes nothing. Replayed groups are
        new copies with replay=True; the fresh groups taken enter replay only once their batch
        is trained (`remember`).
        """
        if n_groups < 1:
            raise ValueError("n_groups must be >= 1")
        self._dropped.extend(self.drop_stale(current_version))
        self._expire_replay(current_version)
        n_replay = min(self.replays_wanted(n_groups), len(self._replay))
        n_fresh = n_groups - n_replay
        if len(self._groups) < n_fresh:
            return None
        fresh = self._pop_in_order(n_fresh)
        replayed = [
            _copy(g, replay=True) for g in self._rng.sample(list(self._replay.values()), n_replay)
        ]
        for group in fresh:
            del self._groups[group.group_id]
            group.replay = False
        self._compact_eviction()
        self._counters["taken"] += n_fresh
        self._counters["taken_replay"] += n_replay
        batch = fresh + replayed
        self._stamp_advantages(batch)
        return batch

    def replays_wanted(self, n_groups: int) -> int:
        """Replayed copies a batch of `n_groups` takes when replay holds that many."""
        if self.config.replay_ratio <= 0:
            return 0
        return math.floor(n_groups * self.config.replay_ratio + _RATIO_SLACK)

    def put_back(self, groups: Iterable[GroupRecord]) -> None:
        """Re-insert taken groups (a trainer's lease expired) at their original priority.

        Replayed copies are ignored (a fresh group enters replay only once trained). Capacity is
        not enforced here: these groups were already admitted.
        """
        for group in groups:
            if group.replay:
                continue
            self._counters["put_back"] += 1
            if group.group_id in self._groups:
                self._counters[DUPLICATE] += 1
                continue
            group.advantages = []
            self._insert(group)

    def restore(self, group: GroupRecord) -> bool:
        """Insert a group reloaded from durable storage, unfiltered and keeping its seq.

        Returns False (counted `duplicate`) if its id is already buffered.
        """
        self._counters["restored"] += 1
        if group.group_id in self._groups:
            self._counters[DUPLICATE] += 1
            return False
        group.replay = False
        group.advantages = []
        self._next_seq = max(self._next_seq, group.seq + 1)
        self._insert(group)
        return True

    def _insert(self, group: GroupRecord) -> None:
        self._groups[group.group_id] = group
        # Eviction order (oldest version first, then arrival); entries of groups that
        # left the buffer are skipped lazily when popped.
        heapq.heappush(self._eviction, (group.min_version, group.seq, group.group_id))
        heapq.heappush(self._order, self._order_entry(group))

    def _order_entry(self, group: GroupRecord) -> tuple[int, int, str]:
        first = 0 if self.config.ordering == "fifo" else group.min_version
        return (first, group.seq, group.group_id)

    def _pop_in_order(self, n: int) -> list[GroupRecord]:
        """The `n` buffered groups first in take order (len(self) >= n), not yet removed:
        the same groups, in the same order, as sorting every buffered group by
        `_order_key`, for O(n log size) instead of O(size)."""
        out: list[GroupRecord] = []
        chosen: set[str] = set()
        while len(out) < n:
            _, seq, group_id = heapq.heappop(self._order)
            group = self._groups.get(group_id)
            if group is None or group.seq != seq or group_id in chosen:
                continue
            chosen.add(group_id)
            out.append(group)
        return out

    def _pop_eviction_victim(self) -> GroupRecord:
        while True:
            _, seq, group_id = heapq.heappop(self._eviction)
            group = self._groups.get(group_id)
            if group is not None and group.seq == seq:
                return group

    def _compact_eviction(self) -> None:
        if len(self._eviction) > 4 * len(self._groups) + 64:
            self._eviction = [(g.min_version, g.seq, g.group_id) for g in self._groups.values()]
            heapq.heapify(self._eviction)
        if len(self._order) > 4 * len(self._groups) + 64:
            self._order = [self._order_entry(g) for g in self._groups.values()]
            heapq.heapify(self._order)

    def remove(self, group_ids: Iterable[str]) -> int:
        """Remove buffered groups by id (counted `removed`); returns how many were present."""
        removed = 0
        for group_id in group_ids:
            if self._groups.pop(group_id, None) is not None:
                removed += 1
        self._counters["removed"] += removed
        self._compact_eviction()
        return removed

    def drop_stale(self, current_version: int) -> list[GroupRecord]:
        """Remove and return the buffered groups above the staleness bound."""
        bound = self.config.max_version_lag
        if bound is None:
            return []
        stale = [g for g in self._groups.values() if _is_stale(g, bound, current_version)]
        for group in stale:
            del self._groups[group.group_id]
        self._counters[FILTERED_STALE] += len(stale)
        self._compact_eviction()
        return stale

    @property
    def has_dropped(self) -> bool:
        """Whether groups left the buffer or replay on their own since `pop_dropped` and
        `pop_replay_gone` were last called."""
        return bool(self._dropped or self._replay_gone)

    def pop_dropped(self) -> list[GroupRecord]:
        """Groups the buffer removed on its own (eviction in add, expiry in take) since last call.

        The caller persists their removal; they are already counted.
        """
        dropped, self._dropped = self._dropped, []
        return dropped

    def _count(self, outcome: str) -> str:
        self._counters[outcome] += 1
        return outcome

    def _order_key(self, group: GroupRecord) -> tuple[int, ...]:
        if self.config.ordering == "fifo":
            return (group.seq,)
        return (group.min_version, group.seq)

    @property
    def keeps_replay(self) -> bool:
        return self.config.replay_capacity_groups > 0 and self.config.replay_ratio > 0

    def remember(self, groups: Iterable[GroupRecord]) -> list[str]:
        """The fresh groups of a trained (acknowledged) batch enter replay as copies, the oldest
        remembered leaving first beyond capacity. Returns the ids that entered; what left
        is reported by `pop_replay_gone`."""
        if not self.keeps_replay:
            return []
        entered = []
        for group in groups:
            if group.replay:
                continue
            self._replay[group.group_id] = _copy(group, replay=True)
            self._replay.move_to_end(group.group_id)
            self._counters["replay_added"] += 1
            entered.append(group.group_id)
        self._trim_replay()
        return entered

    def restore_replay(self, group: GroupRecord) -> None:
        """Re-enters a group remembered before a restart (oldest first), uncounted; beyond
        this configuration's capacity (or with replay off) the oldest leave, counted
        `replay_evicted`."""
        self._replay[group.group_id] = _copy(group, replay=True)
        self._replay.move_to_end(group.group_id)
        self._trim_replay()

    def _trim_replay(self) -> None:
        capacity = self.config.replay_capacity_groups if self.keeps_replay else 0
        while len(self._replay) > capacity:
            group_id, _ = self._replay.popitem(last=False)
            self._replay_gone.append(group_id)
            self._counters["replay_evicted"] += 1

    def pop_replay_gone(self) -> list[str]:
        """Ids that left replay (evicted, expired) since the last call: the caller persists it."""
        gone, self._replay_gone = self._replay_gone, []
        return gone

    def _expire_replay(self, current_version: int) -> None:
        bound = self.config.replay_bound
        stale = [k for k, g in self._replay.items() if _is_stale(g, bound, current_version)]
        for group_id in stale:
            del self._replay[group_id]
        self._replay_gone.extend(stale)
        self._counters["replay_filtered_stale"] += len(stale)

    def stamp_advantages(self, batch: list[GroupRecord]) -> None:
        """Sets each group's advantages as `take` does for this batch (a function of the
        batch's rewards and the normalisation settings only)."""
        self._stamp_advantages(batch)

    def _stamp_advantages(self, batch: list[GroupRecord]) -> None:
        mode = self.config.normalization
        if mode == "none":
            for group in batch:
                group.advantages = [float(r) for r in group.rewards]
            return
        every = np.array([r for g in batch for r in g.rewards], dtype=np.float64)
        batch_mean, batch_std = float(every.mean()), float(every.std())
        sizes = {len(g.trajectories) for g in batch}
        if mode == "group" and len(sizes) == 1:
            # Groups of one size (the usual case): one numpy pass over a (groups, size)
            # array instead of five numpy calls per group; the same floats per row.
            rows = every.reshape(len(batch), sizes.pop())
            centred = rows - rows.mean(axis=1, keepdims=True)
            if self.config.std_normalize:
                scale = rows.std(axis=1, keepdims=True) + self.config.adv_eps
                centred = np.divide(centred, scale, out=np.zeros_like(centred), where=scale > 0)
            # Equal rewards carry no signal: exactly 0, whatever rounding left in the mean
            # (with adv_eps 0 it would be divided up to +-1, or 0/0).
            centred[rows.max(axis=1) == rows.min(axis=1)] = 0.0
            for group, advantages in zip(batch, centred.tolist(), strict=True):
                group.advantages = advantages
            return
        batch_equal = every.size > 0 and every.max() == every.min()
        for group in batch:
            rewards = np.asarray(group.rewards, dtype=np.float64)
            mean, std = (
                (rewards.mean(), rewards.std()) if mode == "group" else (batch_mean, batch_std)
            )
            centred = rewards - mean
            if mode == "batch":
                equal = batch_equal
            else:
                equal = rewards.size > 0 and rewards.max() == rewards.min()
            if equal:
                centred = np.zeros_like(rewards)  # equal rewards: no signal, exactly 0
            elif self.config.std_normalize and std + self.config.adv_eps > 0:
                centred = centred / (std + self.config.adv_eps)
            group.advantages = [float(a) for a in centred]
