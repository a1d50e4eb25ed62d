"""Processes of the benchmarks: started, found by their address line, stopped, measured."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Proc:
    """A child process that prints one JSON line with its address on stdout when ready."""

    def __init__(self, args: list[str], log: Path, *, env=None, wait: bool = True):
        self.args = args
        self.log = log
        self._log = log.open("ab")
        self.popen = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.info: dict = {}
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = 90.0) -> dict:
        deadline = time.monotonic() + timeout_s
        out = self.popen.stdout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], 0.2)
            if ready:
                line = out.readline()
                if line:
                    self.info = json.loads(line)
                    return self.info
            if self.popen.poll() is not None:
                break
        self.terminate(kill=True)
        self.join()
        raise RuntimeError(f"{self.args[1:4]} did not start:\n{self.log.read_text()[-3000:]}")

    def terminate(self, *, kill: bool = False) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL if kill else signal.SIGTERM)

    def join(self, timeout_s: float = 15.0) -> None:
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)
        if not self._log.closed:
            self._log.close()
        if self.popen.stdout:
            self.popen.stdout.close()


def stop_all(procs: list[Proc]) -> None:
    """SIGTERM to all, then wait for each (SIGKILL after 15 s)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (all its threads), in seconds; nan once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(rest[11]) + int(rest[12])) / CLK_TCK
