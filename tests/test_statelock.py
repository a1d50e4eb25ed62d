"""One owner per state directory (astra.statelock): a second owner is refused with the holder's
pid, in another process and through each service's own command; the kernel frees the lock
when the holder dies, even by SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from astra.statelock import StateLocked, acquire, holder, is_held
from tests.conftest import make_config

HOLD = """
import sys, time
from astra.statelock import acquire
acquire(sys.argv[1], "tester")
print("held", flush=True)
time.sleep(60)
"""


def _holder_process(directory: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_owner_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    proc = _holder_process(tmp_path / "state")
    try:
        assert is_held(tmp_path / "state")
        with pytest.raises(StateLocked) as info:
            acquire(tmp_path / "state", "Dataflow", wait_s=0.2)
        message = str(info.value)
        assert f"pid {proc.pid}" in message and str(tmp_path / "state") in message
        assert f"kill -TERM {proc.pid}" in message and "tester" in message
        assert holder(tmp_path / "state")["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait(10)


def test_the_lock_goes_with_its_holder_even_on_sigkill(tmp_path: Path) -> None:
    proc = _holder_process(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert not is_held(tmp_path)
    mine = acquire(tmp_path, "Dataflow", wait_s=0)
    assert holder(tmp_path)["role"] == "Dataflow"
    mine.release()
    assert not is_held(tmp_path)


def test_a_restart_waits_for_the_old_owner_to_go(tmp_path: Path) -> None:
    proc = _holder_process(tmp_path)
    start = time.monotonic()
    subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {proc.pid}"])
    acquire(tmp_path, "trainer", wait_s=10).release()
    assert time.monotonic() - start < 9
    proc.wait(10)


def _serve(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "astra.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, role",
    [
        (["serve", "dataflow", "--config", "df.yaml", "--port", "0"], "Dataflow"),
        (["serve", "weights", "--port", "0", "--store", "STATE"], "WeightService"),
        (
            ["serve", "trainer", "--policy", "p", "--port", "0", "--checkpoint-dir", "STATE"],
            "trainer",
        ),
    ],
)
def test_each_service_refuses_a_state_directory_in_use(
    tmp_path: Path, dataset: Path, args: list[str], role: str
) -> None:
    """The service's own start-up: exit 2 and one line naming the holder, before it serves."""
    state = tmp_path / "STATE"
    config = make_config(dataset, state).model_dump(mode="json")
    (tmp_path / "df.yaml").write_text(yaml.safe_dump(config))
    proc = _holder_process(state)
    try:
        second = _serve(args, tmp_path)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2, err[-2000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1, err[-2000:]
        assert f"pid {proc.pid}" in lines[0] and str(state) in lines[0] and role in lines[0]
    finally:
        proc.kill()
        proc.wait(10)
