"""Keeps Dataflow off a full disk: pauses ingest and dispatch while free space is short.

Dataflow writes every collected group to its blob log and every lease to SQLite. Were the
disk to fill, a failed transaction would stop the process (fail-stop) and every restart
would fail again. Instead, below `min_free_bytes` free on the state directory's file system
(or once a blob write fails with ENOSPC/EDQUOT), Dataflow pauses: it dispatches no new
groups and collects no results, so the RaaS keep what they finished until it is
acknowledged (nothing is lost), while batches are still served and acknowledged, which is
what frees space. It resumes at `resume_free_bytes` (hysteresis). Knows nothing of gRPC.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


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
            if self.free_now >= self.resume_free_bytes:
                self.paused, self.reason = False, ""
        elif self.free_now < self.min_free_bytes:
            self._pause(
                f"storage: {self.free_now:,} bytes free on {self.path} < "
                f"min_free_bytes {self.min_free_bytes:,}"
            )
        return self.paused

    def note_full(self, exc: BaseException) -> None:
        """A write failed for lack of space: pause now, until the space is back."""
        self._pause(f"storage: a write to {self.path} failed: {exc}")
        self._checked = self.clock()

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
