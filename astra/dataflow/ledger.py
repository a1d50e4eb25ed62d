"""The run's counts that are durable: counters, AReaL's slot counts, the buffers' drop runs.

`Ledger` holds the named counters every part of Dataflow adds to, the fresh groups
`accepted` per policy and the `replay_slots` (replayed copies in the batches taken) that
AReaL's off-policy bound counts against (astra.dataflow.offpolicy), and writes them with the
buffers' own counters in the caller's transaction. `let_go` gives back the slots of groups a
buffer let go untrained. Pure bookkeeping: it never dispatches, waits or touches gRPC.
"""

from __future__ import annotations

from collections import Counter

from astra.dataflow.buffer import PolicyBuffer

KEYS = ("buffer_counters", "drop_streaks")  # per-policy state kept for unconfigured policies


class Ledger:
    def __init__(self, buffers: dict[str, PolicyBuffer]) -> None:
        self.buffers = buffers
        self.counters: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        # Replayed copies in the batches taken (leased or acknowledged) per policy: each
        # fills a batch slot that AReaL's bound otherwise counts for a fresh group.
        self.replay_slots: Counter[str] = Counter()
        # Per-policy state of policies this configuration lacks: kept as saved.
        self.unconfigured: dict[str, dict] = {key: {} for key in KEYS}
        self._saved: tuple = ()

    def restore(self, get) -> bool:
        """Reads the counts back (`get`: the store's key lookup). Returns whether the
        replayed copies were never counted (a schema-1 state directory): the caller counts
        them from the batches (astra.dataflow.recovery)."""
        self.counters.update(get("counters", {}))
        self.accepted.update(get("accepted", {}))
        uncounted = get("replay_slots") is None and get("accepted") is not None
        self.replay_slots.update(get("replay_slots", {}))
        self.unconfigured = {
            key: {p: v for p, v in (get(key) or {}).items() if p not in self.buffers}
            for key in KEYS
        }
        # Before the groups are restored (which counts them `restored`).
        for policy_id, saved in get("buffer_counters", {}).items():
            if policy_id in self.buffers:
                self.buffers[policy_id].restore_counters(saved)
        for policy_id, (n, last) in get("drop_streaks", {}).items():
            if (buf := self.buffers.get(policy_id)) is not None:  # a stall stays counted
                buf.dropped_in_a_row, buf.last_drop = n, last
        return uncounted

    def _state(self) -> tuple:
        return (
            dict(self.counters),
            {p: b.counters for p, b in self.buffers.items()},
            {p: [b.dropped_in_a_row, b.last_drop] for p, b in self.buffers.items()},
        )

    @property
    def dirty(self) -> bool:
        """Whether a count changed since the last `persist`."""
        return self._state() != self._saved

    def persist(self, tx) -> None:
        state = self._state()
        tx.put("counters", state[0])
        tx.put("accepted", dict(self.accepted))
        tx.put("replay_slots", dict(self.replay_slots))
        tx.put("buffer_counters", self.unconfigured["buffer_counters"] | state[1])
        tx.put("drop_streaks", self.unconfigured["drop_streaks"] | state[2])
        self._saved = state

    def let_go(self, tx, policy_id: str) -> None:
        """Persists the removal of the groups the policy's buffer let go untrained (evicted
        when full, expired as stale at a take) and frees their slots in AReaL's bound: they
        were counted in `accepted` and no batch will train them, so each would otherwise
        shrink the off-policy budget for good (after (eta + 1) * batch_groups of them nothing
        would be dispatched again, and no batch could fill)."""
        buf = self.buffers[policy_id]
        dropped = buf.pop_dropped()
        if dropped:
            tx.delete_groups((g.group_id, g.policy_id) for g in dropped)
            self.accepted[policy_id] = max(0, self.accepted[policy_id] - len(dropped))
        tx.forget_replays(policy_id, buf.pop_replay_gone())  # trained already: no slot back
