"""A run has one owner: the supervisor holds RUN_DIR's lock, and `--resume` cleans up first.

`astra run` takes RUN_DIR/.lock (astra.statelock) before it writes anything, so a
`--resume` (or a second run into the same directory) while the run is live is
refused, naming the supervisor's pid. When the supervisor is dead, its children
should be gone too (each gets the parent-death signal, astra.run.children); those
still alive (a supervisor of an older version, a child that ignored SIGTERM) are
orphans that would share the run's state with the new children: `--resume` stops
them first, SIGTERM to their process group, a grace, then SIGKILL. A pid is taken
for one of the run's only when its command line is the one run.json recorded (or,
for a trainer that became torchrun, names the same files under RUN_DIR), so a pid
reused by an unrelated process is never signalled.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

from astra.run.layout import RunDir
from astra.statelock import StateLock, StateLocked, acquire

log = logging.getLogger("astra.run")


class RunBusy(RuntimeError):
    """The run directory has a live owner."""


def hold(rd: RunDir) -> StateLock:
    """Holds RUN_DIR for this supervisor's life; RunBusy when a live one holds it."""
    try:
        return acquire(rd.root, "astra run", wait_s=0.0)
    except StateLocked as exc:
        pid = exc.holder.get("pid", "?")
        raise RunBusy(
            f"{rd.root} is a live run: its supervisor is pid {pid}. Stop it first "
            f"(kill -TERM {pid}, or Ctrl-C in its terminal), then `astra run --resume {rd.root}`."
        ) from None


def before_resume(rd: RunDir, grace_s: float) -> list[str]:
    """Stops what the last supervisor left alive (names of those stopped); RunBusy when that
    supervisor itself still runs (one of an older version, which held no lock)."""
    previous = _previous(rd)
    sup = previous.get("supervisor") or {}
    if sup.get("state") not in (None, "ended") and _alive_as(sup.get("pid"), [str(rd.root)]):
        raise RunBusy(
            f"{rd.root}: its supervisor pid {sup['pid']} is still alive (state "
            f"{sup['state']}). Stop it first (kill -TERM {sup['pid']}), then resume."
        )
    return stop_orphans(rd, previous.get("children") or [], grace_s)


def _previous(rd: RunDir) -> dict:
    try:
        return json.loads(rd.run_json.read_text())
    except (OSError, ValueError):
        return {}


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _alive_as(pid: object, needles: list[str]) -> bool:
    """`pid` is alive and its command line contains every one of `needles`."""
    if not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        return False
    cmd = _cmdline(pid)
    return cmd is not None and all(any(n in a for a in cmd) for n in needles)


def ours(pid: int, command: list[str], root: Path) -> bool:
    """Whether live `pid` runs `command` (exactly, or with the same files under `root`)."""
    cmd = _cmdline(pid)
    if not cmd:
        return False
    if cmd == command:
        return True
    files = {a for a in command if root.name in a and os.sep in a}
    return bool(files & {a.split("=", 1)[-1] for a in cmd})


def stop_orphans(rd: RunDir, children: list[dict], grace_s: float) -> list[str]:
    """Stops the children run.json lists that are still alive and ours; their names."""
    found = [
        c
        for c in children
        if isinstance(c.get("pid"), int)
        and c["pid"] > 1
        and ours(c["pid"], list(c.get("command") or []), rd.root)
    ]
    if not found:
        return []
    names = [f"{c['name']} (pid {c['pid']})" for c in found]
    log.warning(
        "the last supervisor of %s died and left %s running: stopping them before resuming",
        rd.root,
        ", ".join(names),
    )
    for c in found:
        _signal_group(c["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_cmdline(c["pid"]) for c in found):
        time.sleep(0.1)
    for c in found:
        if _cmdline(c["pid"]):
            log.warning("%s did not stop within %.0fs: SIGKILL", c["name"], grace_s)
        _signal_group(c["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(_cmdline(c["pid"]) for c in found):
        time.sleep(0.1)
    return names


def _signal_group(pid: int, sig: int) -> None:
    """The child's process group (each child leads one), else the pid alone."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return
    except PermissionError:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
