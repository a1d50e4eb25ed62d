"""The groups that are done (an outcome recorded), without holding every id in memory.

A run that lasts weeks finishes millions of groups. Their ids stay in the work
table (state "done", with their outcome: the run's accounting reads them), but
Dataflow keeps only the newest `recent` in memory and asks the table for the
rest, so its memory and its restart time stay bounded by the work in flight,
not by the run's history. The table is only asked about ids that are not in
flight: a late duplicate result, or an evaluation scheduled again; a result for
a group in flight never reaches it. Never imports gRPC.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

RECENT = 65_536  # ids kept in memory (a few MiB)


class DoneGroups:
    """`gid in done` and `done.add(gid)`, backed by the store's `is_done` lookup."""

    def __init__(self, is_done: Callable[[str], bool], count: int, *, recent: int = RECENT) -> None:
        """count: the groups the table records as done (at start-up)."""
        self._is_done, self._count, self._limit = is_done, count, recent
        self._recent: OrderedDict[str, None] = OrderedDict()

    def add(self, group_id: str) -> None:
        """Marks a group done that was not (it leaves `work`); the caller records it in the
        work table in the same transaction (`Tx.set_work(..., "done")`), which is what later
        lookups read."""
        self._count += 1
        self._recent[group_id] = None
        self._recent.move_to_end(group_id)
        while len(self._recent) > self._limit:
            self._recent.popitem(last=False)

    def reopen(self, group_id: str) -> None:
        """A done group is to be dispatched again (its record was corrupt): no longer done;
        the caller sets its work row pending in the same transaction."""
        self._count = max(0, self._count - 1)
        self._recent.pop(group_id, None)

    def __contains__(self, group_id: object) -> bool:
        return isinstance(group_id, str) and (group_id in self._recent or self._is_done(group_id))

    def __len__(self) -> int:
        """Every group done, those in the table at start-up included."""
        return self._count

    @property
    def in_memory(self) -> int:
        return len(self._recent)
