"""Ties a process's life to its parent's: the kernel signals it when the parent goes (Linux).

A process that starts a session of its own (torchrun's ranks, a launched vLLM or
SGLang server, a Ray actor's child) is out of reach of a signal to its parent's
process group, so when that parent is SIGKILLed (the OOM killer, a stop whose
grace ran out) it is orphaned and keeps its GPU and ports. PR_SET_PDEATHSIG
asks the kernel to send a signal when the parent *thread* that forked the process
exits: set it in the child (`preexec`, for a Popen) or in the process itself
(`die_with_parent`, for a process someone else starts, such as a torchrun rank).
Both check afterwards that the parent has not already gone, when no signal would
come. Elsewhere than Linux they do nothing and say so.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's prctl, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A Popen preexec_fn: the child gets `sig` when the thread that started it goes; None
    where prctl is not there. Resolves prctl before the fork (nothing to import after it)."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def set_in_child() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent went before prctl: no signal would come
            os.kill(os.getpid(), int(sig))

    return set_in_child


def spawn_args(sig: int = signal.SIGTERM) -> tuple[list[str], Callable[[], None] | None]:
    """(a command prefix, a preexec_fn) that give a child `sig` when its parent thread goes.

    util-linux's `setpriv --pdeathsig` where there is one: the child then runs no Python
    between fork and exec, so the parent's at-fork handlers (gRPC's among them, which may
    start a poller that the closing of inherited descriptors makes abort the child) never
    run in it, and the interpreter can spawn it without a full fork. Elsewhere, `preexec`."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    name = signal.Signals(sig).name.removeprefix("SIG")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", name, "--"], None
    return [], preexec(sig)


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """This process gets `sig` when its parent goes; False where prctl is not there.

    `parent`: the pid the parent must have (say, passed down in the environment): when
    the process has another one, the parent already went and the signal is sent at once.
    Without it, a parent that goes between reading its pid and prctl is caught; one that
    went before cannot be told from a parent that is a subreaper or pid 1.
    """
    prctl = _prctl()
    if prctl is None:
        return False
    before = os.getppid()
    if prctl(PR_SET_PDEATHSIG, int(sig)) != 0:
        return False
    now = os.getppid()
    if now != before or (parent is not None and now != parent):
        os.kill(os.getpid(), int(sig))
    return True
