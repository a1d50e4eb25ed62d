"""Dataflow, the coordinator: wires the parts that dispatch, ingest and serve, and runs them.

It owns the run's state (the store, buffers, versions, the work table, the ledger of counts)
and hands each part only what that part needs:
- `Dispatcher` (astra.dataflow.dispatch): admission gate -> pool routing -> submit;
- `Ingestor` (astra.dataflow.ingesting): one long-poll per instance, ingest, acknowledgement;
- `BatchDesk` (astra.dataflow.batches): batches cut, leased, acknowledged, expired;
- `WeightSync` (astra.dataflow.weight_sync): announced versions and weight loads;
- `Upkeep` (astra.dataflow.upkeep): leases, liveness probes, folding, counters;
- `Admission` and `OffPolicyBudget` (astra.dataflow.admission, .offpolicy): what may start.
Pool membership (register, heartbeat, deregister) is here, called by the servicer. It
reaches rollout services only through `RolloutPort`, so it never imports gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from astra.dataflow.admission import POOL_EMPTY, Admission
from astra.dataflow.batches import BatchDesk
from astra.dataflow.buffer import PolicyBuffer
from astra.dataflow.config import DataflowConfig, StreamSettings
from astra.dataflow.dataset import PromptSource
from astra.dataflow.dispatch import Dispatcher
from astra.dataflow.done import DoneGroups
from astra.dataflow.evals import EvalDesk
from astra.dataflow.folding import EpochFolder
from astra.dataflow.ingesting import Ingestor
from astra.dataflow.ledger import Ledger
from astra.dataflow.offpolicy import OffPolicyBudget
from astra.dataflow.pool import Pool
from astra.dataflow.ports import Connector, IncomingGroup
from astra.dataflow.quarantine import KEY as REDO_KEY
from astra.dataflow.quarantine import Redo
from astra.dataflow.recovery import recover
from astra.dataflow.status import dataflow_status
from astra.dataflow.storage_guard import PauseWatch, StorageGuard
from astra.dataflow.store import StateStore, is_storage_error
from astra.dataflow.turns import TrainerTurn, TrainerTurns
from astra.dataflow.upkeep import Upkeep
from astra.dataflow.versions import VersionBook
from astra.dataflow.weight_sync import WeightSync
from astra.dataflow.work import WorkTable
from astra.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

EXIT_STORAGE_FAILED = 75  # EX_TEMPFAIL: a supervisor restarts the process, which recovers
STOP_TASKS_S = 5.0  # how long a stop waits for its cancelled loops to end
__all__ = ["EXIT_STORAGE_FAILED", "POOL_EMPTY", "Dataflow"]


class Dataflow:
    def __init__(self, config: DataflowConfig, connect: Connector) -> None:
        self.config = config
        self.dataflow_id = uuid.uuid4().hex[:12]
        self.store = StateStore(config.state_dir, segment_bytes=config.storage.blob_segment_bytes)
        self.store.on_failure = self._storage_failed
        st = config.storage
        self.storage = StorageGuard(
            Path(config.state_dir), st.min_free_bytes, st.resume_at, st.check_interval_s
        )
        self.pool = Pool(config.pool, connect)
        self.streams: dict[str, StreamSettings] = {s.name: s for s in config.streams}
        self.evals = EvalDesk(
            {s.name: s.eval_every_versions for s in config.streams},
            {s.name: list(s.policy_ids) for s in config.streams},
        )
        is_eval = self.evals.is_eval
        self.sources = {s.name: self._source(s) for s in config.streams}
        try:
            self.buffers = {p.id: PolicyBuffer(p.buffer) for p in config.policies}
        except ValueError as exc:
            raise InvalidArgument(f"buffer config: {exc}", reason="INVALID_CONFIG") from exc
        self.versions = VersionBook([p.id for p in config.policies], config.versions.barrier)
        self.ledger = Ledger(self.buffers)
        self.counters = self.ledger.counters
        self.turns = TrainerTurns()
        self.data_ready = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        # Groups with an outcome: the newest in memory, the rest in the work table.
        self.done = DoneGroups(self.store.is_done, self.store.done_count())
        feeding = {
            p.id: [s.name for s in config.streams if p.id in s.policy_ids and not is_eval(s.name)]
            for p in config.policies
        }
        self.table = WorkTable(
            self.store, self.pool, self.ledger, self.done, self.sources, config.leases,
            feeding, is_eval, self.wake,
        )  # fmt: skip
        self.batches = BatchDesk(
            self.store, self.ledger, self.versions, config.leases, self.data_ready,
            self.notify_data_ready, lambda: self.admission.why(),
        )  # fmt: skip
        self.budget = OffPolicyBudget(
            config, self.versions, self.buffers, self.batches, self.ledger, self.table, is_eval
        )
        self.admission = Admission(
            config, self.pool, self.buffers, self.batches, self.versions, self.sources,
            self.table, self.budget, self.storage, is_eval, self.counters,
        )  # fmt: skip
        self.storage_paused = PauseWatch(self.storage, self.counters, self._resumed, log)
        # Writes trajectory bytes to the blob log off the event loop, one batch at a time.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="dataflow-blobs")
        self.store.blobs.defer = self._off_loop
        self.redo = Redo(self.store.get(REDO_KEY))
        self.weights = WeightSync(
            config, self.store, self.pool, self.versions, self.ledger, self.batches, self.wake
        )
        self.ingestor = Ingestor(
            config, self.store, self.pool, self.table, self.ledger, self.versions, self.evals,
            self.redo, self.admission.staleness, self.storage, self.storage_paused, self.turns,
            self._writer, self.data_ready, self.wake, self._spawn,
        )  # fmt: skip
        self.dispatcher = Dispatcher(
            config, self.streams, self.store, self.pool, self.table, self.ledger, self.versions, self.sources,
            self.evals, self.admission, self.budget, self.storage_paused, self.turns,
        )  # fmt: skip
        recover(
            config, self.store, self.ledger, self.versions, self.evals, self.redo, self.table,
            self.batches,
        )  # fmt: skip
        # Complete epochs' work rows folded into counts (upkeep), past storage.keep_done_epochs.
        self.folder = EpochFolder(
            self.store,
            [s for s in self.sources if not is_eval(s)],
            config.storage.keep_done_epochs,
            in_flight=self.table.epoch_in_flight,
            every_s=config.storage.fold_interval_s,
            on_folded=self._count_folded,
        )
        self.upkeeper = Upkeep(
            self.store, self.pool, self.table, self.batches, self.ledger, self.weights,
            self.folder, self.storage_paused, self._spawn,
            every_s=min(0.5, config.pool.probe_interval_s),
        )  # fmt: skip

    def _source(self, s: StreamSettings) -> PromptSource:
        # An evaluation stream's "epoch" is the version it evaluates (astra.dataflow.evals).
        d = (
            s.dataset.model_copy(update={"num_epochs": 0})
            if self.evals.is_eval(s.name)
            else s.dataset
        )
        return PromptSource(
            d,
            tuple(s.policy_ids),
            s.workflow,
            s.group_size,
            s.name,
        )

    # ----- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self.dispatcher.loop(), name="dispatch"),
            asyncio.create_task(self.upkeeper.loop(), name="upkeep"),
        ]

    async def stop(self) -> None:
        self.ingestor.stopping = True
        self.weights.stopping = True
        tasks = [
            *self._tasks,
            *self.ingestor.collectors.values(),
            *self.weights.loads.values(),
            *self._background,
        ]
        for t in tasks:
            t.cancel()
        # Bounded: a task that outlives its cancellation (astra.waits says how one did) is
        # named and left behind, so the process still stops; what is durable is on disk.
        if tasks:
            _, running = await asyncio.wait(tasks, timeout=STOP_TASKS_S)
            for t in running:
                log.error(
                    "stopping: task %s still running %.0fs after its cancel",
                    t.get_name(),
                    STOP_TASKS_S,
                )
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved: its failure was logged where it happened
        await asyncio.gather(
            *(inst.port.close() for inst in self.pool.instances.values()), return_exceptions=True
        )
        self._writer.shutdown(wait=True)
        self._persist_counts()
        self.store.close()

    def _persist_counts(self) -> None:
        """A graceful stop keeps the counts added since the last transaction (a submit's
        `groups_accepted` is written by the next transaction, or by upkeep's; kill -9 loses
        at most an upkeep interval of such counts, a stop none)."""
        if self.ledger.dirty:
            with self.store.tx() as tx:
                self.ledger.persist(tx)

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

    def _resumed(self, paused_s: float) -> None:
        """Storage has room again: the group leases are pushed back by the pause."""
        self.table.extend_leases(paused_s)
        self.wake()

    def _count_folded(self, tx, rows: int) -> None:
        self.counters["groups_folded"] += rows  # with the rows it counts, in their transaction
        self.ledger.persist(tx)

    # ----- what the servicer calls ---------------------------------------------------------

    def trainer_first(self):
        """While a batch streams to a trainer, ingest waits: the trainer is the scarce resource."""
        return self.turns.first()

    def trainer_turn(self) -> TrainerTurn:
        """A hold on `trainer_first` that can be taken and given back more than once."""
        return self.turns.turn()

    def batch_ready(self, policy_id: str, num_groups: int) -> bool:
        """Whether a fetch of `num_groups` would find them buffered (no wait for data)."""
        buf = self.buffers.get(policy_id)
        return buf is not None and len(buf) >= num_groups

    def wake(self) -> None:
        self.dispatcher.wake()

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

    async def ingest(self, instance_id: str, results: list[IncomingGroup]) -> list[str]:
        return await self.ingestor.ingest(instance_id, results)

    def announce(self, policy_id: str, version: int, version_id: str, address: str, **kw) -> bool:
        return self.weights.announce(policy_id, version, version_id, address, **kw)

    async def upkeep(self) -> None:
        await self.upkeeper.run()

    def why(self) -> str:
        return self.admission.why()

    @property
    def work(self) -> dict:
        """The groups not done (astra.dataflow.work)."""
        return self.table.work

    @property
    def waiting(self):
        return self.table.waiting

    @property
    def accepted(self):
        return self.ledger.accepted

    @property
    def replay_slots(self):
        return self.ledger.replay_slots

    def status(self) -> dict:
        """The run's state, shaped like astra.dataflow.v1.GetStatusResponse (snake_case)."""
        return dataflow_status(self)

    # ----- pool membership -----------------------------------------------------------------

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
        self.weights.claim(self.pool.instances[instance_id], loaded_ids)
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
            self.table.requeue(orphans, "instance_restarted")
        if stale is not None:
            await stale.close()
        self.ingestor.ensure_collector(instance_id)
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
        self.weights.claim(inst, loaded_ids)
        inst.free_slots = max(0, free_slots)
        self.ingestor.ensure_collector(instance_id)
        self.wake()

    def deregister(self, instance_id: str) -> int:
        orphans = self.pool.deregister(instance_id)
        self.table.requeue(orphans, "instance_left")
        return len(orphans)
