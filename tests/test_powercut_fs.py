"""The power-cut filesystem (astra.testing.powercut): what a cut keeps is what was fsynced.

Each test mounts a fresh one over /dev/fuse in its tmp dir (skipped, with the reason, where
/dev/fuse cannot be opened or mount(2) is refused) and unmounts it whatever happens.
"""

from __future__ import annotations

import mmap
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from astra.testing.powercut import PowerCutMount, PowerCutUnavailable
from astra.testing.powercut.control import _mounted, unavailable_reason


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[PowerCutMount]:
    if reason := unavailable_reason():
        pytest.skip(reason)
    try:
        mount = PowerCutMount(tmp_path / "mnt")
    except PowerCutUnavailable as e:
        pytest.skip(f"mount(2) of fuse is not permitted here: {e}")
    try:
        yield mount
    finally:
        mount.close()
        assert not _mounted(mount.path)


def _write(path: Path, data: bytes, *, sync: bool) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_write_not_fsynced_is_gone_and_an_fsynced_one_stays(fs: PowerCutMount) -> None:
    root = fs.path
    _write(root / "kept", b"kept", sync=True)
    _write(root / "dataless", b"never fsynced", sync=False)
    _sync_dir(root)
    with open(root / "kept", "ab") as f:
        f.write(b" and more, not fsynced")
    assert (root / "kept").read_bytes() == b"kept and more, not fsynced"
    fs.cut()
    assert (root / "kept").read_bytes() == b"kept"
    assert (root / "dataless").read_bytes() == b""  # its name was durable, its bytes never


def test_a_new_file_is_gone_unless_its_directory_is_fsynced(fs: PowerCutMount) -> None:
    root = fs.path
    os.mkdir(root / "d")
    _sync_dir(root)
    _write(root / "d" / "orphan", b"data fsynced, name not", sync=True)
    fs.cut()
    assert os.listdir(root) == ["d"]
    assert os.listdir(root / "d") == []


def test_a_rename_is_undone_without_a_directory_fsync_and_kept_with_one(
    fs: PowerCutMount,
) -> None:
    root = fs.path
    _write(root / "final", b"old", sync=True)
    _sync_dir(root)
    _write(root / "tmp1", b"new1", sync=True)
    os.replace(root / "tmp1", root / "final")
    assert (root / "final").read_bytes() == b"new1"
    fs.cut()
    assert sorted(os.listdir(root)) == ["final"]
    assert (root / "final").read_bytes() == b"old"

    _write(root / "tmp2", b"new2", sync=True)
    os.replace(root / "tmp2", root / "final")
    _sync_dir(root)
    fs.cut()
    assert sorted(os.listdir(root)) == ["final"]
    assert (root / "final").read_bytes() == b"new2"


@pytest.mark.parametrize(
    ("journal", "sync", "kept"),
    [
        ("WAL", "FULL", 20),  # Dataflow's mode: every FULL commit survives
        ("DELETE", "EXTRA", 20),
        # a DELETE-mode commit is the journal's unlink, which FULL never makes durable: after a
        # cut the hot journal is back and rolls the last commit back (SQLite documents this;
        # EXTRA fsyncs the directory after the unlink)
        ("DELETE", "FULL", 19),
    ],
)
def test_a_sqlite_database_keeps_its_full_commits(
    fs: PowerCutMount, journal: str, sync: str, kept: int
) -> None:
    db = fs.path / "state.db"
    code = f"""
import sqlite3, sys, time
con = sqlite3.connect({str(db)!r}, isolation_level=None)
con.execute("PRAGMA journal_mode={journal}")
con.execute("PRAGMA synchronous={sync}")
con.execute("CREATE TABLE t (i INTEGER)")
for i in range(20):
    con.execute("INSERT INTO t VALUES (?)", (i,))
con.execute("PRAGMA synchronous=OFF")
con.execute("BEGIN")
con.execute("INSERT INTO t VALUES (999)")
con.execute("COMMIT")
print("committed", flush=True)
time.sleep(600)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"committed"
        fs.cut()  # SIGKILLs the writer, which still holds the database open
        assert proc.wait(timeout=10) == -9
    finally:
        proc.kill()
        proc.wait()
    con = sqlite3.connect(db)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        rows = [r[0] for r in con.execute("SELECT i FROM t ORDER BY i")]
    finally:
        con.close()
    # the synchronous=OFF commit (999) was never fsynced: it is gone in every mode
    assert rows == list(range(kept))


def test_read_only_mmap_sees_the_bytes_and_the_cut_drops_the_page_cache(
    fs: PowerCutMount,
) -> None:
    path = fs.path / "weights.bin"
    _write(path, b"A" * 10000, sync=True)
    _sync_dir(fs.path)
    with open(path, "r+b") as f:
        f.write(b"B" * 10000)  # not fsynced
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m[:3] == b"BBB" and len(m) == 10000
    fs.cut()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m[:] == b"A" * 10000


def test_directories_links_truncation_and_listing(fs: PowerCutMount) -> None:
    root = fs.path
    os.makedirs(root / "a" / "b")
    _write(root / "a" / "b" / "f", b"0123456789", sync=True)
    os.truncate(root / "a" / "b" / "f", 4)
    os.link(root / "a" / "b" / "f", root / "a" / "g")
    assert os.stat(root / "a" / "g").st_nlink == 2
    assert sorted(os.listdir(root / "a")) == ["b", "g"]
    with pytest.raises(OSError):
        os.rmdir(root / "a")
    os.unlink(root / "a" / "g")
    os.symlink("b/f", root / "a" / "s")
    assert os.readlink(root / "a" / "s") == "b/f" and (root / "a" / "s").read_bytes() == b"0123"
    for d in (root, root / "a", root / "a" / "b"):
        _sync_dir(d)
    fd = os.open(root / "a" / "b" / "f", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    os.rename(root / "a" / "b" / "f", root / "moved")
    fs.cut()
    assert (root / "a" / "b" / "f").read_bytes() == b"0123"
    assert not (root / "moved").exists() and not (root / "a" / "g").exists()
    assert os.readlink(root / "a" / "s") == "b/f"
    assert os.statvfs(root).f_bavail > 0
