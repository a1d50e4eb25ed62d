"""The pool of rollout services: membership, liveness, capacity routing.

A failed call marks an instance SUSPECT (no new work, leases kept); only
health probes confirm death, after `confirm_failures` failures in a row; a
suspect that answers again is restored. Heartbeat silence also makes a
suspect. Instances join and leave at any time. Never touches the buffer or
the durable store: it returns the group ids that must be dispatched again.

Weight loads are tracked per instance: a failed (or timed-out) load is
retried after a backoff that doubles up to `LOAD_RETRY_MAX_S`, and once
`LOAD_FAILURES_REPORTED` loads in a row have failed the instance is reported
(`failing_loads`) until one succeeds, so a RaaS that never reaches the target
version is visible, never silently starved of work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from astra.dataflow.config import PoolSettings
from astra.dataflow.ports import Connector, RolloutPort
from astra.errors import NotFound

LOAD_RETRY_BASE_S = 0.5
LOAD_RETRY_MAX_S = 30.0
LOAD_FAILURES_REPORTED = 3


class InstanceState(Enum):
    ACTIVE = "ACTIVE"
    SUSPECT = "SUSPECT"
    DEAD = "DEAD"
    LEFT = "LEFT"


@dataclass(slots=True)
class Instance:
    instance_id: str
    address: str
    capacity: int
    policy_ids: frozenset[str]
    workflows: frozenset[str]
    labels: dict[str, str]
    port: RolloutPort
    loaded_versions: dict[str, int] = field(default_factory=dict)
    # The identities it claims with them (PolicyVersion.version_id; "" with version 0: the
    # weights it was started with), where it stated any, and the policies whose claimed
    # identity is not the one announced for that version: they count as held by no version.
    loaded_ids: dict[str, str] = field(default_factory=dict)
    unverified: set[str] = field(default_factory=set)
    state: InstanceState = InstanceState.ACTIVE
    free_slots: int = 0
    pending_results: int = 0
    in_flight: set[str] = field(default_factory=set)
    failures: int = 0
    last_seen: float = 0.0
    ended_at: float = 0.0
    loading: bool = False
    # "silence" (heartbeats stopped) or "call" (a call to it failed). A heartbeat
    # clears only the first: the RaaS may heartbeat while Dataflow cannot reach it.
    suspect_reason: str = ""
    # Weight loads that failed in a row, the last error, and when the next may start.
    load_failures: int = 0
    load_error: str = ""
    load_retry_at: float = 0.0
    incarnation: str = ""  # the process behind the id (RegisterInstanceRequest.incarnation)
    # Submits it refused as invalid in a row (0 after one it accepts), and the newest reason.
    refused_in_a_row: int = 0
    last_refusal: str = ""

    def held(self, policy_id: str) -> int:
        """The version of the policy it holds, as far as Dataflow can tell: -1 when none, or
        when the identity it claims is not the announced one of that version."""
        if policy_id in self.unverified:
            return -1
        return self.loaded_versions.get(policy_id, -1)

    def serves(
        self, workflow: str, policy_ids: Iterable[str], labels: dict[str, str] | None = None
    ) -> bool:
        return (
            workflow in self.workflows
            and set(policy_ids) <= self.policy_ids
            and (not labels or labels.items() <= self.labels.items())
        )


class Pool:
    def __init__(
        self,
        settings: PoolSettings,
        connect: Connector,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._connect = connect
        self._clock = clock
        self.instances: dict[str, Instance] = {}

    def register(
        self,
        instance_id: str,
        address: str,
        capacity: int,
        policy_ids: Iterable[str],
        workflows: Iterable[str],
        labels: dict[str, str],
        loaded_versions: dict[str, int],
        incarnation: str = "",
    ) -> tuple[bool, RolloutPort | None, set[str], list[str]]:
        """Adds or refreshes an instance; returns (already registered, port to close, groups
        orphaned, instances replaced). An instance that registers again from another address,
        or with another incarnation, is a new process under the same id (restarted before it
        was confirmed dead); another instance registered at this address is a process that
        is gone (one address, one server). What those predecessors had in flight died with
        them, so those groups are handed back for re-dispatch, and a replaced one is dead."""
        now = self._clock()
        old = self.instances.get(instance_id)
        stale_port = None
        orphans: set[str] = set()
        replaced = []
        for other in list(self.instances.values()):
            live = other.state in (InstanceState.ACTIVE, InstanceState.SUSPECT)
            if other.instance_id != instance_id and other.address == address and live:
                orphans |= self._end(other, InstanceState.DEAD)
                replaced.append(other.instance_id)
        if old is not None and old.state in (InstanceState.ACTIVE, InstanceState.SUSPECT):
            already = True
            restarted = bool(incarnation and old.incarnation and incarnation != old.incarnation)
            if old.address != address or restarted:
                if old.address != address:
                    stale_port, old.port = old.port, self._connect(address)
                    old.address = address
                orphans |= old.in_flight
                old.in_flight = set()
                old.free_slots = capacity
            old.incarnation = incarnation or old.incarnation
            old.capacity, old.labels = capacity, dict(labels)
            old.policy_ids, old.workflows = frozenset(policy_ids), frozenset(workflows)
            old.loaded_versions = dict(loaded_versions)
            old.state, old.failures, old.last_seen = InstanceState.ACTIVE, 0, now
            old.suspect_reason = ""
            old.load_retry_at = 0.0  # a RaaS that registers again may load at once
            return already, stale_port, orphans, replaced
        if old is not None:
            stale_port = old.port
        self.instances[instance_id] = Instance(
            instance_id=instance_id,
            address=address,
            capacity=capacity,
            policy_ids=frozenset(policy_ids),
            workflows=frozenset(workflows),
            labels=dict(labels),
            port=self._connect(address),
            loaded_versions=dict(loaded_versions),
            free_slots=capacity,
            last_seen=now,
            incarnation=incarnation,
        )
        return False, stale_port, orphans, replaced

    def live(self, instance_id: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None or inst.state in (InstanceState.DEAD, InstanceState.LEFT):
            raise NotFound(
                f"instance {instance_id!r} is not registered",
                reason="INSTANCE_NOT_REGISTERED",
                metadata={"instance_id": instance_id},
            )
        return inst

    def heartbeat(
        self, instance_id: str, free_slots: int, loaded_versions: dict[str, int], pending: int
    ) -> Instance:
        inst = self.live(instance_id)
        inst.free_slots = free_slots
        inst.loaded_versions = dict(loaded_versions)
        inst.pending_results = pending
        inst.last_seen = self._clock()
        if inst.state is InstanceState.SUSPECT and inst.suspect_reason == "silence":
            inst.state, inst.failures, inst.suspect_reason = InstanceState.ACTIVE, 0, ""
        return inst

    def _end(self, inst: Instance, state: InstanceState) -> set[str]:
        inst.state, inst.ended_at = state, self._clock()
        orphans, inst.in_flight = inst.in_flight, set()
        return orphans

    def deregister(self, instance_id: str) -> set[str]:
        inst = self.instances.get(instance_id)
        if inst is None or inst.state in (InstanceState.DEAD, InstanceState.LEFT):
            return set()
        return self._end(inst, InstanceState.LEFT)

    def call_failed(self, instance_id: str) -> None:
        inst = self.instances.get(instance_id)
        if inst is not None and inst.state in (InstanceState.ACTIVE, InstanceState.SUSPECT):
            inst.state, inst.suspect_reason = InstanceState.SUSPECT, "call"

    def call_succeeded(self, instance_id: str) -> None:
        inst = self.instances.get(instance_id)
        if inst is not None and inst.state is not InstanceState.LEFT:
            inst.last_seen = self._clock()

    def probe_result(self, instance_id: str, ok: bool) -> set[str]:
        """Records a health probe; returns the orphaned groups if death is confirmed."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.state is not InstanceState.SUSPECT:
            return set()
        if ok:
            inst.state, inst.failures, inst.last_seen = InstanceState.ACTIVE, 0, self._clock()
            inst.suspect_reason = ""
            return set()
        inst.failures += 1
        if inst.failures >= self.settings.confirm_failures:
            return self._end(inst, InstanceState.DEAD)
        return set()

    def check_silence(self) -> list[str]:
        """Marks instances whose heartbeats stopped as suspects."""
        now = self._clock()
        turned = []
        for inst in self.instances.values():
            silent = now - inst.last_seen > self.settings.heartbeat_timeout_s
            if inst.state is InstanceState.ACTIVE and silent:
                inst.state, inst.suspect_reason = InstanceState.SUSPECT, "silence"
                turned.append(inst.instance_id)
        return turned

    def forget_ended(self) -> list[RolloutPort]:
        """Drops dead/left instances kept past the retention; returns ports to close."""
        now = self._clock()
        gone = [
            i
            for i in self.instances.values()
            if i.state in (InstanceState.DEAD, InstanceState.LEFT)
            and now - i.ended_at > self.settings.dead_retention_s
        ]
        for inst in gone:
            del self.instances[inst.instance_id]
        return [i.port for i in gone]

    def load_due(self, inst: Instance) -> bool:
        """Whether a weight load may start on the instance now (its retry backoff is over)."""
        return self._clock() >= inst.load_retry_at

    def load_failed(self, instance_id: str, error: str) -> int:
        """Records a failed weight load; returns the failures in a row."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return 0
        inst.load_failures += 1
        inst.load_error = error
        backoff = min(LOAD_RETRY_MAX_S, LOAD_RETRY_BASE_S * 2 ** (inst.load_failures - 1))
        inst.load_retry_at = self._clock() + backoff
        return inst.load_failures

    def load_succeeded(self, instance_id: str) -> None:
        inst = self.instances.get(instance_id)
        if inst is not None:
            inst.load_failures, inst.load_error, inst.load_retry_at = 0, "", 0.0

    def retry_loads_now(self) -> None:
        """Ends every load backoff (the WeightService address changed)."""
        for inst in self.instances.values():
            inst.load_retry_at = 0.0

    def failing_loads(self) -> list[Instance]:
        """Live instances whose last `LOAD_FAILURES_REPORTED` or more weight loads failed."""
        return [
            i
            for i in self.by_state(InstanceState.ACTIVE, InstanceState.SUSPECT)
            if i.load_failures >= LOAD_FAILURES_REPORTED
        ]

    def by_state(self, *states: InstanceState) -> list[Instance]:
        return [i for i in self.instances.values() if i.state in states]

    @property
    def empty(self) -> bool:
        return not self.by_state(InstanceState.ACTIVE)

    def eligible(
        self,
        workflow: str,
        policy_ids: Iterable[str],
        slots: int,
        min_versions: dict[str, int] | None = None,
        labels: dict[str, str] | None = None,
    ) -> list[Instance]:
        """The ACTIVE instances serving the work with >= `slots` free, in pool order.

        An instance that holds an older version of a policy than `min_versions` asks
        for is skipped until it has loaded a newer one; with `labels`, only instances
        whose labels include them all are considered.
        """
        wanted = frozenset(policy_ids)
        out = []
        for inst in self.instances.values():
            if inst.state is not InstanceState.ACTIVE or inst.free_slots < slots:
                continue
            if not inst.serves(workflow, wanted, labels):
                continue
            if min_versions and any(inst.held(p) < v for p, v in min_versions.items()):
                continue
            out.append(inst)
        return out

    def pick(
        self,
        workflow: str,
        policy_ids: Iterable[str],
        slots: int,
        min_versions: dict[str, int] | None = None,
        labels: dict[str, str] | None = None,
    ) -> Instance | None:
        """The eligible instance (see `eligible`) with the most free slots; the first in
        pool order among equals."""
        best = None
        for inst in self.eligible(workflow, policy_ids, slots, min_versions, labels):
            if best is None or inst.free_slots > best.free_slots:
                best = inst
        return best

    def owner_of(self, group_id: str) -> Instance | None:
        for inst in self.instances.values():
            if group_id in inst.in_flight:
                return inst
        return None
