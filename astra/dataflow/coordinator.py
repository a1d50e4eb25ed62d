"""Dataflow, the coordinator: dispatches prompt groups, ingests results, serves batches.

It owns the run's state (work table, buffers, versions, counters), keeps it
durable through `StateStore`, and drives three background loops: dispatch
(admission gate -> pool routing -> submit, here), collection (one long-poll
per instance, ingest, acknowledge: astra.dataflow.ingesting), and upkeep
(leases, liveness probes here; weight loads: astra.dataflow.weight_sync). It
reaches rollout services only through `RolloutPort`, so it never imports gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import time
import uuid
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from astra.dataflow.batches import BatchDesk
from astra.dataflow.buffer import BufferConfig, PolicyBuffer
from astra.dataflow.config import DataflowConfig, StreamSettings
from astra.dataflow.dataset import DatasetConfig, PromptSource
from astra.dataflow.done import DoneGroups
from astra.dataflow.evals import EvalDesk
from astra.dataflow.folding import EpochFolder
from astra.dataflow.gate import (
    GateConfig,
    GateMode,
    GateState,
    ModeGate,
    StalenessTracker,
    offpolicy_capacity,
)
from astra.dataflow.ingesting import Ingesting
from astra.dataflow.pool import Instance, InstanceState, Pool
from astra.dataflow.ports import Connector, PortError
from astra.dataflow.quarantine import KEY as REDO_KEY
from astra.dataflow.quarantine import Redo, quarantine
from astra.dataflow.records import GroupRecord, WorkItem
from astra.dataflow.status import DATA_EXHAUSTED, dataflow_status
from astra.dataflow.storage_guard import StorageGuard
from astra.dataflow.store import StateStore, is_storage_error
from astra.dataflow.versions import VersionBook
from astra.dataflow.weight_sync import WeightSync
from astra.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

SUBMIT_BATCH = 32
TRAINER_FIRST_MAX_S = 0.5
# The dispatcher runs when woken (registration, heartbeat, result, version, finished weight
# load, requeue) and at the latest this often.
IDLE_POLL_S = 0.2
EXIT_STORAGE_FAILED = 75  # EX_TEMPFAIL: a supervisor restarts the process, which recovers
POOL_EMPTY = "pool empty: waiting for a rollout service to register"


@dataclass(slots=True)
class Work:
    """A group that is not done: waiting (instance None) or leased to an instance."""

    item: WorkItem
    stream: str
    instance_id: str | None = None
    lease_expire: float | None = None
    attempts: int = 0


class TrainerTurn:
    """While held, collects, ingest and dispatch wait (see `Dataflow.after_trainers`)."""

    __slots__ = ("df", "held")

    def __init__(self, df: Dataflow) -> None:
        self.df = df
        self.held = False

    def hold(self) -> None:
        if not self.held:
            self.held = True
            self.df._streaming += 1
            self.df._trainers_idle.clear()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.df._streaming -= 1
            if self.df._streaming == 0:
                self.df._trainers_idle.set()


class Dataflow(Ingesting, WeightSync):
    def __init__(self, config: DataflowConfig, connect: Connector) -> None:
        self.config = config
        self.dataflow_id = uuid.uuid4().hex[:12]
        self.store = StateStore(config.state_dir, segment_bytes=config.storage.blob_segment_bytes)
        self.store.on_failure = self._storage_failed
        st = config.storage
        self.storage = StorageGuard(
            Path(config.state_dir), st.min_free_bytes, st.resume_at, st.check_interval_s
        )
        self._storage_pauses_seen, self._storage_was_paused = 0, False
        self._storage_paused_at = 0.0
        self.pool = Pool(config.pool, connect)
        self.streams: dict[str, StreamSettings] = {s.name: s for s in config.streams}
        self.sources: dict[str, PromptSource] = {}
        self.evals = EvalDesk(
            {s.name: s.eval_every_versions for s in config.streams},
            {s.name: list(s.policy_ids) for s in config.streams},
        )
        for s in config.streams:
            d = s.dataset
            # An evaluation stream's "epoch" is the version it evaluates (astra.dataflow.evals).
            epochs = 0 if self.evals.is_eval(s.name) else d.num_epochs
            self.sources[s.name] = PromptSource(
                DatasetConfig(d.path, d.prompt_field, epochs, d.shuffle, d.seed),
                tuple(s.policy_ids),
                s.workflow,
                s.group_size,
                s.name,
            )
        try:
            self.buffers = {
                p.id: PolicyBuffer(BufferConfig(**p.buffer.model_dump())) for p in config.policies
            }
        except ValueError as exc:
            raise InvalidArgument(f"buffer config: {exc}", reason="INVALID_CONFIG") from exc
        self.versions = VersionBook([p.id for p in config.policies], config.versions.barrier)
        g = config.gate
        self.gate = ModeGate(
            GateConfig(
                staleness_threshold=g.staleness_threshold,
                capacity_low_watermark=g.capacity_low_watermark,
                buffer_high_watermark=g.buffer_high_watermark,
                min_barrier_duration_s=g.min_barrier_duration_s,
                barrier_exit_ratio=g.barrier_exit_ratio,
            )
        )
        self.staleness = StalenessTracker()
        # A run starts on-policy; one late group must not set the score on its own.
        self.staleness.update(0.0)
        self.counters: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        # Replayed copies in the batches taken (leased or acknowledged) per policy: each
        # fills a batch slot that AReaL's bound otherwise counts for a fresh group.
        self.replay_slots: Counter[str] = Counter()
        self.work: dict[str, Work] = {}
        # Groups of `work` leased to instances, per stream: kept as groups are leased
        # (`_lease`), requeued (`_requeue`) and ingested, so the dispatch round's bounds
        # never scan `work`.
        self._running_by_stream: Counter[str] = Counter()
        # The training streams that feed each policy's buffer.
        self._feeding: dict[str, list[str]] = {
            p.id: [
                s.name
                for s in config.streams
                if p.id in s.policy_ids and not self.evals.is_eval(s.name)
            ]
            for p in config.policies
        }
        self.waiting: deque[str] = deque()
        # Groups with an outcome: the newest in memory, the rest in the work table.
        self.done = DoneGroups(self.store.is_done, self.store.done_count())
        self.batches = BatchDesk(self)
        self.gate_state: GateState | None = None
        self._wake = asyncio.Event()
        self.data_ready = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._collectors: dict[str, asyncio.Task] = {}
        self._loads: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._saved_counters: tuple = ()
        self._unconfigured: dict[str, dict] = {"buffer_counters": {}, "drop_streaks": {}}
        self._pulled: list[str] = []
        self._unattributable: set[tuple[str, str | None]] = set()  # (instance, result) counted
        self._ingest_turn = asyncio.Lock()
        # Writes trajectory bytes to the blob log off the event loop, one batch at a time.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="dataflow-blobs")
        self.store.blobs.defer = self._off_loop
        # Set while no batch is being streamed to a trainer: ingest yields to trainers.
        self._trainers_idle = asyncio.Event()
        self._trainers_idle.set()
        self._streaming = 0
        self._stopping = False
        self._recover()
        # Complete epochs' work rows folded into counts (upkeep), past storage.keep_done_epochs.
        self.folder = EpochFolder(
            self.store,
            [s for s in self.sources if not self.evals.is_eval(s)],
            config.storage.keep_done_epochs,
            in_flight=self._epoch_in_flight,
            every_s=config.storage.fold_interval_s,
            on_folded=self._count_folded,
        )

    # ----- recovery and persistence -------------------------------------------------------

    def _recover(self) -> None:
        st = self.store
        self.counters.update(st.get("counters", {}))
        self.accepted.update(st.get("accepted", {}))
        # Kept since schema 2; counted from the versions trained when missing, below.
        uncounted = st.get("replay_slots") is None and st.get("accepted") is not None
        self.replay_slots.update(st.get("replay_slots", {}))
        # Per-policy state of policies this configuration lacks: kept as saved.
        self._unconfigured = {
            key: {p: v for p, v in (st.get(key) or {}).items() if p not in self.buffers}
            for key in ("buffer_counters", "drop_streaks")
        }
        # Before the groups are restored below (which counts them `restored`).
        for policy_id, saved in st.get("buffer_counters", {}).items():
            if policy_id in self.buffers:
                self.buffers[policy_id].restore_counters(saved)
        for policy_id, (n, last) in st.get("drop_streaks", {}).items():
            if (buf := self.buffers.get(policy_id)) is not None:  # a stall stays counted
                buf.dropped_in_a_row, buf.last_drop = n, last
        self.versions.restore(st.get("versions", {}))
        self.evals.restore(st.get("evals", {}))
        self.redo = Redo(st.get(REDO_KEY))
        for name, source in self.sources.items():
            saved = st.get(f"dataset/{name}")
            if saved is not None:
                source.restore(saved)
        # What belongs to a stream or policy this configuration lacks (a resume with another
        # config) stays on disk untouched, for when it is configured again.
        kept: Counter[str] = Counter()
        for row in st.unfinished_work():  # done groups stay in the table (`self.done`)
            if row.stream not in self.sources:
                kept[f"unfinished groups of stream {row.stream!r}"] += 1
                continue
            item = self.sources[row.stream].item_for(row.group_id)
            if row.group_id in self.redo.policies:  # generated again (astra.dataflow.quarantine)
                item = replace(item, regenerate=True)
            self.work[row.group_id] = Work(item, row.stream, attempts=row.attempts)
            self.waiting.append(row.group_id)
        leased: dict[str, list[GroupRecord]] = {}
        for group, batch_id in st.groups():
            if group.policy_id not in self.buffers:
                kept[f"groups of policy {group.policy_id!r}"] += 1
            elif batch_id is None:
                self.buffers[group.policy_id].restore(group)
            else:
                leased.setdefault(batch_id, []).append(group)
        for policy_id, remembered in st.replay_memory().items():
            if policy_id not in self.buffers:
                kept[f"groups in the replay memory of policy {policy_id!r}"] += len(remembered)
                continue
            for group in remembered:
                self.buffers[policy_id].restore_replay(group)
        gone = {p: b.pop_replay_gone() for p, b in self.buffers.items()}
        if any(gone.values()):  # this configuration keeps fewer (or none)
            with st.tx() as tx:
                for policy_id, group_ids in gone.items():
                    tx.forget_replays(policy_id, group_ids)
                self.persist_counters(tx)
        rows = [r for r in st.batches() if r.policy_id in self.buffers]
        for what, n in sorted(kept.items()):
            log.warning("%d %s kept on disk: not configured", n, what)
        self.batches.recover(rows, leased, st.replays())
        if uncounted:
            self._count_replay_slots(rows)
        quarantine(self, st.corrupt)  # records read back above that are not as written
        st.corrupt.clear()
        if self.work:
            log.info("recovered %d unfinished groups to dispatch again", len(self.work))

    def _count_replay_slots(self, rows) -> None:
        """A state directory from before `replay_slots` was kept (schema 1): the replayed
        copies of the batches taken were never counted. Each version trained filled
        batch_groups slots, and each batch taken since (leased, or acknowledged at the
        current version or later) its own: what `accepted` (fresh groups) and the groups
        buffered lack of that are replayed copies. (This also undoes the expiry at recovery
        of a schema-1 leased batch, which gave back copies that were never counted.)"""
        for policy_id in self.buffers:
            current = self.versions.current(policy_id)
            pending = sum(
                len(r.group_keys)
                for r in rows
                if r.policy_id == policy_id
                and r.state == "acked"
                and r.policy_version >= current
                and r.batch_id not in self.batches.untrained
            )
            slots = (
                current * self.config.policy(policy_id).batch_groups
                + len(self.buffers[policy_id])
                + self.batches.leased_groups(policy_id)
                + pending
            )
            self.replay_slots[policy_id] = max(0, slots - self.accepted[policy_id])
        log.info("replayed copies counted from the versions trained: %s", dict(self.replay_slots))
        with self.store.tx() as tx:
            self.persist_counters(tx)

    def _counter_state(self) -> tuple:
        return (
            dict(self.counters),
            {p: b.counters for p, b in self.buffers.items()},
            {p: [b.dropped_in_a_row, b.last_drop] for p, b in self.buffers.items()},
        )

    def persist_counters(self, tx) -> None:
        state = self._counter_state()
        tx.put("counters", state[0])
        tx.put("accepted", dict(self.accepted))
        tx.put("replay_slots", dict(self.replay_slots))
        tx.put("buffer_counters", self._unconfigured["buffer_counters"] | state[1])
        tx.put("drop_streaks", self._unconfigured["drop_streaks"] | state[2])
        self._saved_counters = state

    # ----- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._dispatch_loop(), name="dispatch"),
            asyncio.create_task(self._upkeep_loop(), name="upkeep"),
        ]

    async def stop(self) -> None:
        self._stopping = True
        tasks = [*self._tasks, *self._collectors.values(), *self._loads.values(), *self._background]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for inst in self.pool.instances.values():
            with contextlib.suppress(Exception):
                await inst.port.close()
        self._writer.shutdown(wait=True)
        self.store.close()

    def _storage_failed(self, exc: BaseException) -> None:
        """A transaction failed in storage (full disk, I/O error), or on a bug inside one
        that changes memory as it goes (`tx(any_failure=True)`: ingest): what this process
        holds in memory may now differ from what is durable, so it stops at once (fail-stop)
        and the next start recovers from the store, exactly as after kill -9. `fail_stop` is
        the process exit; tests replace it."""
        if is_storage_error(exc):
            log.critical("Dataflow state store failed (%s): stopping to recover from disk", exc)
            self.counters["storage_failures"] += 1
        else:
            log.critical(
                "Dataflow failed inside a transaction (%r): memory and store may differ; "
                "stopping to recover from disk",
                exc,
                exc_info=exc,
            )
            self.counters["transaction_failures"] += 1
        self.fail_stop(exc)

    @staticmethod
    def fail_stop(exc: BaseException) -> None:
        logging.shutdown()
        os._exit(EXIT_STORAGE_FAILED)

    def _off_loop(self, fn) -> None:
        """Runs `fn` on the writer thread; inline once that has shut down."""
        try:
            self._writer.submit(fn)
        except RuntimeError:
            fn()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @contextlib.asynccontextmanager
    async def trainer_first(self):
        """While a batch streams to a trainer, ingest waits: the trainer is the scarce resource."""
        turn = self.trainer_turn()
        turn.hold()
        try:
            yield
        finally:
            turn.release()

    def trainer_turn(self) -> TrainerTurn:
        """A hold on `trainer_first` that can be taken and given back more than once."""
        return TrainerTurn(self)

    async def after_trainers(self) -> None:
        """Waits while a batch is being served (at most TRAINER_FIRST_MAX_S, so a stream
        that never closes stalls nothing): new collects, ingest slices and dispatch rounds
        wait, and the trainer's fetch has the event loop (and more of the CPU) to itself."""
        if not self._trainers_idle.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._trainers_idle.wait(), TRAINER_FIRST_MAX_S)

    def batch_ready(self, policy_id: str, num_groups: int) -> bool:
        """Whether a fetch of `num_groups` would find them buffered (no wait for data)."""
        buf = self.buffers.get(policy_id)
        return buf is not None and len(buf) >= num_groups

    def wake(self) -> None:
        self._wake.set()

    def notify_data_ready(self) -> None:
        """Wakes the fetches waiting for data (from code that cannot await), and dispatch."""

        async def notify() -> None:
            async with self.data_ready:
                self.data_ready.notify_all()

        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop: nobody can be waiting
            return
        self._spawn(notify())
        self.wake()

    # ----- pool membership (called by the servicer) ----------------------------------------

    async def register(
        self,
        instance_id: str,
        address: str,
        capacity: int,
        policy_ids: list[str],
        workflows: list[str],
        labels: dict[str, str],
        loaded_versions: dict[str, int],
        incarnation: str = "",
        loaded_ids: dict[str, str] | None = None,
    ) -> bool:
        if not any(p in self.buffers for p in policy_ids):
            raise FailedPrecondition(
                f"instance serves none of this run's policies {sorted(self.buffers)}",
                reason="NO_COMMON_POLICY",
                metadata={"instance_id": instance_id},
            )
        already, stale, orphans, replaced = self.pool.register(
            instance_id, address, capacity, policy_ids, workflows, labels, loaded_versions,
            incarnation,
        )  # fmt: skip
        self._claim(self.pool.instances[instance_id], loaded_ids)
        for other in replaced:
            self.counters["instances_confirmed_dead"] += 1
            log.warning("instance %s replaced at %s by %s: dead", other, address, instance_id)
        if orphans:
            log.warning(
                "instance %s registered again from %s (a new process): re-dispatching %d",
                instance_id,
                address,
                len(orphans),
            )
            self._requeue(orphans, "instance_restarted")
        if stale is not None:
            await stale.close()
        self._ensure_collector(instance_id)
        self.counters["registrations"] += 1
        self.wake()
        return already

    def heartbeat(
        self,
        instance_id: str,
        free_slots: int,
        loaded: dict[str, int],
        pending: int,
        loaded_ids: dict[str, str] | None = None,
    ) -> None:
        inst = self.pool.heartbeat(instance_id, free_slots, loaded, pending)
        self._claim(inst, loaded_ids)
        inst.free_slots = max(0, free_slots)
        self._ensure_collector(instance_id)
        self.wake()

    def deregister(self, instance_id: str) -> int:
        orphans = self.pool.deregister(instance_id)
        self._requeue(orphans, "instance_left")
        return len(orphans)

    def _ensure_collector(self, instance_id: str) -> None:
        task = self._collectors.get(instance_id)
        if task is not None and task.done() and not task.cancelled() and task.exception():
            # A bug, not a RaaS failure (those are PortErrors, handled in the loop): never
            # silent. The loop starts again below; the results it held are delivered again.
            self.counters["collector_failures"] += 1
            log.error(
                "collector of %s failed; restarting it", instance_id, exc_info=task.exception()
            )
        if task is None or task.done():
            self._collectors[instance_id] = asyncio.create_task(
                self._collect_loop(instance_id), name=f"collect:{instance_id}"
            )

    # ----- dispatch --------------------------------------------------------------------------

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
        state = self.gate_state or self.evaluate_gate()
        eta = self.config.gate.max_offpolicyness
        if state.capacity <= 0 and eta is not None and self._in_flight() == 0:
            versions = {p.id: self.versions.current(p.id) for p in self.config.policies}
            return (
                f"off-policy bound reached (eta={eta}, versions {versions}): "
                "waiting for the trainer's next version"
            )
        return state.reason

    def data_exhausted(self) -> bool:
        """Every training stream's dataset is used up and none of its groups is unfinished."""
        training = {n for n in self.streams if not self.evals.is_eval(n)}
        return (
            bool(training)
            and all(self.sources[n].exhausted for n in training)
            and not any(w.stream in training for w in self.work.values())
        )

    def _in_flight(self) -> int:
        """Training groups leased to instances (evaluation groups never reach a buffer)."""
        return sum(n for name, n in self._running_by_stream.items() if not self.evals.is_eval(name))

    def _running(self, stream: StreamSettings) -> int:
        return self._running_by_stream[stream.name]

    def _running_for(self, policy_id: str) -> int:
        """Training groups in flight that will land in `policy_id`'s buffer, of any stream."""
        return sum(self._running_by_stream[name] for name in self._feeding[policy_id])

    def stream_capacity(self, stream: StreamSettings) -> int:
        g = self.config.gate
        if g.max_offpolicyness is None or self.evals.is_eval(stream.name):
            return max(0, g.max_concurrent_groups - self._running(stream))
        # A group trains every policy of its stream: each policy's bound holds, so the most
        # constrained decides (with eta = 0 a policy whose trainer runs ahead waits for the
        # others instead of training tokens of a version behind its own). The bound is the
        # policy's: `accepted` counts what every stream gave it, so `running` counts what
        # every stream has in flight for it (one stream's alone would give each stream the
        # policy's whole budget). Streams are dispatched one after another and a lease counts
        # at once, so a round never leases past the budget either.
        return min(
            offpolicy_capacity(
                g.max_offpolicyness,
                self.versions.current(p),
                self.config.policy(p).batch_groups,
                self._slots_used(p),
                self._running_for(p),
                g.max_concurrent_groups,
            )
            for p in stream.policy_ids
        )

    def _slots_used(self, policy_id: str) -> int:
        """The batch slots of the policy already spoken for, in the units of AReaL's bound
        (batch_groups slots per version): fresh groups accepted, the replayed copies of the
        batches taken, and those the batches still to come up to version current + eta will
        take. Each replayed copy fills a slot a fresh group would otherwise fill: counted as
        fresh, the surplus was generated by version v and trained by a later one (with eta =
        0, off-policy). Without replay: `accepted`."""
        return self._slots_by_version(policy_id)[-1]

    def _slots_by_version(self, policy_id: str) -> list[int]:
        """`_slots_used` counting the batches still to come only up to version current + k,
        for k = 0 .. eta (one entry without eta): a group of an instance that holds version
        u is trained by u + eta at the latest, so the replayed copies of later batches take
        none of the slots it may fill (`_version_room`)."""
        # (Never below 0: a state directory from before replay_slots may expire batches
        # whose replayed copies it never counted.)
        used = self.accepted[policy_id] + max(0, self.replay_slots[policy_id])
        eta = self.config.gate.max_offpolicyness
        buf = self.buffers[policy_id]
        size = self.config.policy(policy_id).batch_groups
        wanted = buf.replays_wanted(size)
        if eta is None or wanted == 0:
            return [used]
        version = self.versions.current(policy_id)
        # The batches of versions version .. version + eta not taken yet, each with the
        # replayed copies `take` would give it from what replay holds by then (expiry only
        # lowers that, and the next round counts again from what is left). A leased batch's
        # fresh groups enter replay when it is acknowledged: counted as held already (more
        # copies projected means less room, the safe side should its lease expire).
        held = min(
            buf.config.replay_capacity_groups,
            buf.replay_len + self.batches.leased_fresh(policy_id),
        )
        out = []
        for k in range(eta + 1):
            if k > 0 or not self.batches.taken_for(policy_id, version):
                n = min(wanted, held)
                used += n
                held = min(buf.config.replay_capacity_groups, held + size - n)
            out.append(used)
        return out

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

    def _held(self, policy_id: str) -> int:
        """Groups the policy's buffer holds or may get back: buffered, and fresh groups leased
        to a trainer (an expired lease puts them back, whatever the buffer's capacity)."""
        return len(self.buffers[policy_id]) + self.batches.leased_fresh(policy_id)

    def buffer_room(self, stream: StreamSettings) -> int:
        """Groups that may still be dispatched before the stream's buffers would pass the
        high watermark, counting what is in flight and what trainers hold leased: admission
        never overfills a buffer."""
        in_flight = self._in_flight()
        mark = self.config.gate.buffer_high_watermark
        return max(
            0,
            min(
                int(mark * self.config.policy(p).buffer.capacity_groups) - self._held(p) - in_flight
                for p in stream.policy_ids
            ),
        )

    def _version_room(self, stream: StreamSettings, floor: dict[str, int]):
        """With eta: how many groups an instance may still start for the stream, from the
        versions it holds (a function of the instance), or None where no bound applies.

        `stream_capacity` is AReaL's bound counted from the trainer's version v: a group
        started now is trained by version v + eta at the latest. The floor lets an instance
        still holding v - eta generate, and its tokens are then up to 2 * eta old when
        trained. Counted from the version u the instance holds instead, a group must be
        among the first (eta + u + 1) * batch_groups of its policy, so it is trained by
        version u + eta: staleness <= eta. The same bound when the instance is up to date.
        """
        eta = self.config.gate.max_offpolicyness
        if eta is None or not floor:
            return None
        # used[p][k]: with the replayed copies of the batches to come up to version
        # current + k only, the last its groups can be in (u + eta).
        used = {}
        for p in floor:
            running = self._running_for(p)
            used[p] = [n + running for n in self._slots_by_version(p)]
        size = {p: self.config.policy(p).batch_groups for p in floor}
        current = {p: self.versions.current(p) for p in floor}

        def room(inst: Instance) -> int:
            out = []
            for p in floor:
                u = min(inst.held(p), current[p])
                last = u + eta - current[p]
                if last < 0:  # below the floor: anything it generates would be too old
                    return 0
                out.append((eta + u + 1) * size[p] - used[p][min(last, len(used[p]) - 1)])
            return min(out)

        return room

    def version_floor(self, stream: StreamSettings) -> dict[str, int]:
        """Oldest version an instance may hold to get this stream's work: target - eta.

        With eta = 0 only instances that loaded the current target generate, which is
        what makes eta = 0 synchronous.
        """
        eta = self.config.gate.max_offpolicyness
        if eta is None:
            return {}
        targets = self.versions.targets()
        return {
            p: targets[p].version - eta
            for p in stream.policy_ids
            if p in targets and targets[p].weights_address
        }

    def evaluate_gate(self) -> GateState:
        training = [s for s in self.streams.values() if not self.evals.is_eval(s.name)]
        capacity = 0 if self.pool.empty else sum(self.stream_capacity(s) for s in training)
        in_flight = self._in_flight()
        # Groups in flight will land in the buffers, and leased ones may come back: count
        # them, or a full pool overfills.
        fill = max(
            (self._held(p) + in_flight) / self.config.policy(p).buffer.capacity_groups
            for p in self.buffers
        )
        if in_flight == 0 and self.gate.mode is GateMode.SYNC_BARRIER:
            # The barrier has drained: whatever is dispatched next starts at the current
            # version, so the observed gap is 0 until results say otherwise.
            self.staleness.update(0.0)
        state = self.gate.evaluate(self.staleness.value, capacity, fill, in_flight)
        self.gate_state = state
        return state

    def _storage_paused(self) -> bool:
        """StorageGuard.check, counting each pause and logging each change."""
        paused = self.storage.check()
        if self.storage.pauses != self._storage_pauses_seen:
            self.counters["storage_pauses"] += self.storage.pauses - self._storage_pauses_seen
            self._storage_pauses_seen = self.storage.pauses
            why = self.storage.reason
            log.error("%s: dispatch and ingest paused (the RaaS keep their results)", why)
        elif self._storage_was_paused and not paused:
            free = f"{self.storage.free_now:,}"
            log.warning("storage: %s bytes free again: dispatch and ingest resume", free)
            self._extend_leases(time.time() - self._storage_paused_at)
            self.wake()
        if paused and not self._storage_was_paused:
            self._storage_paused_at = time.time()
        self._storage_was_paused = paused
        return paused

    def _extend_leases(self, seconds: float) -> None:
        """Pushes every group lease back by `seconds` (the pause they waited through), in memory;
        a lease expiring after a restart instead is dispatched again, as any lease is."""
        for w in self.work.values():
            if w.lease_expire:
                w.lease_expire += seconds

    def _next_work(self, stream: StreamSettings) -> str | None:
        """A waiting group of the stream, pulling a new one from the dataset if needed."""
        for gid in self.waiting:
            if self.work[gid].stream == stream.name:
                return gid
        if self.evals.is_eval(stream.name):
            return None  # its groups are all queued when its evaluation is scheduled
        item = self.sources[stream.name].next()
        if item is None:
            return None
        self.work[item.group_id] = Work(item, stream.name)
        self.waiting.append(item.group_id)
        # Written with the round's leases (or by _save_pulled), before anything is sent.
        self._pulled.append(item.group_id)
        return item.group_id

    def _save_pulled(self, tx) -> None:
        """Persists groups pulled from datasets this round, with the dataset positions."""
        if not self._pulled:
            return
        for gid in self._pulled:
            w = self.work.get(gid)
            if w is not None and w.instance_id is None:
                tx.set_work(gid, w.stream, "pending")
        for name in {self.work[g].stream for g in self._pulled if g in self.work}:
            tx.put(f"dataset/{name}", self.sources[name].state())
        self._pulled.clear()

    async def _dispatch_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
            await self.after_trainers()
            self._wake.clear()
            try:
                await self._dispatch_round()
            except Exception:
                log.exception("dispatch round failed")

    def _schedule_evals(self) -> None:
        """Queues the evaluations that are due (astra.dataflow.evals), durably."""
        for name in self.evals.every:
            stream = self.streams[name]
            version = self.evals.due(name, self.versions.current(stream.policy_ids[0]))
            if version is None:
                continue
            items = [
                i for i in self.sources[name].epoch_items(version) if i.group_id not in self.done
            ]
            self.evals.schedule(name, version, len(items))
            with self.store.tx() as tx:
                for item in items:
                    if item.group_id in self.work:  # queued already (kept from before)
                        continue
                    self.work[item.group_id] = Work(item, name)
                    self.waiting.append(item.group_id)
                    tx.set_work(item.group_id, name, "pending")
                tx.put("evals", self.evals.state())
            self.counters["evaluations_started"] += 1
            log.info("evaluating %s at version %d: %d groups", name, version, len(items))

    async def _dispatch_round(self) -> None:
        if self.evals.every:
            self._schedule_evals()
        if self.pool.empty:
            self.evaluate_gate()
            return
        state = self.evaluate_gate()
        if self._storage_paused():  # status shows the gate THROTTLED with the reason
            return  # evaluations too: their results are written like any other
        # Evaluation streams first, with at most half the free slots: after the training
        # streams an evaluation got only the slots they left, next to none behind an open gate,
        # and crawled while the end of a run waited for it; with all of them, training
        # stalled at every evaluation.
        for stream in sorted(self.streams.values(), key=lambda s: not self.evals.is_eval(s.name)):
            if self.evals.is_eval(stream.name):
                # Not gated (it fills no buffer); only instances holding the version evaluated.
                version = self.evals.floor(stream.name)
                if version is None:
                    continue
                floor = {stream.policy_ids[0]: version}
                free = sum(
                    inst.free_slots // stream.group_size
                    for inst in self.pool.eligible(
                        stream.workflow,
                        stream.policy_ids,
                        stream.group_size,
                        floor,
                        stream.raas_labels,
                    )
                )
                budget = min(self.stream_capacity(stream), (free + 1) // 2)
            elif not state.can_admit:
                continue
            else:
                budget = min(self.stream_capacity(stream), self.buffer_room(stream))
                floor = self.version_floor(stream)
            room = None if self.evals.is_eval(stream.name) else self._version_room(stream, floor)
            leased = 0
            while budget > 0:
                plan: dict[str, list[str]] = {}
                # Pool.pick once per group, without scanning the pool each time: the
                # instance with the most free slots, the first in pool order among equals.
                candidates = self.pool.eligible(
                    stream.workflow, stream.policy_ids, stream.group_size, floor, stream.raas_labels
                )
                heap = [(-inst.free_slots, k, inst) for k, inst in enumerate(candidates)]
                heapq.heapify(heap)
                while budget > 0 and heap:
                    _, k, inst = heapq.heappop(heap)
                    if room is not None and room(inst) <= leased:
                        continue  # its weights are too old for what is left of the bound
                    gid = self._next_work(stream)
                    if gid is None:
                        break
                    self._lease(gid, inst)
                    plan.setdefault(inst.instance_id, []).append(gid)
                    budget -= 1
                    leased += 1
                    if len(plan[inst.instance_id]) >= SUBMIT_BATCH:
                        break
                    if inst.free_slots >= stream.group_size:
                        heapq.heappush(heap, (-inst.free_slots, k, inst))
                if not plan:
                    break
                self._persist_leases([g for gids in plan.values() for g in gids])
                await asyncio.gather(*(self._submit(i, g, stream) for i, g in plan.items()))
        if self._pulled:
            with self.store.tx() as tx:
                self._save_pulled(tx)

    def _lease(self, gid: str, inst: Instance) -> None:
        w = self.work[gid]
        self.waiting.remove(gid)
        w.instance_id = inst.instance_id
        self._running_by_stream[w.stream] += 1
        w.lease_expire = time.time() + self.config.leases.group_lease_s
        w.attempts += 1
        inst.in_flight.add(gid)
        inst.free_slots -= w.item.num_samples
        self.counters["dispatched"] += 1
        if w.attempts > 1:
            self.counters["redispatched"] += 1

    def _persist_leases(self, gids: list[str]) -> None:
        with self.store.tx() as tx:
            self._save_pulled(tx)
            for gid in gids:
                w = self.work[gid]
                tx.set_work(
                    gid,
                    w.stream,
                    "leased",
                    instance_id=w.instance_id,
                    lease_expire=w.lease_expire,
                    attempts=w.attempts,
                )
            self.persist_counters(tx)

    async def _submit(self, instance_id: str, gids: list[str], stream: StreamSettings) -> None:
        inst = self.pool.instances[instance_id]
        try:
            accepted, free = await inst.port.submit([(self.work[g].item, stream) for g in gids])
        except PortError as exc:
            if exc.fatal:
                # The instance answered and refused the groups (INVALID_ARGUMENT,
                # FAILED_PRECONDITION): not a failure of the instance, and not one a resend
                # mends. Each refusal counts as a dispatch attempt, so the groups end as
                # counted failures after leases.max_dispatch_attempts instead of circling.
                log.error("submit to %s refused: %s", instance_id, exc)
                self.counters["submits_refused_invalid"] += 1
                inst.refused_in_a_row += 1
                inst.last_refusal = str(exc)[:512]
                self._requeue(set(gids) & inst.in_flight, "submit_invalid")
                return
            if exc.busy:
                inst.free_slots = 0
            else:
                log.warning("submit to %s failed: %s", instance_id, exc)
                self.pool.call_failed(instance_id)
            self._requeue(set(gids) & inst.in_flight, "submit_failed", count_attempt=False)
            return
        self.pool.call_succeeded(instance_id)
        inst.refused_in_a_row = 0
        inst.free_slots = free
        self.counters["groups_accepted"] += len(set(accepted) & set(gids))
        missing = set(gids) - set(accepted)
        if missing:
            self._requeue(missing & inst.in_flight, "submit_refused", count_attempt=False)

    def _requeue(self, gids: set[str], why: str, *, count_attempt: bool = True) -> None:
        """Returns leased groups to the waiting queue (durably).

        A group dispatched `leases.max_dispatch_attempts` times without a result is
        given up: it ends as a counted failure instead of circling forever.
        """
        moved, given_up = [], []
        limit = self.config.leases.max_dispatch_attempts
        for gid in gids:
            w = self.work.get(gid)
            if w is None or w.instance_id is None:
                continue
            inst = self.pool.instances.get(w.instance_id)
            if inst is not None:
                inst.in_flight.discard(gid)
            w.instance_id, w.lease_expire = None, None
            self._running_by_stream[w.stream] -= 1
            if not count_attempt:
                w.attempts -= 1
            if count_attempt and w.attempts >= limit:
                given_up.append(gid)
                continue
            self.waiting.appendleft(gid)
            moved.append(gid)
        if not moved and not given_up:
            return
        self.counters[f"requeued_{why}"] += len(moved)
        self.counters["failed_groups"] += len(given_up)
        self.counters["gave_up_after_max_attempts"] += len(given_up)
        with self.store.tx() as tx:
            for gid in moved:
                w = self.work[gid]
                tx.set_work(gid, w.stream, "pending", attempts=w.attempts)
            for gid in given_up:
                w = self.work.pop(gid)
                self.done.add(gid)
                tx.set_work(
                    gid,
                    w.stream,
                    "done",
                    attempts=w.attempts,
                    outcome=f"failed: no result after {w.attempts} dispatches ({why})",
                )
            self.persist_counters(tx)
        self.wake()

    # ----- upkeep: leases, liveness, weights ------------------------------------------------

    async def _upkeep_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.config.pool.probe_interval_s))
            try:
                await self.upkeep()
            except Exception:
                log.exception("upkeep failed")

    async def upkeep(self) -> None:
        now = time.time()
        paused = self._storage_paused()
        # While ingest pauses for disk space, finished groups wait on their RaaS: their leases
        # must not run out meanwhile (a group on its last attempt would end failed and its
        # held result be dropped); on resume they are pushed back by the pause.
        expired = set() if paused else {
            g for g, w in self.work.items() if w.lease_expire and w.lease_expire < now
        }  # fmt: skip
        if expired:
            self.counters["leases_expired"] += len(expired)
            owners: dict[str, list[str]] = {}
            for gid in expired:
                owners.setdefault(self.work[gid].instance_id or "", []).append(gid)
            self._requeue(expired, "lease_expired")
            for iid, gids in owners.items():
                inst = self.pool.instances.get(iid)
                if inst is not None:
                    self._spawn(self._cancel(inst, gids))
        self.batches.expire(now)
        for iid in self.pool.check_silence():
            log.warning("instance %s stopped heartbeating: suspect", iid)
        suspects = self.pool.by_state(InstanceState.SUSPECT)
        probes = await asyncio.gather(*(self._probe(i) for i in suspects))
        for inst, ok in zip(suspects, probes, strict=True):
            orphans = self.pool.probe_result(inst.instance_id, ok)
            if inst.state is InstanceState.DEAD:
                self.counters["instances_confirmed_dead"] += 1
                log.warning(
                    "instance %s confirmed dead; re-dispatching %d", inst.instance_id, len(orphans)
                )
                self._requeue(orphans, "instance_dead")
        for port in self.pool.forget_ended():
            with contextlib.suppress(Exception):
                await port.close()
        self._sync_weights()
        if not paused:
            self.folder.maybe_fold()
        if self._counter_state() != self._saved_counters:
            with self.store.tx() as tx:
                self.persist_counters(tx)

    def _count_folded(self, tx, rows: int) -> None:
        self.counters["groups_folded"] += rows  # with the rows it counts, in their transaction
        self.persist_counters(tx)

    def _epoch_in_flight(self, stream: str, epoch: int) -> bool:
        """Whether a group of the stream's epoch is waiting or leased (in memory)."""
        return any(w.stream == stream and w.item.epoch == epoch for w in self.work.values())

    async def _probe(self, inst: Instance) -> bool:
        try:
            return await inst.port.check_health()
        except PortError:
            return False

    # ----- status --------------------------------------------------------------------------

    def status(self) -> dict:
        """The run's state, shaped like astra.dataflow.v1.GetStatusResponse (snake_case)."""
        return dataflow_status(self)
