"""Whether Dataflow may start new groups now, and why not, in words.

`Admission` evaluates the Flux mode gate (astra.dataflow.gate) over the run's numbers: the
off-policy capacity (astra.dataflow.offpolicy), the buffers' fill counting what is in flight
and what trainers hold leased, and the staleness score. It also says how many groups a stream
may start before its buffers would pass the high watermark, whether the data is used up, and
`why` nothing is admitted (the status line users read). It decides; it never dispatches.
The time spent in each gate mode is counted (`gate_ms.<MODE>` in the counters).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from astra.dataflow.batches import BatchDesk
from astra.dataflow.buffer import PolicyBuffer
from astra.dataflow.config import DataflowConfig, StreamSettings
from astra.dataflow.dataset import PromptSource
from astra.dataflow.gate import GateMode, GateState, ModeGate, StalenessTracker
from astra.dataflow.offpolicy import OffPolicyBudget
from astra.dataflow.pool import Pool
from astra.dataflow.status import DATA_EXHAUSTED
from astra.dataflow.storage_guard import StorageGuard
from astra.dataflow.versions import VersionBook
from astra.dataflow.work import WorkTable

POOL_EMPTY = "pool empty: waiting for a rollout service to register"


class Admission:
    def __init__(
        self,
        config: DataflowConfig,
        pool: Pool,
        buffers: dict[str, PolicyBuffer],
        batches: BatchDesk,
        versions: VersionBook,
        sources: dict[str, PromptSource],
        table: WorkTable,
        budget: OffPolicyBudget,
        storage: StorageGuard,
        is_eval: Callable[[str], bool],
        counters: Counter[str],
    ) -> None:
        self.config, self.pool, self.buffers, self.batches = config, pool, buffers, batches
        self.versions, self.sources, self.table, self.budget = versions, sources, table, budget
        self.storage, self.is_eval = storage, is_eval
        self.gate = ModeGate(config.gate)
        # The score counts the gap beyond what the off-policy bound allows (GateSettings).
        self.staleness = StalenessTracker(gap_allowance=config.gate.gap_allowance)
        # A run starts on-policy; one late group must not set the score on its own.
        self.staleness.update(0.0)
        self.state: GateState | None = None  # the last decision
        # Milliseconds the gate spent in each mode (`gate_ms.<MODE>`): a decision holds until
        # the next one. The remainder below a millisecond is carried, not dropped.
        self.counters, self.clock = counters, time.monotonic
        self._since, self._carry_ms = 0.0, 0.0  # set by the first decision

    def training_streams(self) -> list[StreamSettings]:
        return [s for s in self.config.streams if not self.is_eval(s.name)]

    def held(self, policy_id: str) -> int:
        """Groups the policy's buffer holds or may get back: buffered, and fresh groups leased
        to a trainer (an expired lease puts them back, whatever the buffer's capacity)."""
        return len(self.buffers[policy_id]) + self.batches.leased_fresh(policy_id)

    def buffer_room(self, stream: StreamSettings) -> int:
        """Groups that may still be dispatched before the stream's buffers would pass the
        high watermark, counting what is in flight and what trainers hold leased: admission
        never overfills a buffer."""
        in_flight = self.table.in_flight()
        mark = self.config.gate.buffer_high_watermark
        return max(
            0,
            min(
                int(mark * self.config.policy(p).buffer.capacity_groups) - self.held(p) - in_flight
                for p in stream.policy_ids
            ),
        )

    def evaluate(self) -> GateState:
        training = self.training_streams()
        capacity = 0 if self.pool.empty else sum(self.budget.stream_capacity(s) for s in training)
        in_flight = self.table.in_flight()
        # Groups in flight will land in the buffers, and leased ones may come back: count
        # them, or a full pool overfills.
        fill = max(
            (self.held(p) + in_flight) / self.config.policy(p).buffer.capacity_groups
            for p in self.buffers
        )
        if in_flight == 0 and self.gate.mode is GateMode.SYNC_BARRIER:
            # The barrier has drained: whatever is dispatched next starts at the current
            # version, so the observed gap is 0 until results say otherwise.
            self.staleness.update(0.0)
        previous = self.state
        self.state = self.gate.evaluate(self.staleness.value, capacity, fill, in_flight)
        now = self.clock()
        if previous is not None:
            ms = (now - self._since) * 1e3 + self._carry_ms
            self.counters[f"gate_ms.{previous.mode.name}"] += int(ms)
            self._carry_ms = ms - int(ms)
        self._since = now
        return self.state

    def data_exhausted(self) -> bool:
        """Every training stream's dataset is used up and none of its groups is unfinished."""
        training = {s.name for s in self.training_streams()}
        return (
            bool(training)
            and all(self.sources[n].exhausted for n in training)
            and not self.table.has_stream(training)
        )

    def why(self) -> str:
        """Why work is or is not being admitted, in words."""
        if self.storage.paused:
            return self.storage.reason
        if self.data_exhausted():
            return (
                f"{DATA_EXHAUSTED}: every training stream ran its num_epochs and no "
                "group is left to generate; what is buffered is all there will be"
            )
        if self.pool.empty:
            return POOL_EMPTY
        state = self.state or self.evaluate()
        lag = self.budget.max_version_lag
        if state.capacity <= 0 and lag is not None and self.table.in_flight() == 0:
            versions = {p.id: self.versions.current(p.id) for p in self.config.policies}
            return (
                f"off-policy bound reached (gate.max_version_lag={lag}, versions {versions}): "
                "waiting for the trainer's next version"
            )
        return state.reason
