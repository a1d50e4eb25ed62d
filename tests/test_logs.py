"""Log formats: JSON records parse and carry the fields; the run's observer reads both formats."""

from __future__ import annotations

import io
import json
import logging
import signal
import subprocess
import sys
import time

import pytest

from astra.logs import ENV, configure, log_format
from astra.run.observe import STEP_LINE


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_records_are_one_object_per_line(restore_root):
    out = io.StringIO()
    configure("info", "json", out)
    log = logging.getLogger("astra.test")
    log.info("hello %s", "world", extra={"policy": "p", "step": 3})
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")
    log.debug("not shown")
    first, second = (json.loads(x) for x in out.getvalue().splitlines())
    assert list(first)[:5] == ["ts", "level", "logger", "msg", "pid"]
    assert first["msg"] == "hello world" and first["level"] == "INFO"
    assert (first["policy"], first["step"]) == ("p", 3) and first["ts"].endswith("Z")
    assert second["level"] == "ERROR" and "ValueError: bad" in second["exc"]


def test_format_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "JSON")
    assert log_format() == "json"
    assert log_format("text") == "text"
    monkeypatch.setenv(ENV, "xml")
    with pytest.raises(ValueError, match="xml"):
        log_format()


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("skipped", ["", "NON_FINITE_LOSS"])
def test_the_observer_reads_trainer_step_lines_in_both_formats(restore_root, fmt, skipped):
    out = io.StringIO()
    configure("info", fmt, out)
    loss = "nan" if skipped else "0.125"
    logging.getLogger("astra.servers.trainer").info(
        "step %d version %d loss %s %s", 7, 8, loss, skipped
    )
    m = STEP_LINE.search(out.getvalue().encode())
    assert m is not None
    assert m.groups() == (b"7", b"8", loss.encode(), skipped.encode(), None)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
def test_sigusr1_writes_every_threads_stack_and_the_process_goes_on(tmp_path):
    """`kill -USR1`: the stacks of a process that does not stop, in its log, and it lives on."""
    code = (
        "import sys, threading, time\n"
        "from astra.logs import configure\n"
        "configure('info')\n"
        "def parked_in_a_thread(): time.sleep(60)\n"
        "threading.Thread(target=parked_in_a_thread, daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "print('alive', flush=True)\n"
    )
    err = (tmp_path / "err").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while "parked_in_a_thread" not in (tmp_path / "err").read_text():
            assert time.monotonic() < deadline, (tmp_path / "err").read_text()
            time.sleep(0.05)
        out, _ = proc.communicate("go\n", timeout=20)
        assert out == "alive\n" and proc.returncode == 0
    finally:
        proc.kill()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
def test_the_supervisor_outlives_sigusr1_and_writes_its_stacks(tmp_path):
    """`kill -USR1` on `astra run` itself: its stacks, not SIGUSR1's default (the end)."""
    code = (
        "import os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from astra.run.cli import _logging\n"
        "from astra.run.recipe import SupervisionSpec\n"
        f"_logging('info', Path({str(tmp_path / 'supervisor.log')!r}), SupervisionSpec())\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.2)\n"
        "print('alive', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "alive\n", proc.stderr[-2000:]
    assert "most recent call first" in proc.stderr
