"""The Ray actor of `astra run --ray`: one per child, it runs the child's command on its node.

`process_actor()` is the actor class (`ray.remote` of `_Process`, made once). The
actor starts the command with `subprocess` in a session of its own, keeps the
first stdout line (the address line), writes the child's stderr and the rest of
its stdout to the child's log, waits for it and signals its process group; the
child gets SIGKILL when the actor's thread that started it goes
(PR_SET_PDEATHSIG). After the process exits, `start` may run a new one (a
restart). Runs on the Ray node; astra.run.ray_children drives it.

Given `rotate`, the actor also keeps the child's log (and the engine servers' logs in its
state directory) under a size while the child runs (astra.run.logrotate's copytruncate). It
does so on the node whose processes write the log: truncating a file on a shared filesystem
under a writer on another node is not safe on every filesystem (NFS), on the same node it is.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import IO, Any

from astra import parent_death


class _Process:
    """One child process on the actor's node (wrapped by ray.remote in `_actor_class`)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines: deque[bytes] = deque(maxlen=64)  # stdout's last lines (result())
        self.first: bytes | None = None
        self.has_first = threading.Event()  # first line read, or end of stdout
        self.exited = threading.Event()
        self.rc: int | None = None
        self.error: str | None = None
        self.rotating: threading.Thread | None = None  # keeps the logs small (`rotate`)

    def placement(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_id": ctx.get_actor_id(),
            "hostname": socket.gethostname(),
            "worker_pid": os.getpid(),
        }

    def start(
        self,
        args: list[str],
        env: dict[str, str],
        log_path: str,
        cwd: str,
        own_python: bool,
        rotate: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Starts the command (`own_python`: with this node's interpreter); returns its pid and
        the size of the log before it (logs are appended to). Again after the last one exited
        (a restart): the actor then stands for the new process. `rotate`: max_bytes,
        backups and state_dir (where an engine server's ``*-server.log`` lands, or "") to keep
        the logs small with while it runs."""
        if self.proc is not None:
            if not self.exited.is_set():
                return {"error": f"process {self.proc.pid} is still running"}
            if self.rotating is not None:  # done with the last process's logs first
                self.rotating.join()
            self.__init__()  # type: ignore[misc]
        if own_python:
            args = [sys.executable, *args[1:]]
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        logf = open(log_path, "ab")  # noqa: SIM115 - the reader thread closes it
        offset = logf.tell()
        started = threading.Event()
        env = {**os.environ, **env}
        where = cwd if os.path.isdir(cwd) else None
        reader = threading.Thread(
            target=self._run, args=(args, env, logf, where, started), daemon=True
        )
        reader.start()  # starts the process: PDEATHSIG follows this thread, alive while it is
        started.wait()
        if self.proc is None:
            return {"error": self.error or "not started"}
        if rotate:
            self.rotating = threading.Thread(
                target=self._keep_logs_small, args=(Path(log_path), rotate), daemon=True
            )
            self.rotating.start()
        from astra.run.logrotate import copy_ids

        copies = [list(i) for i in copy_ids(Path(log_path))]
        return {"pid": self.proc.pid, "log_offset": offset, "log_copies": copies, "command": args}

    def _keep_logs_small(self, log_path: Path, rotate: dict[str, Any]) -> None:
        """Until the process exits: the logs it writes rotated past rotate["max_bytes"]."""
        from astra.run.logrotate import CHECK_EVERY_S
        from astra.run.logrotate import rotate as rotate_one

        exited = self.exited
        state = Path(rotate["state_dir"]) if rotate.get("state_dir") else None
        every_s = float(rotate.get("every_s", CHECK_EVERY_S))
        while not exited.wait(every_s):
            engines = sorted(state.glob("*-server.log")) if state is not None else []
            for path in (log_path, *engines):
                try:
                    rotate_one(path, int(rotate["max_bytes"]), int(rotate["backups"]))
                except OSError as exc:  # a full disk, say: the log grows on, the child runs on
                    print(f"could not rotate {path}: {exc}", file=sys.stderr)

    def _run(
        self,
        args: list[str],
        env: dict[str, str],
        logf: IO[bytes],
        cwd: str | None,
        started: threading.Event,
    ) -> None:
        try:
            try:
                self.proc = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=logf,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                    preexec_fn=parent_death.preexec(signal.SIGKILL),
                )
            except OSError as exc:
                self.error = f"{args[0]}: {exc}"
                return
            finally:
                started.set()
            assert self.proc.stdout is not None
            for line in iter(self.proc.stdout.readline, b""):
                self.lines.append(line)
                if self.first is None:
                    self.first = line
                    self.has_first.set()
                else:  # what it prints after its address line goes to its log
                    logf.write(line)
                    logf.flush()
            self.has_first.set()
            self.rc = self.proc.wait()
        finally:
            logf.close()
            self.exited.set()

    def first_line(self, timeout_s: float) -> dict[str, Any]:
        if not self.has_first.wait(timeout_s):
            return {"timeout": True}
        if self.first is None:
            self.exited.wait()
            return {"eof": True, "returncode": self.rc, "error": self.error}
        return {"line": self.first.decode("utf-8", "replace")}

    def result(self) -> dict[str, Any]:
        self.exited.wait()
        out = b"".join(self.lines).decode("utf-8", "replace")
        return {"returncode": self.rc, "stdout": out, "error": self.error}

    def wait(self) -> int | None:
        self.exited.wait()
        return self.rc

    def signal(self, sig: int) -> None:
        """Signals the child's process group (it leads it: pgid == pid)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)


@functools.cache
def process_actor() -> Any:
    import ray

    return ray.remote(_Process)
