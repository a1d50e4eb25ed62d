"""Read-only views of a Store the WeightService answers from: version pages, heads, receivers.

`version_page` pages a policy's versions newest first, below a version
counter (the page token's content); `heads` are the current versions;
`receiver_versions` says, per registered receiver, the newest version it
holds that the store still knows. Plain Python: no gRPC, no protobuf; never
changes the store.
"""

from __future__ import annotations

from astra.weights.records import VersionRecord
from astra.weights.store import Store


def version_page(
    store: Store, policy: str, before: int | None, size: int
) -> tuple[list[VersionRecord], int | None]:
    """Up to `size` versions older than `before` (None: from the newest), and the counter
    the next page starts below (None: this is the last page)."""
    records = [r for r in store.list_versions(policy) if before is None or r.version < before]
    page = records[:size]
    return page, page[-1].version if len(records) > size else None


def heads(store: Store) -> list[VersionRecord]:
    """Each policy's current version, for the policies that have one."""
    out = []
    for policy in store.policies():
        head = store.chain(policy).head
        if head is not None:
            out.append(head)
    return out


def receiver_versions(store: Store) -> dict[str, str]:
    """ "policy/receiver" -> identity of the newest version it holds that the store knows
    ("" when none)."""
    receivers = {}
    for policy, entries in store.receivers.snapshot().items():
        chain = store.chain(policy) if policy in store.policies() else None
        for receiver_id, held in entries.items():
            known = [chain.get(h) for h in held] if chain else []
            newest = max((r for r in known if r), key=lambda r: r.version, default=None)
            receivers[f"{policy}/{receiver_id}"] = newest.identity if newest else ""
    return receivers
