"""Real service processes for end-to-end and fault tests."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from astra.dataflow.config import DataflowConfig


class Proc:
    """A service process that printed its address as one JSON line on stdout."""

    def __init__(self, args: list[str], *, log: Path, env: dict | None = None, timeout_s=20.0):
        self.log = log
        self._log_file = log.open("ab")
        self.popen = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.info = self._read_info(timeout_s)
        self.address: str = self.info["address"]

    def _read_info(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        out = self.popen.stdout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], 0.2)
            if ready:
                line = out.readline()
                if line:
                    return json.loads(line)
            if self.popen.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"process did not start: {self.log.read_text()[-3000:]}")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait(10)

    def wait(self, timeout_s: float) -> int:
        return self.popen.wait(timeout_s)

    def close(self) -> None:
        if self.popen.poll() is None:
            self.kill()
        self._log_file.close()
        if self.popen.stdout:
            self.popen.stdout.close()


def start_dataflow(config: DataflowConfig, tmp: Path, name: str = "dataflow") -> Proc:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    args = [sys.executable, "-m", "astra.cli", "serve", "dataflow", "--config", str(path)]
    return Proc(args, log=tmp / f"{name}.log")


def start_scripted_raas(dataflow: str, tmp: Path, name: str, *extra: str) -> Proc:
    args = [
        sys.executable,
        "-m",
        "astra.testing.scripted_raas",
        "--dataflow",
        dataflow,
        "--port",
        "0",
        "--instance-id",
        name,
        *extra,
    ]
    return Proc(args, log=tmp / f"{name}.log")


@contextlib.contextmanager
def held(pgid: int | None) -> Iterator[None]:
    """The process group `pgid` stopped (SIGSTOP) for the block, then continued, whatever the
    block raised; None holds nothing. A test holds a run's trainer so that the run cannot end
    before something it waits for (a restart) has happened."""
    if pgid is not None:
        os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        if pgid is not None:
            os.killpg(pgid, signal.SIGCONT)
