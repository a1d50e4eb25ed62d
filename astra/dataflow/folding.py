"""Complete epochs folded: their per-group work rows become one count per (stream, epoch).

The work table holds a row per group a stream ever pulled (~90 bytes), so a run of weeks
grows it by millions of rows that say nothing but "done". Once a stream's dataset is durably
past an epoch and every group of that epoch is done, the epoch's rows are not needed one by
one: `EpochFolder` replaces them with one row of `folded_work` (stream, epoch, groups done),
keeping the rows of the newest `storage.keep_done_epochs` complete epochs. What still holds:

- `DoneGroups` (a late duplicate result, by id): a group id ``<stream>/<epoch>/<index>`` of a
  folded epoch is done (`StateStore.is_done`).
- the run's accounting: `done_count` and astra.run.summary add the folded counts.

An epoch folds only when the dataset position stored for the stream is past it (so every
group of it was pulled and written), no row of it is waiting or leased, and no group of it is
in flight in memory; all three are read in the same turn of the event loop as each chunk's
transaction, which moves up to CHUNK_ROWS rows into the count (a group of a half-folded epoch
is done either way). Evaluation streams are never folded (their "epoch" is the version
evaluated, scheduled again by id). Never imports gRPC.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)
FOLD_EVERY_S = 30.0  # how often the folder looks for epochs to fold, at most (the default)
CHUNK_ROWS = 2000  # rows folded per transaction: ~10 ms of the event loop (5000: ~21 ms)


def durable_epoch(saved: dict[str, Any] | None) -> int:
    """The first epoch the stored dataset position has not finished (0: none stored)."""
    if not saved:
        return 0
    epoch, position, size = saved.get("epoch", 0), saved.get("position", 0), saved.get("size")
    return int(epoch) + (1 if size is not None and position >= size else 0)


class EpochFolder:
    """Folds the complete epochs of the training streams (see the module docstring), a chunk
    of rows per transaction, so a large epoch never holds the event loop for long."""

    def __init__(
        self,
        store: Any,
        streams: Iterable[str],
        keep: int | None,
        *,
        in_flight: Callable[[str, int], bool],
        every_s: float = FOLD_EVERY_S,
        chunk_rows: int = CHUNK_ROWS,
        on_folded: Callable[[Any, int], None] | None = None,
    ) -> None:
        """`keep`: complete epochs whose rows stay (None: never fold); `in_flight(stream,
        epoch)`: whether a group of that epoch is in flight in memory; `on_folded(tx, rows)`:
        called in each chunk's transaction (Dataflow counts the rows there)."""
        self.store, self.keep, self.in_flight, self.every_s = store, keep, in_flight, every_s
        self.on_folded = on_folded
        self.chunk_rows = chunk_rows
        self.streams = list(streams)
        # Per stream, the epoch to fold next: the newest with a count is looked at again (a
        # restart may have come between two of its chunks).
        self._next = {s: store.newest_folded_epoch(s) or 0 for s in self.streams}
        self._last = -float("inf")
        self._busy = False  # in the middle of an epoch: the next chunk does not wait
        self.folded_groups = 0  # rows folded by this process

    def maybe_fold(self, now: float | None = None) -> int:
        """One chunk, when one is due (an epoch begun, or `every_s` since the last look);
        returns the rows folded."""
        now = time.monotonic() if now is None else now
        if self.keep is None or (not self._busy and now - self._last < self.every_s):
            return 0
        self._last = now
        folded = self._chunk()
        self._busy = folded is not None
        return folded or 0

    def fold(self) -> int:
        """Folds everything that may be folded now; returns the rows folded."""
        total = 0
        while (folded := self._chunk()) is not None:
            total += folded
        return total

    def _chunk(self) -> int | None:
        """Folds one chunk of the first stream with an epoch to fold; None when none has one
        (each stream stops at its first epoch that may not fold: a group still in flight)."""
        if self.keep is None:
            return None
        for stream in self.streams:
            epoch = self._next[stream]
            upto = durable_epoch(self.store.get(f"dataset/{stream}")) - self.keep
            if epoch >= upto or self.in_flight(stream, epoch):
                continue
            with self.store.tx() as tx:
                folded = tx.fold_epoch(stream, epoch, self.chunk_rows)
                if folded and self.on_folded is not None:
                    self.on_folded(tx, folded)
            if folded is None:  # a row of it still waiting or leased
                continue
            self.folded_groups += folded
            if folded < self.chunk_rows:
                self._next[stream] = epoch + 1
                log.info("epoch %d of %s folded into a count", epoch, stream)
            return folded
        return None
