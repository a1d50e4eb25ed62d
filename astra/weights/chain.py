"""The chain of one policy's versions, and the decisions made on it: plan and retention.

Versions form one line in publish order (step counters strictly increase).
Every version past the first keeps a delta against its predecessor unless its
tensor layout changed, so any two versions joined by an unbroken run of
deltas are one composed delta apart, in either direction. Pure decisions on
records: no files, no locks, no gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from astra.weights.records import VersionRecord


@dataclass(frozen=True)
class Plan:
    """What takes a receiver to `target`.

    kind "none": it holds the target; "delta": the stored deltas of `steps`
    composed take `base` (a held version) to the target; "full": a full copy.
    """

    kind: str
    target: str
    base: str = ""
    steps: tuple[str, ...] = ()


class Chain:
    """A policy's versions ordered by step counter."""

    def __init__(self, records: Iterable[VersionRecord] = ()) -> None:
        self.records: list[VersionRecord] = sorted(records, key=lambda r: r.version)
        self._index = {r.identity: i for i, r in enumerate(self.records)}

    def add(self, record: VersionRecord) -> None:
        if self.records and record.version <= self.records[-1].version:
            raise ValueError("versions must be appended in increasing order")
        self._index[record.identity] = len(self.records)
        self.records.append(record)

    def remove(self, identities: set[str]) -> None:
        self.__init__([r for r in self.records if r.identity not in identities])

    @property
    def head(self) -> VersionRecord | None:
        return self.records[-1] if self.records else None

    def get(self, identity: str) -> VersionRecord | None:
        i = self._index.get(identity)
        return None if i is None else self.records[i]

    def index(self, identity: str) -> int:
        return self._index[identity]

    def root_index(self, i: int) -> int | None:
        """Index of the newest full version at or before i; None if it was collected."""
        while i >= 0 and self.records[i].kind != "full":
            if not self.records[i].has_delta or i == 0:
                return None
            i -= 1
        return i if i >= 0 else None

    def deltas_since_root(self) -> int:
        """How many deltas the head is past its full root (0 when the head is full)."""
        if not self.records:
            return 0
        root = self.root_index(len(self.records) - 1)
        return len(self.records) - 1 - root if root is not None else len(self.records)

    def linked(self, a: int, b: int) -> bool:
        """True when every version in (min, max] keeps a delta against its predecessor."""
        lo, hi = sorted((a, b))
        return all(self.records[i].has_delta for i in range(lo + 1, hi + 1))

    def steps(self, a: int, b: int) -> tuple[str, ...]:
        lo, hi = sorted((a, b))
        return tuple(r.identity for r in self.records[lo + 1 : hi + 1])

    def plan(self, target: str, held: Iterable[str], max_chain: int) -> Plan:
        """Deltas from the held version fewest steps away (newer on ties), else a full copy.

        A receiver is never sent a full copy merely because it missed versions:
        any held version joined to the target by at most `max_chain` deltas counts.
        """
        t = self._index[target]
        held_set = set(held)
        if target in held_set:
            return Plan("none", target, target)
        best: tuple[int, int, int] | None = None
        for h in held_set:
            i = self._index.get(h)
            if i is None or abs(i - t) > max_chain or not self.linked(i, t):
                continue
            if best is None or (abs(i - t), -i) < best[:2]:
                best = (abs(i - t), -i, i)
        if best is None:
            return Plan("full", target)
        base = best[2]
        return Plan("delta", target, self.records[base].identity, self.steps(base, t))

    def collectable(self, keep_versions: int, pinned: Iterable[str]) -> list[VersionRecord]:
        """Versions older than the full root of the oldest version that must stay.

        Stay: the newest `keep_versions`, the head, and every pinned version
        (held by a live receiver). Everything from that root to the head is
        kept, so each kept version can be rebuilt and reached by deltas.
        """
        if not self.records:
            return []
        needed = [max(0, len(self.records) - max(1, keep_versions))]
        needed += [self._index[p] for p in pinned if p in self._index]
        oldest = min(needed)
        root = self.root_index(oldest)
        cut = root if root is not None else 0
        return self.records[:cut]
