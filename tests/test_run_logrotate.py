"""Logs kept to a size (astra.run.logrotate) while a real process appends to them.

A writer that holds its log open for appending, as every child does, goes on writing through
rotations: each copy holds whole lines (its last may be cut short by a write in progress as the
copy ends, whose rest goes with the truncation), none is written twice, nothing but the instant between
the last copy and the truncation is lost, and the file never fills with the zeros a writer
at its old offset would leave. The reader called before each truncation sees the whole file.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

from astra.run.logrotate import backup, keep_logs_small, missed_before_truncation, rotate

WRITER = r"""
import sys, time
n = 0
while True:
    sys.stderr.write(f"line {n:08d} " + "x" * 80 + "\n")
    sys.stderr.flush()
    n += 1
    if n % 50 == 0:
        time.sleep(0.005)
"""


def numbers(path: Path) -> list[int]:
    data = path.read_bytes()
    assert b"\0" not in data, f"{path}: zeros, written at an offset past the truncation"
    lines = data.decode().splitlines()
    if lines and not data.endswith(b"\n"):
        # A write in progress when the copy ended shows only its start (a read is not atomic
        # with a write); its rest went with the truncation: the instant the docstring loses.
        tail = lines.pop()
        assert re.fullmatch(r"l|li|lin|line|line \d{1,8}|line \d{8} x{0,79}", tail), tail
    for line in lines:
        assert line.startswith("line ") and len(line) == 94, f"{path}: a torn line {line!r}"
    return [int(line.split()[1]) for line in lines]


def start_writer(log: Path) -> subprocess.Popen:
    out = log.open("ab")  # what astra.run.children opens for a child
    try:
        return subprocess.Popen([sys.executable, "-c", WRITER], stderr=out)
    finally:
        out.close()


def test_rotations_under_an_appending_writer_keep_whole_lines_in_order(tmp_path: Path) -> None:
    log = tmp_path / "raas-0.log"
    proc = start_writer(log)
    seen_before: list[int] = []
    try:
        rotations = 0
        deadline = time.monotonic() + 30
        while rotations < 6 and time.monotonic() < deadline:
            time.sleep(0.05)

            def reader(path: Path) -> None:
                seen_before.append(path.stat().st_size)

            if rotate(log, 64 << 10, 2, reader):
                rotations += 1
                newest = numbers(backup(log, 1))
                assert newest == list(range(newest[0], newest[-1] + 1))  # no gap inside a copy
        assert rotations == 6
    finally:
        proc.kill()
        proc.wait(10)
    assert len(seen_before) == 6 and all(size > 64 << 10 for size in seen_before)
    assert not backup(log, 3).exists()  # two kept
    older, newer, current = numbers(backup(log, 2)), numbers(backup(log, 1)), numbers(log)
    assert older[-1] < newer[0] and (not current or newer[-1] < current[0])
    lost = newer[0] - older[-1] - 1 + (current[0] - newer[-1] - 1 if current else 0)
    assert lost <= 20, lost  # only what came in the instant of a truncation


def test_no_backups_empties_the_log_and_small_logs_are_left_alone(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_bytes(b"a\n" * 100)
    assert not rotate(log, 1000, 3)
    assert rotate(log, 100, 0)
    assert log.read_bytes() == b"" and not backup(log, 1).exists()
    assert not rotate(tmp_path / "missing.log", 0, 3)


def test_keep_logs_small_rotates_what_passed_the_size_and_goes_on_after_an_error(
    tmp_path: Path,
) -> None:
    big, small = tmp_path / "a.log", tmp_path / "b.log"
    big.write_bytes(b"x\n" * 5000)
    small.write_bytes(b"y\n")
    calls: list[Path] = []

    async def main() -> None:
        task = asyncio.create_task(
            keep_logs_small(
                lambda: [tmp_path / "gone" / "c.log", big, small],
                1000,
                1,
                calls.append,
                every_s=0.05,
            )
        )
        await asyncio.sleep(0.3)
        task.cancel()

    asyncio.run(main())
    assert calls == [big]
    assert big.read_bytes() == b"" and backup(big, 1).read_bytes() == b"x\n" * 5000
    assert small.read_bytes() == b"y\n" and not backup(small, 1).exists()


def test_a_reader_finds_what_it_missed_in_the_copy_of_its_generation(tmp_path: Path) -> None:
    """A reader that was not called before the truncation (the log rotated on another node,
    by a Ray actor) reads the rest from the copy of the file it was reading (its first bytes
    match), then every newer copy, oldest first; nothing when that copy is gone."""
    log = tmp_path / "trainer.log"
    log.write_bytes(b"first line\nsecond\nthird line\n")
    head, offset = log.read_bytes()[:256], len(b"first line\n")
    assert rotate(log, 10, 2)
    log.write_bytes(b"new generation\n")
    assert missed_before_truncation(log, offset, head) == b"second\nthird line\n"
    # Caught between the truncation and the rename: the copy still under its temporary name.
    backup(log, 1).rename(tmp_path / ".trainer.log.rotating")
    assert missed_before_truncation(log, offset, head) == b"second\nthird line\n"
    (tmp_path / ".trainer.log.rotating").rename(backup(log, 1))
    # Rotated again since: its copy is now the second, and the newer one follows it.
    assert rotate(log, 10, 2)
    assert missed_before_truncation(log, offset, head) == b"second\nthird line\nnew generation\n"
    # And again, with two copies kept: the reader's is dropped, what it missed is lost.
    log.write_bytes(b"another one\n")
    assert rotate(log, 10, 2)
    assert missed_before_truncation(log, offset, head) is None
    assert missed_before_truncation(log, offset, b"") is None  # nothing known of the file
    assert missed_before_truncation(tmp_path / "other.log", 0, head) is None
    # Read up to the end before the truncation: the copy is found, nothing was missed.
    log.write_bytes(b"third generation\n")
    head3 = log.read_bytes()
    assert rotate(log, 10, 2)
    assert missed_before_truncation(log, len(head3), head3) == b""


def test_a_ray_actor_keeps_its_childs_logs_small_on_its_node(tmp_path: Path) -> None:
    """astra.run.ray_actor's process, without Ray: given `rotate`, the log the child writes
    (and an engine server's log in its state directory) is rotated while it runs."""
    from astra.run.ray_actor import _Process

    state = tmp_path / "state"
    state.mkdir()
    engine = state / "vllm-server.log"
    engine.write_bytes(b"engine\n" * 8000)
    log = tmp_path / "raas-0.log"
    proc = _Process()
    rotate_spec = {"max_bytes": 32 << 10, "backups": 2, "state_dir": str(state), "every_s": 0.05}
    started = proc.start(
        [sys.executable, "-c", WRITER], {}, str(log), str(tmp_path), True, rotate_spec
    )
    assert "pid" in started, started
    try:
        deadline = time.monotonic() + 30
        while not backup(log, 2).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.signal(9)
        proc.wait()
        if proc.rotating is not None:  # a rotation under way ends before the copies are read
            proc.rotating.join(10)
    older, newer = numbers(backup(log, 2)), numbers(backup(log, 1))
    assert older[-1] < newer[0] and newer == list(range(newer[0], newer[-1] + 1))
    assert backup(engine, 1).read_bytes() == b"engine\n" * 8000 and engine.read_bytes() == b""
