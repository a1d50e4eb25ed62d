"""`astra run`'s child processes (astra.run.children) and what they leave behind: a restart
SIGKILLs what is left of the group of the process before; a RaaS's engine server
(astra.engine.http.launch, a session of its own) goes when the RaaS dies; a dead child is seen
even while a descendant in a session of its own holds its stdout. `FakeChild` (a stand-in
child, driven per start by a plan) serves the supervisor tests of test_run_restarts and
test_run_elastic too."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from astra.run.children import Child

ROOT = Path(__file__).resolve().parent.parent

# One entry of FAKE_PLAN (a comma list) per start, counted in the file FAKE_COUNT:
#   serve            print an address line (127.0.0.1:FAKE_PORT) and sleep
#   die              exit 3 before printing an address
#   slow             sleep 1 s, then serve
#   engine           start an engine server (astra.engine.http.launch.ServerProcess, a session
#                    of its own) that sleeps, write its pid to FAKE_HELPER, then serve
#   samegroup        start a helper in the child's own process group (pid to FAKE_HELPER)
#   newsession_pipe  start a helper in a session of its own that inherits the child's stdout
#                    (as torchrun's ranks do), pid to FAKE_HELPER, then serve
FAKE_CHILD = """
import json, os, subprocess, sys, time
count_file = os.environ["FAKE_COUNT"]
n = int(open(count_file).read()) if os.path.exists(count_file) else 0
open(count_file, "w").write(str(n + 1))
plan = os.environ["FAKE_PLAN"].split(",")
action = plan[min(n, len(plan) - 1)]
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
if action == "die":
    sys.exit(3)
if action == "slow":
    time.sleep(1.0)
if action == "engine":
    from astra.engine.http.launch import ServerProcess
    p = ServerProcess(sleeper, "http://x", log_path=os.environ["FAKE_HELPER"] + ".log")
    open(os.environ["FAKE_HELPER"], "w").write(str(p.proc.pid))
if action in ("samegroup", "newsession_pipe"):
    out = None if action.endswith("_pipe") else subprocess.DEVNULL
    h = subprocess.Popen(sleeper, stdout=out, start_new_session=action.startswith("newsession"))
    open(os.environ["FAKE_HELPER"], "w").write(str(h.pid))
port = os.environ.get("FAKE_PORT", "41002")
print(json.dumps({"service": "fake", "address": f"127.0.0.1:{port}"}), flush=True)
while True:
    time.sleep(1)
"""


def fake_env(tmp_path: Path, name: str, plan: str, **extra: str) -> dict[str, str]:
    script = tmp_path / "fakechild.py"
    if not script.is_file():
        script.write_text(FAKE_CHILD)
    return {
        "FAKE_SCRIPT": str(script),
        "FAKE_PLAN": plan,
        "FAKE_COUNT": str(tmp_path / f"count-{name}"),
        "PYTHONPATH": str(ROOT),
        **extra,
    }


def fake_factory(tmp_path: Path, plans: dict[str, str], ports: dict[str, str] | None = None):
    """A supervisor's child factory: each child runs the fake child with the plan of its name
    (else of its role); `commands` lists the commands the supervisor gave (before the fake one
    replaced them), `spawned` every (name, process) started."""

    class FakeChild(Child):
        commands: list[tuple[str, list[str]]] = []
        spawned: list[tuple[str, asyncio.subprocess.Process]] = []

        async def spawn(self) -> None:
            FakeChild.commands.append((self.name, list(self.args)))
            plan = plans.get(self.name) or plans[self.role]
            port = (ports or {}).get(self.role, "41002")
            env = fake_env(tmp_path, self.name, plan, FAKE_PORT=port)
            self.args = [sys.executable, env["FAKE_SCRIPT"]]
            self.env = {**self.env, **env}
            await super().spawn()
            assert self.proc is not None
            FakeChild.spawned.append((self.name, self.proc))

    return FakeChild


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone while read
        return False


def gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def exec_done(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether `pid` runs the sleeper's own command line: past `setpriv --pdeathsig` (or the
    preexec prctl), so its parent-death signal is set. A parent killed before that moment
    leaves no signal to come, as in the kernel's own race, which this test is not about."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"setpriv" not in argv[0] and b"time.sleep(120)" in b" ".join(argv):
                return True
        time.sleep(0.01)
    return False


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def serving_child(tmp_path: Path, plan: str) -> AsyncIterator[tuple[Child, int]]:
    """A fake RaaS child following `plan`, serving, and the pid of the helper process it
    started (SIGKILLed at the end, whatever the test did)."""
    helper = tmp_path / "helper.pid"
    env = fake_env(tmp_path, "raas-0", plan, FAKE_HELPER=str(helper))
    child = Child(
        "raas-0", "raas", [sys.executable, env["FAKE_SCRIPT"]], tmp_path / "raas-0.log", env
    )
    await child.spawn()
    await child.read_address(30)
    pid = int(helper.read_text())
    try:
        yield child, pid
    finally:
        kill(pid)


def test_an_engine_server_goes_with_the_raas_that_started_it(tmp_path: Path) -> None:
    """The engine server has a session of its own (the RaaS's group does not reach it); its
    parent-death signal takes it down when the RaaS is SIGKILLed."""

    async def main() -> None:
        async with serving_child(tmp_path, "engine") as (child, engine):
            assert alive(engine) and os.getpgid(engine) == engine  # its own group
            assert exec_done(engine), "the engine server never ran its own command"
            await child.stop(0)  # SIGKILL at once: a second Ctrl-C, stop_grace_s ran out
            assert gone_within(engine, 5), f"engine server {engine} outlived its RaaS"

    asyncio.run(main())


def test_a_restart_kills_what_is_left_of_the_group_of_the_process_before(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with serving_child(tmp_path, "samegroup,serve") as (child, pid):
            assert os.getpgid(pid) == child.pid
            os.kill(child.pid, signal.SIGKILL)  # the leader crashes; its helper lives on
            await asyncio.wait_for(child.wait(), 10)
            assert alive(pid)
            await child.spawn()  # the restart (Supervisor.start_children -> spawn)
            assert gone_within(pid, 5), f"helper {pid} of the dead process outlived its restart"
            await child.read_address(30)
            await child.stop(1.0)

    asyncio.run(main())


@pytest.mark.slow
def test_a_dead_child_is_seen_while_a_descendant_of_its_own_session_holds_its_stdout(
    tmp_path: Path,
) -> None:
    """torchrun's ranks (sessions of their own) inherit the trainer's stdout: when torchrun is
    SIGKILLed, a wait begun before (the supervisor's watch) still returns, and stop does not
    hang."""

    async def main() -> None:
        async with serving_child(tmp_path, "newsession_pipe") as (child, worker):
            watch = asyncio.ensure_future(child.wait())  # what Supervisor._watch waits on
            await asyncio.sleep(0.2)
            os.kill(child.pid, signal.SIGKILL)
            assert await asyncio.wait_for(watch, 5) == -signal.SIGKILL
            assert alive(worker)  # not in the child's group: not the supervisor's to see
            assert await asyncio.wait_for(child.stop(5.0), 10) == -signal.SIGKILL
        await asyncio.sleep(0.3)  # the worker's pipe closes: the process's transport finishes

    asyncio.run(main())


@pytest.mark.slow
def test_a_stop_does_not_wait_out_its_grace_for_a_pipe_held_open(tmp_path: Path) -> None:
    async def main() -> None:
        async with serving_child(tmp_path, "newsession_pipe") as (child, _):
            started = time.monotonic()
            assert await asyncio.wait_for(child.stop(30.0), 20) == -signal.SIGTERM
            assert time.monotonic() - started < 10  # the drain of stdout waits 2 s at most
        await asyncio.sleep(0.3)  # the worker's pipe closes: the process's transport finishes

    asyncio.run(main())
