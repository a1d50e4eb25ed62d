"""Dataflow's upkeep, about twice a second: leases, liveness, weight loads, folding, counts.

Each pass puts back the groups whose dispatch lease ran out (and tells their instance to drop
them), expires the batch leases trainers let lapse, probes the instances gone silent and
re-dispatches what a dead one held, starts the weight loads due (astra.dataflow.weight_sync),
folds finished epochs (astra.dataflow.folding) and writes the counters that changed. Group
leases are kept while storage pauses ingest, so nothing ends failed for want of disk space.
Never imports gRPC; it reaches instances through their `RolloutPort`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from astra.dataflow.batches import BatchDesk
from astra.dataflow.folding import EpochFolder
from astra.dataflow.ingesting import cancel
from astra.dataflow.ledger import Ledger
from astra.dataflow.pool import Instance, InstanceState, Pool
from astra.dataflow.ports import PortError
from astra.dataflow.storage_guard import PauseWatch
from astra.dataflow.store import StateStore
from astra.dataflow.weight_sync import WeightSync
from astra.dataflow.work import WorkTable

log = logging.getLogger("astra.dataflow.coordinator")


class Upkeep:
    def __init__(
        self,
        store: StateStore,
        pool: Pool,
        table: WorkTable,
        batches: BatchDesk,
        ledger: Ledger,
        weights: WeightSync,
        folder: EpochFolder,
        storage_paused: PauseWatch,
        spawn: Callable,
        every_s: float,
    ) -> None:
        self.store, self.pool, self.table, self.batches = store, pool, table, batches
        self.ledger, self.counters, self.weights = ledger, ledger.counters, weights
        self.folder, self.storage_paused, self.spawn = folder, storage_paused, spawn
        self.every_s = every_s

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.run()
            except Exception:
                log.exception("upkeep failed")

    async def run(self) -> None:
        now = time.time()
        paused = self.storage_paused()
        # While ingest pauses for disk space, finished groups wait on their RaaS: their leases
        # must not run out meanwhile (a group on its last attempt would end failed and its
        # held result be dropped); on resume they are pushed back by the pause.
        expired = set() if paused else self.table.expired(now)
        if expired:
            self.counters["leases_expired"] += len(expired)
            owners: dict[str, list[str]] = {}
            for gid in expired:
                owners.setdefault(self.table.work[gid].instance_id or "", []).append(gid)
            self.table.requeue(expired, "lease_expired")
            for iid, gids in owners.items():
                inst = self.pool.instances.get(iid)
                if inst is not None:
                    self.spawn(cancel(inst, gids))
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
                self.table.requeue(orphans, "instance_dead")
        for port in self.pool.forget_ended():
            with contextlib.suppress(Exception):
                await port.close()
        self.weights.sync()
        if not paused:
            self.folder.maybe_fold()
        if self.ledger.dirty:
            with self.store.tx() as tx:
                self.ledger.persist(tx)

    @staticmethod
    async def _probe(inst: Instance) -> bool:
        try:
            return await inst.port.check_health()
        except PortError:
            return False
