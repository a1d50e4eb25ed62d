"""The test's side of the power-cut filesystem: start its daemon, cut the power, tear it down.

`PowerCutMount(path)` starts `python -m astra.testing.powercut.daemon path` and waits for it
to mount. `cut()` is the power going: every other process with a file, a working directory
or a mapping on the mount is SIGKILLed (and waited for) first, then the daemon replaces what
reads see by what was made durable and mounts afresh, so the next reader sees exactly what
survived, with no page cache of before. `close()` unmounts whatever happens (lazily, with
`umount -l` if the daemon is gone). Never reads or writes the files on the mount itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class PowerCutUnavailable(RuntimeError):
    """This machine cannot mount it: no /dev/fuse, or mount(2) not permitted."""


def unavailable_reason() -> str | None:
    """Why this machine cannot mount it (None: it can try): /dev/fuse cannot be opened."""
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"/dev/fuse cannot be opened here: {e}"
    return None


def _mounted(path: Path) -> bool:
    target = str(path.resolve())
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


class PowerCutMount:
    def __init__(self, path: Path, log: Path | None = None) -> None:
        self.path = Path(path).resolve()
        self.path.mkdir(parents=True, exist_ok=True)
        self.log = log or self.path.parent / (self.path.name + ".daemon.log")
        self.cuts = 0
        self.killed: list[int] = []
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "astra.testing.powercut.daemon", str(self.path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            )  # fmt: skip
        line = self._read()
        if line != "ready":
            self.close()
            raise PowerCutUnavailable(f"the power-cut filesystem did not mount: {line}")

    def _read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().decode().strip() or "(daemon exited)"

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def holders(self) -> set[int]:
        """Pids other than the daemon's with a file, cwd or mapping under the mount."""
        prefix, found = str(self.path), set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.proc.pid:
                continue
            base = f"/proc/{entry}"
            try:
                links = [os.readlink(f"{base}/cwd")]
                links += [os.readlink(f"{base}/fd/{fd}") for fd in os.listdir(f"{base}/fd")]
                with open(f"{base}/maps") as f:
                    links += [line.split(None, 5)[-1].strip() for line in f if "/" in line]
            except OSError:
                continue
            if any(link == prefix or link.startswith(prefix + "/") for link in links):
                found.add(int(entry))
        return found

    def cut(self, timeout: float = 30.0) -> str:
        """SIGKILL every process using the mount, wait for them to go, then cut the power.
        Returns the daemon's line (fsyncs seen, inodes left)."""
        holders = self.holders()
        if os.getpid() in holders:
            raise RuntimeError(f"the test process itself holds files open under {self.path}")
        deadline = time.monotonic() + timeout
        while holders:
            for pid in holders:
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.append(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {sorted(holders)} still use {self.path}")
            time.sleep(0.05)
            holders = self.holders()
        self._send("cut")
        line = self._read()
        if not line.startswith("cut"):
            raise RuntimeError(f"the power-cut daemon did not cut: {line}")
        self.cuts += 1
        return line

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                try:
                    self._send("stop")
                    self.proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            if _mounted(self.path):
                subprocess.run(["umount", "-l", str(self.path)], check=False)

    def __enter__(self) -> PowerCutMount:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
