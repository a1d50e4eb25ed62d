"""Keeps Dataflow off a full disk: pauses ingest and dispatch while free space is short.

Dataflow writes every collected group to its blob log and every lease to SQLite. Were the
disk to fill, a failed transaction would stop the process (fail-stop) and every restart
would fail again. Instead, below `min_free_bytes` free on the state directory's file system
(or once a blob write fails with ENOSPC/EDQUOT), Dataflow pauses: it dispatches no new
groups and collects no results, so the RaaS keep what they finished until it is
acknowledged (nothing is lost), while batches are still served and acknowledged (consumed
groups free their bytes as whole blob-log segments fall out of use). It resumes at `resume_free_bytes` (hysteresis). After a failed write it
resumes once FULL_MARGIN more is free than at the failure (a quota or another file system
that statvfs does not show would otherwise fail at once again), or, failing that, retries
after a wait that doubles with each failure in a row (up to MAX_RETRY_S). Knows nothing of
gRPC.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_MARGIN = 64 << 20  # bytes more than at a failed write before ingest tries again
MAX_RETRY_S = 300.0


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on `path`'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


class StorageGuard:
    """Whether Dataflow must pause for lack of disk space, checked at most every interval."""

    def __init__(
        self,
        path: Path,
        min_free_bytes: int,
        resume_free_bytes: int,
        check_interval_s: float,
        *,
        free: Callable[[Path], int] = free_bytes,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path, self.free, self.clock = path, free, clock
        self.min_free_bytes, self.resume_free_bytes = min_free_bytes, resume_free_bytes
        self.check_interval_s = check_interval_s
        self.paused = False
        self.reason = ""
        self.pauses = 0  # times it paused, for the counters
        self.free_now = -1
        self._checked = -float("inf")
        # After a failed write: the free bytes then, when to try anyway, and the wait before.
        self._failed_free: int | None = None
        self._retry_at, self._retry_s = 0.0, 0.0

    def check(self) -> bool:
        """Reads the free space (at most every check interval) and returns `paused`."""
        now = self.clock()
        if self.min_free_bytes <= 0 and not self.paused:
            return False
        if now - self._checked < self.check_interval_s:
            return self.paused
        self._checked = now
        try:
            self.free_now = self.free(self.path)
        except OSError as exc:
            self._pause(f"cannot read the free space of {self.path}: {exc}")
            return True
        if self.paused:
            if self._failed_free is not None:
                freed = self.free_now >= max(
                    self.resume_free_bytes, self._failed_free + FULL_MARGIN
                )
                if freed or now >= self._retry_at:
                    self._failed_free = None
                    self._retry_s = 0.0 if freed else self._retry_s
                    self.paused, self.reason = False, ""
            elif self.free_now >= self.resume_free_bytes:
                self.paused, self.reason = False, ""
        else:
            self._pause_if_low("")
        return self.paused

    def note_written(self, nbytes: int) -> None:
        """`nbytes` were just written: the free space is that much less until the next read,
        so a burst of writes between two reads still pauses at the threshold."""
        if self.free_now < 0:
            return
        self.free_now -= nbytes
        if not self.paused:
            self._pause_if_low("about ")

    def _pause_if_low(self, approx: str) -> None:
        if self.min_free_bytes > 0 and self.free_now < self.min_free_bytes:
            self._pause(
                f"storage: {approx}{self.free_now:,} bytes free on {self.path} < "
                f"min_free_bytes {self.min_free_bytes:,}"
            )

    def note_full(self, exc: BaseException) -> None:
        """A write failed for lack of space: pause now, until the space is back (or the retry)."""
        now = self.clock()
        try:
            self._failed_free = self.free_now = self.free(self.path)
        except OSError:
            self._failed_free = 0
        self._retry_s = min(MAX_RETRY_S, max(2 * self._retry_s, self.check_interval_s))
        self._retry_at = now + self._retry_s
        self._pause(
            f"storage: a write to {self.path} failed ({exc}); trying again with "
            f"{FULL_MARGIN >> 20} MiB more free or in {self._retry_s:g} s"
        )
        self._checked = now

    def _pause(self, reason: str) -> None:
        if not self.paused:
            self.pauses += 1
        self.paused, self.reason = True, reason

    def status(self) -> dict:
        return {
            "free_bytes": self.free_now,
            "min_free_bytes": self.min_free_bytes,
            "resume_free_bytes": self.resume_free_bytes,
            "paused": self.paused,
            "reason": self.reason,
        }


class PauseWatch:
    """`StorageGuard.check` for Dataflow's loops: counts each pause, logs each change, and on
    resuming pushes the group leases back by the pause (`on_resume(seconds)`)."""

    def __init__(
        self, guard: StorageGuard, counters, on_resume: Callable[[float], None], log
    ) -> None:
        self.guard, self.counters, self.on_resume, self.log = guard, counters, on_resume, log
        self.seen = 0  # the guard's pauses counted so far
        self.was_paused = False
        self.paused_at = 0.0

    def __call__(self) -> bool:
        paused = self.guard.check()
        if self.guard.pauses != self.seen:
            self.counters["storage_pauses"] += self.guard.pauses - self.seen
            self.seen = self.guard.pauses
            why = self.guard.reason
            self.log.error("%s: dispatch and ingest paused (the RaaS keep their results)", why)
        elif self.was_paused and not paused:
            free = f"{self.guard.free_now:,}"
            self.log.warning("storage: %s bytes free again: dispatch and ingest resume", free)
            self.on_resume(time.time() - self.paused_at)
        if paused and not self.was_paused:
            self.paused_at = time.time()
        self.was_paused = paused
        return paused
