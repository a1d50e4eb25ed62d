"""Dataflow's start: the run's state read back from the state store, as it was last written.

`recover` restores the counts (astra.dataflow.ledger), versions, evaluations, dataset
positions, the groups not done (waiting again: a lease does not survive a restart), the
buffered, leased and remembered groups, and the batches; what belongs to a policy or stream
this configuration lacks stays on disk untouched. Records read back that are not as written
are quarantined (astra.dataflow.quarantine). Runs once, before any loop; never touches gRPC.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

from astra.dataflow.batches import BatchDesk
from astra.dataflow.config import DataflowConfig
from astra.dataflow.evals import EvalDesk
from astra.dataflow.ledger import Ledger
from astra.dataflow.quarantine import Redo, quarantine
from astra.dataflow.records import BatchRow, GroupRecord
from astra.dataflow.store import StateStore
from astra.dataflow.versions import VersionBook
from astra.dataflow.work import WorkTable

log = logging.getLogger("astra.dataflow.coordinator")


def recover(
    config: DataflowConfig,
    st: StateStore,
    ledger: Ledger,
    versions: VersionBook,
    evals: EvalDesk,
    redo: Redo,
    table: WorkTable,
    batches: BatchDesk,
) -> None:
    buffers = ledger.buffers
    uncounted = ledger.restore(st.get)  # before the groups (which counts them `restored`)
    versions.restore(st.get("versions", {}))
    evals.restore(st.get("evals", {}))
    for name, source in table.sources.items():
        saved = st.get(f"dataset/{name}")
        if saved is not None:
            source.restore(saved)
    # What belongs to a stream or policy this configuration lacks (a resume with another
    # config) stays on disk untouched, for when it is configured again.
    kept: Counter[str] = Counter()
    for row in st.unfinished_work():  # done groups stay in the table (`table.done`)
        if row.stream not in table.sources:
            kept[f"unfinished groups of stream {row.stream!r}"] += 1
            continue
        item = table.sources[row.stream].item_for(row.group_id)
        if row.group_id in redo.policies:  # generated again (astra.dataflow.quarantine)
            item = replace(item, regenerate=True)
        table.add(item, row.stream, attempts=row.attempts)
    leased: dict[str, list[GroupRecord]] = {}
    for group, batch_id in st.groups():
        if group.policy_id not in buffers:
            kept[f"groups of policy {group.policy_id!r}"] += 1
        elif batch_id is None:
            buffers[group.policy_id].restore(group)
        else:
            leased.setdefault(batch_id, []).append(group)
    for policy_id, remembered in st.replay_memory().items():
        if policy_id not in buffers:
            kept[f"groups in the replay memory of policy {policy_id!r}"] += len(remembered)
            continue
        for group in remembered:
            buffers[policy_id].restore_replay(group)
    gone = {p: b.pop_replay_gone() for p, b in buffers.items()}
    if any(gone.values()):  # this configuration keeps fewer (or none)
        with st.tx() as tx:
            for policy_id, group_ids in gone.items():
                tx.forget_replays(policy_id, group_ids)
            ledger.persist(tx)
    rows = [r for r in st.batches() if r.policy_id in buffers]
    for what, n in sorted(kept.items()):
        log.warning("%d %s kept on disk: not configured", n, what)
    batches.recover(rows, leased, st.replays())
    if uncounted:
        _count_replay_slots(config, st, ledger, versions, batches, rows)
    quarantine(st, table, ledger, redo, st.corrupt)  # records read back not as written
    st.corrupt.clear()
    if table.work:
        log.info("recovered %d unfinished groups to dispatch again", len(table.work))


def _count_replay_slots(
    config: DataflowConfig,
    st: StateStore,
    ledger: Ledger,
    versions: VersionBook,
    batches: BatchDesk,
    rows: list[BatchRow],
) -> None:
    """A state directory from before `replay_slots` was kept (schema 1): the replayed
    copies of the batches taken were never counted. Each version trained filled
    batch_groups slots, and each batch taken since (leased, or acknowledged at the
    current version or later) its own: what `accepted` (fresh groups) and the groups
    buffered lack of that are replayed copies. (This also undoes the expiry at recovery
    of a schema-1 leased batch, which gave back copies that were never counted.)"""
    for policy_id, buf in ledger.buffers.items():
        current = versions.current(policy_id)
        pending = sum(
            len(r.group_keys)
            for r in rows
            if r.policy_id == policy_id
            and r.state == "acked"
            and r.policy_version >= current
            and r.batch_id not in batches.untrained
        )
        slots = (
            current * config.policy(policy_id).batch_groups
            + len(buf)
            + batches.leased_groups(policy_id)
            + pending
        )
        ledger.replay_slots[policy_id] = max(0, slots - ledger.accepted[policy_id])
    log.info("replayed copies counted from the versions trained: %s", dict(ledger.replay_slots))
    with st.tx() as tx:
        ledger.persist(tx)
