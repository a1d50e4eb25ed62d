"""Runs untrusted Python in a subprocess with time, memory, file-size and output limits.

Used by the `python` tool and the `code_tests` reward. The child is a fresh
`python -I` (isolated: no user site, no PYTHON* variables) in an empty
temporary directory with an empty environment, in its own session so a
timeout kills everything it started. A small launcher sets the rlimits in
the child itself (soft = hard, so the code cannot raise them) and then execs
the code: `preexec_fn` would do the same but is unsafe in a process with
threads, as an event loop with `to_thread` is. Unless `SandboxLimits.network`
allows it, the child runs in a network namespace of its own (`unshare --net`;
`--user --map-root-user` as well when not root), where no address, loopback
included, reaches anything outside: it cannot fetch answers or call the
services of the machine it runs on. Where this machine refuses namespaces
(`unshare` missing, user namespaces off) the code runs with the network and
a warning says so once; `SandboxResult.network_isolated` tells which. A sandbox
that could not start at all (the code never ran, as the launcher's one byte on a
pipe tells) raises `SandboxUnavailable` rather than passing for the code's own
failure. Unless `SandboxLimits.files` allows more, the code sees only its
working directory, a private /tmp, the Python it runs on and the system's
libraries, read-only (astra.rewards.sandbox_fs): not the dataset with its
answers, nor the service's code, nor other runs; `SandboxResult.files_isolated`
tells whether that held (where the machine refuses the namespaces, a warning
says so once). No /proc either. This is a set of namespaces and limits, not a
virtual machine: a kernel exploit would break out of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from astra.rewards.sandbox_forward import FORWARD
from astra.rewards.sandbox_fs import VIEW, launcher_args

# Builds the file system view where asked (astra.rewards.sandbox_fs), sets the limits, says the
# sandbox is ready (one byte on an inherited pipe, before the code can run, so the code can
# neither fake nor hide it), runs the code.
_LAUNCHER = (
    VIEW
    + FORWARD
    + """
import os, resource, sys
cpu, mem, fsize, ready = (int(a) for a in sys.argv[1:5])
if len(sys.argv) > 5:
    _view(sys.argv[5], sys.argv[6], int(sys.argv[7]), sys.argv[8].split(","), sys.argv[9:])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
argv = run = None
if os.path.exists("command.json"):
    import json
    with open("command.json") as f:
        argv = json.load(f)
    os.remove("command.json")
    if os.path.exists("forward.json"):  # the one endpoint it may reach (sandbox_forward)
        with open("forward.json") as f:
            port, path = json.load(f)
        os.remove("forward.json")
        run = _forward(port, path, argv)
os.write(ready, b"1")
os.close(ready)
if run is not None:
    code = run()
    sys.exit(code if code >= 0 else 128 - code)
if argv is not None:
    os.execvp(argv[0], argv)
os.execv(sys.executable, [sys.executable, "-I", "-B", "main.py"])
"""
)


class SandboxUnavailable(RuntimeError):
    """The sandbox itself could not start (the code never ran): not the code's failure, so a
    reward raises instead of scoring it (the sample is counted failed)."""


log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Bounds of one run: wall time, address space, bytes written per file, output returned,
    whether the code may use the network and see the machine's files (default: neither, where
    the machine allows)."""

    time_s: float = 5.0
    memory_bytes: int = 512 << 20
    file_bytes: int = 4 << 20
    output_chars: int = 16_384
    network: bool = False
    files: bool = False  # True: the machine's files are visible (default: only its own)
    # (port, Unix socket path): without the network, the one address a command may still
    # reach, 127.0.0.1:port inside its namespace, forwarded to that socket (sandbox_forward)
    endpoint: tuple[int, str] | None = None


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What a run produced: the start of stdout, the end of stderr (where the error is).

    `reason` is "ok", "exit N", "timeout", "memory", "output_limit",
    "cpu_limit" or "signal NAME".
    """

    stdout: str
    stderr: str
    returncode: int | None
    reason: str
    wall_s: float
    truncated: bool = False
    files: dict[str, str] = field(default_factory=dict)  # the `keep` files the code left
    network_isolated: bool = False  # ran in a network namespace of its own
    files_isolated: bool = False  # saw only its directory, Python and the system's libraries

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    keep: tuple[str, ...] = (),
) -> SandboxResult:
    """Runs `code` as a script under `limits`; blocks until it ends or is killed.

    `keep` names files of the working directory to return in `files` (at most
    `output_chars` of each).
    """
    limits = limits or SandboxLimits()
    return _run(code, stdin, limits, keep, *isolation(limits))


def run_command(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    stdin: str = "",
    limits: SandboxLimits | None = None,
) -> SandboxResult:
    """Runs a program (any language: `argv`, found on PATH) under `limits` with `env` added to
    the sandbox's environment (LANG, and PATH for the lookup); blocks until it ends or is
    killed. The same limits as `run_python`; a program that needs the machine's interpreters
    and its own files wants `files=True`; one that calls back into this machine (an agent on
    the RaaS's endpoint) names that endpoint (`endpoint`) and keeps the network cut, or asks
    for `network=True`."""
    limits = limits or SandboxLimits()
    if not argv:
        raise ValueError("argv is empty")
    extra = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})}
    return _run(None, stdin, limits, (), *isolation(limits), argv=argv, env=extra)


def _run(
    code: str | None,
    stdin: str,
    limits: SandboxLimits,
    keep: tuple[str, ...],
    prefix: tuple[str, ...],
    no_net: bool,
    own_files: bool,
    *,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> SandboxResult:
    """`run_python` (or `run_command`, given `argv`) under the given isolation."""
    with tempfile.TemporaryDirectory(prefix="astra-sandbox-") as tmp:
        root = Path(tmp) / "work"  # the code's directory; Path(tmp) / "view": its file system
        root.mkdir()
        if argv is not None:
            (root / "command.json").write_text(json.dumps(argv), encoding="utf-8")
            if limits.endpoint is not None and no_net:
                forward = json.dumps(list(limits.endpoint))
                (root / "forward.json").write_text(forward, encoding="utf-8")
        else:
            (root / "main.py").write_text(code or "", encoding="utf-8")
        (root / "stdin").write_text(stdin, encoding="utf-8")
        cpu_s = math.ceil(limits.time_s) + 1
        view = []
        if own_files:
            (Path(tmp) / "view").mkdir()
            view = launcher_args(Path(tmp) / "view", root, limits.file_bytes)
        start = time.monotonic()
        with (
            (root / "stdin").open("rb") as fin,
            (root / "stdout").open("wb") as fout,
            (root / "stderr").open("wb") as ferr,
        ):
            started_r, started_w = _pipe()
            argv = [*prefix, sys.executable, "-I", "-c", _LAUNCHER, str(cpu_s)]
            argv += [str(limits.memory_bytes), str(limits.file_bytes), str(started_w), *view]
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    cwd=root,
                    env={"LANG": "C.UTF-8", **(env or {})},
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=(started_w,),
                )
            except BaseException:
                os.close(started_r)
                raise
            finally:
                os.close(started_w)
            timed_out = False
            try:
                proc.wait(timeout=limits.time_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
            # Whatever the code left running in its session goes with it.
            _kill_group(proc.pid)
        wall_s = time.monotonic() - start
        with os.fdopen(started_r, "rb") as pipe:
            launched = pipe.read(1) == b"1"
        if not launched and not timed_out:
            detail = (root / "stderr").read_text(errors="replace").strip()[-300:]
            raise SandboxUnavailable(
                f"the sandbox did not start (exit {proc.returncode}): {detail}"
            )
        # Python ignores SIGXFSZ: a write past the limit fails (EFBIG) and the code exits.
        full = any((root / n).stat().st_size >= limits.file_bytes for n in ("stdout", "stderr"))
        stdout, cut_out = _read(root / "stdout", limits.output_chars)
        stderr, cut_err = _read(root / "stderr", limits.output_chars, tail=True)
        files = {
            name: _read(root / name, limits.output_chars)[0]
            for name in keep
            if "/" not in name and (root / name).is_file()
        }
    rc = proc.returncode
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        returncode=None if timed_out else rc,
        reason="timeout" if timed_out else "output_limit" if full and rc else _reason(rc, stderr),
        wall_s=wall_s,
        truncated=cut_out or cut_err,
        files=files,
        network_isolated=no_net,
        files_isolated=own_files,
    )


def isolation(limits: SandboxLimits) -> tuple[tuple[str, ...], bool, bool]:
    """(command prefix, network cut, files hidden) for a run under `limits`: a mount namespace
    with its own file system (and its own network unless allowed) where this machine allows
    it, else the network namespace alone, else nothing (each refusal warned of once)."""
    if not limits.files:
        prefix = own_files_prefix(network=limits.network)
        if prefix:
            return prefix, not limits.network, True
    prefix = () if limits.network else no_network_prefix()
    return prefix, bool(prefix), False


_NO_NETWORK = threading.Lock()


def no_network_prefix() -> tuple[str, ...]:
    """The command prefix that runs a program in a network namespace of its own, or () where
    this machine allows none (said once, as a warning)."""
    with _NO_NETWORK:  # worker threads call this: one probe, one warning
        return _probe_no_network()


def own_files_prefix(*, network: bool = False) -> tuple[str, ...]:
    """The prefix that runs the launcher in namespaces of its own (user, mount, and net unless
    `network`) where it builds the code's file system, or () where this machine refuses."""
    with _NO_NETWORK:
        return _probe_own_files(network)


@functools.cache
def _probe_own_files(network: bool) -> tuple[str, ...]:
    unshare = shutil.which("unshare")
    if unshare is None:
        log.warning(
            "sandbox: no `unshare` on this machine: sandboxed code sees the machine's files"
        )
        return ()
    # A user namespace even for root: its root has no power over the machine's mounts.
    prefix = (unshare, "--user", "--map-root-user", "--mount", *(() if network else ("--net",)))
    # Seen from inside: its own directory, not the view's mount point beside it.
    code = "import os\nprint(os.path.exists(os.path.join(os.getcwd(), '..', 'view')))\n"
    try:
        probe = _run(code, "", SandboxLimits(time_s=30), (), prefix, not network, True)
        if probe.ok and probe.stdout.split() == ["False"]:
            return prefix
        why = probe.stderr.strip() or probe.stdout.strip() or probe.reason
    except (OSError, SandboxUnavailable) as exc:
        why = str(exc)
    log.warning(
        "sandbox: cannot give sandboxed code a file system of its own (%s): it sees the "
        "machine's files",
        why[-300:],
    )
    return ()


@functools.cache
def _probe_no_network() -> tuple[str, ...]:
    unshare = shutil.which("unshare")
    if unshare is None:
        log.warning("sandbox: no `unshare` on this machine: sandboxed code can use the network")
        return ()
    # Root may lack CAP_SYS_ADMIN (a container): a user namespace of its own then does it.
    candidates: list[tuple[str, ...]] = [(unshare, "--user", "--map-root-user", "--net")]
    if os.geteuid() == 0:
        candidates.insert(0, (unshare, "--net"))
    errors = []
    for prefix in candidates:
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(f"{' '.join(prefix)}: {exc}")
            continue
        if probe.returncode == 0:
            return prefix
        errors.append(f"{' '.join(prefix)}: {probe.stderr.strip()[:200]}")
    log.warning(
        "sandbox: no network namespace (%s): sandboxed code can use the network", "; ".join(errors)
    )
    return ()


async def run_python_async(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    keep: tuple[str, ...] = (),
) -> SandboxResult:
    """`run_python` in a worker thread, so the event loop keeps serving."""
    return await asyncio.to_thread(run_python, code, stdin=stdin, limits=limits, keep=keep)


def _pipe() -> tuple[int, int]:
    """A pipe whose ends are 3 or above (close-on-exec), never on a standard stream a caller
    left closed: the child's stdin/stdout/stderr are put over 0-2."""
    r, w = os.pipe()
    try:
        high_r = fcntl.fcntl(r, fcntl.F_DUPFD_CLOEXEC, 3)
        try:
            return high_r, fcntl.fcntl(w, fcntl.F_DUPFD_CLOEXEC, 3)
        except BaseException:
            os.close(high_r)
            raise
    finally:
        os.close(r)
        os.close(w)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read(path: Path, limit: int, *, tail: bool = False) -> tuple[str, bool]:
    """At most `limit` characters of a file: its start, or its end when `tail`."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if tail:
            f.seek(max(0, size - 4 * limit - 4))
        data = f.read(4 * limit + 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) <= limit:
        return text, size > len(data)
    return (text[-limit:] if tail else text[:limit]), True


def _reason(returncode: int, stderr: str) -> str:
    if returncode == 0:
        return "ok"
    if "MemoryError" in stderr:
        return "memory"
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU:
            return "cpu_limit"
        return f"signal {signal.Signals(sig).name}"
    return f"exit {returncode}"
