"""A process tied to its parent (astra.parent_death) goes when the parent is SIGKILLed, even in a
session of its own; torchrun's trainer ranks are tied so (a SIGKILLed torchrun left them
running, holding their GPUs and ports)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import save_tiny_trainer_model, scripted_system, start_two_rank_trainer
from tests.test_run_children import alive, gone_within, kill

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl: Linux")

ROOT = Path(__file__).resolve().parents[1]


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


PARENT = """
import subprocess, sys, time
tied = sys.argv[1] == "tied"
code = ("import time\\n"
        + ("from astra.parent_death import die_with_parent\\ndie_with_parent()\\n" if tied else "")
        + "print('ready', flush=True)\\ntime.sleep(60)\\n")
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         start_new_session=True)
assert child.stdout.readline() == b"ready\\n"
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_process_goes_with_its_sigkilled_parent(tied: bool) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "tied" if tied else "free"],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait(10)
        assert gone_within(child, 10) is tied  # untied: orphaned, still running
    finally:
        parent.kill()
        if "child" in locals():
            kill(child)


CHILD_OF_PID1 = """
import os, subprocess, sys
code = ("import os\\nfrom astra.parent_death import die_with_parent\\n"
        "die_with_parent(parent=int(os.environ.get('EXPECT') or 0) or None)\\nprint('alive')\\n")
for expect in ("", "1"):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "EXPECT": expect})
    print(os.getpid(), repr(expect), out.returncode, out.stdout.strip())
"""


def test_a_child_of_pid_1_is_not_taken_for_an_orphan() -> None:
    """torchrun as a container's first process (pid 1): its ranks must not kill themselves."""
    try:
        proc = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", CHILD_OF_PID1],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    except FileNotFoundError:
        pytest.skip("no unshare")
    if proc.returncode != 0 and "Operation not permitted" in proc.stderr:
        pytest.skip("unshare --pid needs privileges here")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["1 '' 0 alive", "1 '1' 0 alive"], proc.stdout


@pytest.mark.slow
def test_torchrun_ranks_go_when_torchrun_is_sigkilled(tmp_path: Path, dataset: Path) -> None:
    model = save_tiny_trainer_model(tmp_path / "model")

    seen: dict[str, object] = {}

    async def body() -> None:
        async with scripted_system(tmp_path, dataset) as (df_server, _, weights):
            proc = await start_two_rank_trainer(
                df_server,
                weights,
                model,
                *("--num-steps", "0"),  # until stopped
                stderr=asyncio.subprocess.DEVNULL,
            )
            ranks: list[int] = []
            try:
                while True:  # rank 0's address line: both ranks are up
                    line = await asyncio.wait_for(proc.stdout.readline(), 60)
                    assert line, "torchrun ended before rank 0 served"
                    if line.startswith(b"{"):
                        break
                ranks = children_of(proc.pid)  # torchrun replaced the CLI process (exec)
                assert len(ranks) == 2 and all(alive(p) for p in ranks), ranks
                proc.kill()  # SIGKILL torchrun: it cannot stop its ranks
                seen["ranks"] = ranks
                # (not proc.wait(): it also waits for the stdout pipe, which live ranks hold)
                seen["gone"] = await asyncio.to_thread(
                    lambda: all(gone_within(p, 10) for p in ranks)
                )
            finally:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                for p in ranks:  # hygiene, after the verdict above
                    kill(p)
                await proc.wait()

    asyncio.run(asyncio.wait_for(body(), 100))
    assert seen["gone"], f"ranks {seen['ranks']} outlived a SIGKILLed torchrun"
