"""Child service processes: started in their own session, found by their address line, stopped
by process group.

Each child is `python -m astra.cli serve ...`, which prints one JSON line with its
address on stdout and logs on stderr. The child's stderr goes to its log file;
after the address line, whatever else it writes on stdout is copied there too (so
the pipe never fills). `start_new_session=True` makes each child the leader of a
process group of its own: Ctrl-C in the terminal reaches only the supervisor,
which decides the order of shutdown, and a stop signals the whole group:
SIGTERM, a grace period, then SIGKILL. A restart SIGKILLs the group of the
process before it first, so helpers of a dead child do not pile up.

Each child also gets the parent-death signal (SIGTERM, astra.parent_death): when the
supervisor dies without stopping them (SIGKILL, the OOM killer), they stop as on a normal
stop rather than train on alone beside a `--resume` (astra.run.ownership).

What the group does not cover: descendants that start a session of their own.
torchrun's ranks are such (a trainer with --nproc > 1: torchrun leads the group,
each rank has a session of its own); torchrun stops them on SIGTERM, and when
torchrun itself is SIGKILLed (stop_grace_s ran out, a second Ctrl-C, a crash, the
OOM killer) each rank's parent-death signal (astra.parent_death, Linux) ends it. A
RaaS's engine server (astra.engine.http.launch) also has a session of its own and
the same signal, so it goes when the RaaS dies however it dies.
A child's exit is seen from its pid, not from its pipes (such a descendant may
hold its stdout open): see `Child.wait`.

With `tls: true` (ASTRA_TLS_NODE_CA set by `astra run`), each child is started with a
credential of its own that names its role (astra.tls_certs.child_credential), so a RaaS cannot
publish weights nor a trainer submit rollouts (astra.authz); the CA itself stays out of reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

from astra import parent_death
from astra.run.logrotate import copy_ids
from astra.tls_certs import child_credential
from astra.tls_material import ENV_DIR, ENV_NODE_CA
from astra.waits import within

log = logging.getLogger(__name__)


EXIT_POLL_S = 0.5  # how often a wait looks at the exit status (see Child.wait)


class ChildFailed(RuntimeError):
    """A child that did not start, or died; the message carries the tail of its log."""


class Child:
    restartable = True  # astra.run.restarts may spawn it again after it died
    rotatable = True  # its log is written on this machine: astra.run.logrotate may rotate it

    def __init__(
        self, name: str, role: str, args: list[str], log_path: Path, env: dict[str, str]
    ) -> None:
        self.name, self.role, self.args, self.log_path, self.env = name, role, args, log_path, env
        self.proc: asyncio.subprocess.Process | None = None
        self.info: dict[str, Any] = {}
        self.stopping = False  # stopped on purpose: its exit is no death
        # Stopped for good (removed, or the run ends): never started again. Unlike `stopping`,
        # neither spawn nor a restart clears it (astra.run.restarts checks it).
        self.retired = False
        self.extra: dict[str, Any] = {}  # more for run.json (a RaaS: capacity, labels, joined)
        # What its TLS credential confines it to (astra.scopes): a trainer's policy, a RaaS's
        self.policies: tuple[str, ...] = ()
        self.credential = ""  # the TLS credential directory it was given, with `tls: true`
        self.log_offset = 0  # size of the log when this process started (logs are appended to)
        # the log's copies there were then (astra.run.logrotate.copy_ids): a reader tells
        # those rotated away before it first looked from older ones
        self.log_copies: frozenset[tuple[int, int]] = frozenset()
        self._log: BinaryIO | None = None
        self._drain: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def address(self) -> str:
        return str(self.info.get("address") or "")

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    async def spawn(self) -> None:
        """Starts the process (again, after it died: a new process, the same log appended to).

        Again: what is left of the group of the process before (helpers in its group) is
        SIGKILLed first."""
        if self.proc is not None:
            self.signal_group(signal.SIGKILL)
        self.close()
        self.info, self.stopping = {}, False
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.log_offset, self.log_copies = self._log.tell(), copy_ids(self.log_path)
        # The supervisor's death (SIGKILL, the OOM killer) ends it too: SIGTERM, so it stops
        # as on a normal stop (a trainer checkpoints) instead of running on alone.
        prefix, preexec = parent_death.spawn_args(signal.SIGTERM)
        self.proc = await asyncio.create_subprocess_exec(
            *prefix,
            *self.args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._log,
            env=self.environment(),
            start_new_session=True,
            preexec_fn=preexec,
        )

    def environment(self) -> dict[str, str]:
        """The supervisor's environment with the child's own, and its own TLS credential
        where the run issues them."""
        env = {**os.environ, **self.env}
        ca = env.pop(ENV_NODE_CA, "")
        if ca:
            self.credential = str(child_credential(Path(ca), self.role, policies=self.policies))
            env[ENV_DIR] = self.credential
        return env

    async def read_address(self, timeout_s: float) -> dict[str, Any]:
        """Waits for the JSON address line; raises ChildFailed (with the log tail) otherwise."""
        assert self.proc is not None and self.proc.stdout is not None
        try:
            line = await within(self.proc.stdout.readline(), timeout_s)
        except TimeoutError:
            raise ChildFailed(f"{self.name}: no address line within {timeout_s:.0f}s") from None
        if not line:
            await self.proc.wait()
            raise ChildFailed(f"{self.name} exited ({self.proc.returncode}) before serving")
        try:
            self.info = json.loads(line)
        except json.JSONDecodeError:
            raise ChildFailed(f"{self.name}: unexpected first line {line[:200]!r}") from None
        self._drain = asyncio.create_task(self._copy_stdout())
        return self.info

    async def result(self) -> dict[str, Any]:
        """For a stage that runs to its end (`astra sft`): its JSON result line on stdout, as
        soon as it is printed; ChildFailed when it exits without one. The stage prints it once
        its output is complete and durable (`astra sft`: the model renamed into place, its
        directory synced), so its exit is not waited for: the interpreter's teardown of torch
        takes a second or more on a loaded machine, and the caller stops the process."""
        assert self.proc is not None and self.proc.stdout is not None
        seen = b""
        while line := await self.proc.stdout.readline():
            seen = (seen + line)[-200:]
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                info = json.loads(line)
                if isinstance(info, dict):
                    self.info = info
                    return info
        rc = await self.proc.wait()
        if rc != 0:
            raise ChildFailed(f"{self.name} exited with {rc}")
        raise ChildFailed(f"{self.name}: no result line on stdout ({seen!r})")

    async def _copy_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None and self._log is not None
        stdout, out = self.proc.stdout, self._log  # this process's: a restart opens new ones
        while line := await stdout.readline():
            if out.closed:
                return
            out.write(line)
            out.flush()

    async def wait(self) -> int:
        """The exit status, once the process exited. Seen from its pid (the loop's child watcher
        sets `returncode` when it reaps it), not from its pipes: asyncio's Process.wait()
        returns only once stdout is closed too, which a descendant in a session of its own
        that inherited it (torchrun's ranks) keeps open after the child died."""
        proc = self.proc
        assert proc is not None
        if proc.returncode is not None:
            return proc.returncode
        waiting = asyncio.ensure_future(proc.wait())
        try:
            while proc.returncode is None and not waiting.done():
                await asyncio.wait({waiting}, timeout=EXIT_POLL_S)
        finally:
            waiting.cancel()
        rc = proc.returncode
        assert rc is not None
        return rc

    def signal_group(self, sig: int) -> None:
        """Signals the child's process group (it is the group leader: pgid == pid)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the group, wait `grace_s`, then SIGKILL; returns the exit status.

        The group only: descendants in sessions of their own are not signalled (see the
        module docstring)."""
        if self.proc is None:
            return None
        self.stopping = True
        if self.proc.returncode is None:
            self.signal_group(signal.SIGTERM)
            try:
                await within(self.wait(), grace_s)
            except TimeoutError:
                log.warning("%s did not stop within %.0fs: SIGKILL", self.name, grace_s)
        # Leftover members of the group (helpers) go too, even after the leader exited.
        self.signal_group(signal.SIGKILL)
        rc = await self.wait()
        if self._drain is not None:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await within(self._drain, 2.0)
        self.close()
        return rc

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def tail(self, lines: int) -> str:
        """The last `lines` lines of the child's log."""
        if lines <= 0 or not self.log_path.is_file():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            last = deque(f.read().decode("utf-8", "replace").splitlines(), maxlen=lines)
        return "\n".join(last)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "pid": self.pid,
            "address": self.address,
            "metrics_port": self.info.get("metrics_port"),
            "returncode": self.returncode,
            **self.extra,
            **({"tls_dir": self.credential} if self.credential else {}),
            "log": str(self.log_path),
            "command": self.args,
        }


async def stop_all(groups: list[list[Child]], grace_s: float) -> None:
    """Stops children group by group (each group concurrently), in the order given; for good
    (retired: no restart brings them back)."""
    for group in groups:
        for c in group:
            c.retired = True
        await asyncio.gather(*(c.stop(grace_s) for c in group), return_exceptions=True)
