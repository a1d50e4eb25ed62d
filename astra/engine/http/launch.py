"""`ServerProcess`: launches an engine server as a child process and waits until it answers.

Used by the vLLM and SGLang adapters' `launch` constructors (through
`start_server`, which builds the `python -m MODULE ... --host H --port P`
command line they share). The child runs in
its own process group with its output in a log file (never a pipe that could
fill); `wait_ready` polls a health path with a deadline and fails fast, with
the log's tail, when the child exits; `stop` sends SIGTERM to the group, then
SIGKILL after a grace period. Nothing here knows a particular engine.

Its own session puts the server outside the process group of the process that
starts it (a RaaS under `astra run`), so a stop of that group does not reach it.
On Linux it gets SIGTERM when the thread that started it goes (PR_SET_PDEATHSIG:
the RaaS died, however it died; start it from a thread that lives as long as the
server should, e.g. the event loop's): SIGTERM, not SIGKILL, so that the server
stops its own worker processes. Not covered: a server that ignores SIGTERM, and
platforms without prctl (the server then outlives a RaaS that could not stop it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from astra import parent_death
from astra.engine.http.client import JSONClient
from astra.errors import AstraError, Unavailable

_ERROR = re.compile(r"\b([A-Za-z_][\w.]*(Error|Exception|Exit)): ")


def error_line(log_text: str, limit: int = 400) -> str:
    """The server's own last error in `log_text` (`SomethingError: ...`, prefixes such as
    `(EngineCore pid=1) ERROR ... [file.py:12]` cut off, with the indented line after it
    when the error goes on there, as pydantic's do), else its last line; at most `limit`
    characters."""
    lines = log_text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = _ERROR.search(lines[i])
        if match:
            found = lines[i][match.start() :].strip()
            after = lines[i + 1] if i + 1 < len(lines) else ""
            if after[:1].isspace() and after.strip():
                found += " " + after.strip()
            return found[:limit]
    rest = [line.strip() for line in lines if line.strip()]
    return rest[-1][:limit] if rest else "(its log is empty)"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (another process may still take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_server(
    python: str,
    module: str,
    model_args: Sequence[str],
    *,
    host: str,
    port: int | None,
    extra_args: Sequence[str],
    log_path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """Starts `python -m module *model_args --host H --port P *extra_args` (a free
    port when `port` is None or 0), ready when `GET /health` answers."""
    port = port or free_port(host)
    argv = [python, "-m", module, *model_args, "--host", host, "--port", str(port), *extra_args]
    return ServerProcess(
        argv, f"http://{host}:{port}", log_path=log_path, env=env, health_path="/health"
    )


class ServerProcess:
    """One child engine server; `url` is where it listens."""

    def __init__(
        self,
        argv: Sequence[str],
        url: str,
        *,
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        health_path: str = "/health",
    ) -> None:
        self.argv = list(argv)
        self.url = url
        self.health_path = health_path
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        prefix, preexec = parent_death.spawn_args(signal.SIGTERM)  # it goes with its starter
        self.proc = subprocess.Popen(
            [*prefix, *self.argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=preexec,
        )

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Returns once `health_path` answers 2xx; raises Unavailable on exit or deadline."""
        client = JSONClient(self.url, timeout_s=10.0, connect_timeout_s=2.0, max_concurrency=2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise Unavailable(
                        f"engine server exited with {code} before it was ready: "
                        f"{error_line(self.log_tail(20000))} (its log: {self.log_path})",
                        reason="ENGINE_EXITED",
                        metadata={"log": str(self.log_path), "argv": " ".join(self.argv)},
                    )
                with contextlib.suppress(AstraError):
                    await client.request("GET", self.health_path, expect_json=False)
                    return
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"engine server not ready after {timeout_s:g} s: "
                        f"{error_line(self.log_tail(20000))} (its log: {self.log_path})",
                        reason="ENGINE_TIMEOUT",
                        metadata={"log": str(self.log_path), "argv": " ".join(self.argv)},
                    )
                await asyncio.sleep(1.0)
        finally:
            await client.close()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the child's process group, SIGKILL to what is left of it after
        `grace_s`; idempotent. The whole group, not just the child: vLLM's engine core and
        workers outlive a server that died first (SIGKILL, a crash) and would hold their
        memory and cores forever (seen: 1.7 GB a worker)."""
        _signal_group(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (
            self.proc.poll() is None or _group_alive(self.proc.pid)
        ):
            time.sleep(0.1)
        _signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether any process is left in the group `pgid` (the child's own session)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
