"""One owner per state directory: an exclusive lock held for the owner's whole life.

Two Dataflows on one SQLite state, two WeightServices on one version store, two
trainers writing one checkpoint root, or `astra run --resume` beside a run that
is still going each corrupt what the other wrote (a run resumed twice trained
groups twice). So each owner takes `DIR/.lock` with flock(2) when it starts and
keeps it open until it exits; a second owner is refused with the holder's pid and
command. The kernel drops the lock when the holder dies however it dies (SIGKILL,
the OOM killer), so there is no stale lock to clean up. The descriptor is not
inherited across exec (Python's default), so a child process never keeps it.

The file also says who holds it (JSON: pid, role, command, since), for the
message and for `astra doctor`. POSIX only: elsewhere `acquire` holds nothing
and says so in the log.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from astra.durable import make_dirs

log = logging.getLogger(__name__)
LOCK_NAME = ".lock"
POLL_S = 0.1


class StateLocked(RuntimeError):
    """The directory has a live owner; the message names it and what to do."""

    def __init__(self, directory: Path, role: str, holder: dict) -> None:
        self.directory, self.holder = directory, holder
        pid = holder.get("pid", "?")
        what = holder.get("role") or "another process"
        since = holder.get("since", "")
        super().__init__(
            f"{Path(directory).resolve()} is in use by {what} pid {pid}"
            + (f" (since {since})" if since else "")
            + f": a second {role} on the same state would corrupt it. Stop pid {pid} "
            f"first (kill -TERM {pid}), or give this {role} another directory."
        )


@dataclass
class StateLock:
    """A held lock; `release` (or the process's exit) gives it up."""

    directory: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def holder(directory: Path) -> dict:
    """Who says they hold `directory`'s lock (empty when nobody ever did or it is unreadable)."""
    try:
        return json.loads((Path(directory) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def is_held(directory: Path) -> bool:
    """Whether a live process holds `directory`'s lock now (tries it and lets go at once)."""
    path = Path(directory) / LOCK_NAME
    if not path.is_file():
        return False
    try:
        import fcntl
    except ImportError:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def acquire(directory: Path | str, role: str, *, wait_s: float = 5.0) -> StateLock:
    """Takes `directory`'s lock for this process (creating the directory), or raises
    StateLocked naming the holder. Waits up to `wait_s` first: a restart may start a new
    owner while the kernel still tears the old one down."""
    directory = Path(directory)
    make_dirs(directory)
    try:
        import fcntl
    except ImportError:  # not POSIX
        log.warning("no flock here: nothing stops a second %s on %s", role, directory)
        return StateLock(directory, None)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise StateLocked(directory, role, holder(directory)) from None
            time.sleep(POLL_S)
    me = {
        "pid": os.getpid(),
        "role": role,
        "command": sys.argv,
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    return StateLock(directory, fd)


def acquire_or_exit(directory: Path | str, role: str, *, wait_s: float = 5.0) -> StateLock:
    """`acquire` for a command's start-up: a held directory ends the process with exit 2
    and one line on stderr naming the holder and what to do."""
    try:
        return acquire(directory, role, wait_s=wait_s)
    except StateLocked as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
