"""Dataflow's version side: announced versions, and which rollout service loads which, when.

A part of Dataflow (astra.dataflow.coordinator wires it): trainers announce
versions (with the WeightService that holds them); every active instance
that lacks its policies' targets gets one LoadWeights call for the whole set
(the version barrier), retried after a backoff when it fails; a trainer that
resumes at the current version has the off-policy count recomputed. Never
imports gRPC.

An instance holds a version by counter AND identity: one whose claimed identity
(RegisterInstanceRequest.loaded_versions[].version_id) is not the one announced for
that counter holds none of the policy's versions (`Instance.unverified`): it is sent
the target even at the same counter, and gets no work under a version floor until it
has loaded it. A claim of version 0 with no identity is the weights the instance was
started with, never the trainer's version 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

from astra.dataflow.batches import BatchDesk
from astra.dataflow.config import DataflowConfig
from astra.dataflow.ledger import Ledger
from astra.dataflow.pool import LOAD_FAILURES_REPORTED, Instance, InstanceState, Pool
from astra.dataflow.store import StateStore
from astra.dataflow.versions import VersionBook

log = logging.getLogger("astra.dataflow.coordinator")


class WeightSync:
    def __init__(
        self,
        config: DataflowConfig,
        store: StateStore,
        pool: Pool,
        versions: VersionBook,
        ledger: Ledger,
        batches: BatchDesk,
        wake: Callable[[], None],
    ) -> None:
        self.config, self.store, self.pool, self.versions = config, store, pool, versions
        self.ledger, self.counters, self.buffers = ledger, ledger.counters, ledger.buffers
        self.batches, self.wake = batches, wake
        self.loads: dict[str, asyncio.Task] = {}  # instance id -> its weight load running
        self.stopping = False  # set when Dataflow stops: no load starts after that

    def claim(self, inst: Instance, loaded_ids: dict[str, str] | None) -> None:
        """Takes the identities an instance claims (None: it stated none: counters only)."""
        if loaded_ids is not None:
            inst.loaded_ids = dict(loaded_ids)
        self._verify(inst)

    def _verify(self, inst: Instance) -> None:
        """Marks the policies whose claimed identity is not the announced one of its version."""
        inst.unverified = set()
        for p, ident in inst.loaded_ids.items():
            book = self.versions.policies.get(p)
            v = inst.loaded_versions.get(p, -1)
            announced = book.history.get(v) if book is not None else None
            if v >= 0 and announced is not None and announced.version_id != ident:
                inst.unverified.add(p)

    def sync(self) -> None:
        targets = self.versions.targets()
        for inst in self.pool.by_state(InstanceState.ACTIVE):
            self._verify(inst)  # announcements since its claim may name its version
            want = {
                p: a
                for p, a in targets.items()
                if p in inst.policy_ids and a.weights_address and inst.held(p) < a.version
            }
            running = self.loads.get(inst.instance_id)
            if not want or (running is not None and not running.done()):
                continue
            if not self.pool.load_due(inst):  # a failed load is retried after a backoff
                continue
            task = asyncio.create_task(self._load(inst, want))
            # A version announced while this load ran is loaded as soon as it ends, not at
            # the next upkeep (up to 0.5 s later, each version paying it again).
            task.add_done_callback(self._after_load)
            self.loads[inst.instance_id] = task

    def _after_load(self, task: asyncio.Task) -> None:
        if not task.cancelled() and not self.stopping:
            self.sync()

    async def _load(self, inst: Instance, want: dict) -> None:
        # One call for the whole set, so the RaaS can switch every policy together
        # (the version barrier), even when policies live on different WeightServices.
        versions = {p: (a.version, a.version_id, a.weights_address) for p, a in want.items()}
        # Fixed length whatever the ids (the contract allows 1-128 characters): the same set
        # for the same instance gives the same id, so a retried load is answered, not rerun.
        key = "\n".join(
            [inst.instance_id, *(f"{p}={v[0]}:{v[1]}" for p, v in sorted(versions.items()))]
        )
        request_id = "load-" + hashlib.sha256(key.encode()).hexdigest()[:48]
        try:
            held = await inst.port.load_weights(versions, request_id)
            inst.loaded_versions.update(held)
            for p, a in want.items():
                if p in inst.loaded_ids and held.get(p) == a.version:  # counter and identity
                    inst.loaded_ids[p] = a.version_id
            self._verify(inst)
            self.counters["weight_loads"] += 1
            # The instance may now pass the version floor (with eta = 0, the only way work
            # for a new version starts): dispatch now, not at the next heartbeat or poll.
            self.wake()
            self.pool.load_succeeded(inst.instance_id)
        except Exception as exc:  # PortError, or a bug: either way retried, and counted
            self.counters["weight_load_failures"] += 1
            n = self.pool.load_failed(inst.instance_id, str(exc))
            level = logging.ERROR if n >= LOAD_FAILURES_REPORTED else logging.WARNING
            log.log(
                level, "load %s on %s failed (%d in a row): %s", versions, inst.instance_id, n, exc
            )

    def announce(
        self,
        policy_id: str,
        version: int,
        version_id: str,
        address: str,
        *,
        resumed: bool = False,
        resumed_from: int | None = None,
    ) -> bool:
        """`resumed_from` (with `resumed`): the version of the weights the trainer continues
        from; the batches it acknowledged at that version or later are counted discarded."""
        book = self.versions.policies.get(policy_id)
        before = book.address if book is not None else ""
        repeat = self.versions.announce(policy_id, version, version_id, address)
        # Every load of the policy now goes to the newest address (a restarted WeightService).
        moved = self.versions.address(policy_id) != before
        if not repeat or moved:
            if not repeat:
                self.counters["versions_announced"] += 1
            with self.store.tx() as tx:
                tx.put("versions", self.versions.state())
                self.ledger.persist(tx)
            if moved:
                self.pool.retry_loads_now()
            self.sync()
            self.wake()
        if resumed and resumed_from is not None and policy_id in self.buffers:
            self._discard_untrained(policy_id, resumed_from)
        if resumed and repeat:
            self._recount_accepted(policy_id)
        return repeat

    def _discard_untrained(self, policy_id: str, resumed_from: int) -> None:
        """The trainer of `policy_id` continues from the weights of `resumed_from`: the steps
        it took on batches acknowledged at that version or later are lost with the process
        that took them. Their fresh groups are counted discarded (once per batch, durably:
        acked_versions), however old the checkpoint, so every acknowledged group is trained
        or counted with a reason."""
        with self.store.tx(any_failure=True) as tx:
            batches, groups = self.batches.discard_since(tx, policy_id, resumed_from)
            if batches or groups:
                self.counters["groups_discarded.trainer_restart"] += groups
                self.counters["batches_discarded.trainer_restart"] += batches
                self.counters[f"discarded_groups.{policy_id}"] += groups
                self.ledger.persist(tx)
        if batches or groups:
            log.warning(
                "trainer of %s resumed from version %d: %d acknowledged batches (%d fresh "
                "groups) trained since are not in its weights; counted discarded",
                policy_id,
                resumed_from,
                batches,
                groups,
            )

    def _recount_accepted(self, policy_id: str) -> None:
        """A trainer (re)started at the current version: the off-policy count starts again
        from it, plus what is buffered and leased (AnnounceVersionRequest.resumed).

        Counted in slots on both sides: `accepted` (fresh groups) with `replay_slots`
        (replayed copies in batches taken) against the versions trained, the groups buffered
        and the leased batches' groups, replayed copies included. A batch acknowledged at
        this version or later was never trained: its slots are free again, and it no longer
        counts as the version's batch taken (whose replayed copies are projected again)."""
        b = self.config.policy(policy_id).batch_groups
        current = self.versions.current(policy_id)
        leased = self.batches.leased_groups(policy_id)
        leased_fresh = self.batches.leased_fresh(policy_id)
        buffered = len(self.buffers[policy_id])
        slots = current * b + buffered + leased
        used = self.ledger.accepted[policy_id] + max(0, self.ledger.replay_slots[policy_id])
        untrained = self.batches.untrained_since(policy_id, current)
        if slots >= used and not untrained:
            return
        if slots < used:
            log.warning(
                "trainer of %s resumed at version %d: %d acknowledged groups were not trained",
                policy_id,
                current,
                used - slots,
            )
            self.counters["groups_untrained_at_resume"] += used - slots
            self.ledger.accepted[policy_id] = current * b + buffered + leased_fresh
            # The versions' slots are all in `accepted` now: only the leased batches'
            # replayed copies still fill slots of their own.
            self.ledger.replay_slots[policy_id] = leased - leased_fresh
        with self.store.tx() as tx:
            self.batches.mark_untrained(tx, policy_id, untrained)
            self.ledger.persist(tx)
        self.wake()
