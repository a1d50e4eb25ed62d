"""What a power loss cannot take back: fsync of files and directories, durable mkdir/replace.

A new name (a created file or directory, a rename) is durable only once the directory that
holds it is fsynced; a file's bytes only once the file is. These helpers do both, for the
files a run must find again after a power cut (the run directory's tree, run.json,
summary.json, the recipe, the dataset). Large stores keep their own writers (the
WeightService's astra.weights.records, checkpoints in astra.trainer.checkpoint, Dataflow's
SQLite) and use `fsync_path`/`fsync_dir` from here. Never touches a file it is not given.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path | str) -> None:
    """fsync of a file (its bytes) or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """Makes the directory's entries (names created, removed, renamed in it) durable."""
    fsync_path(path)


def make_dirs(path: Path | str, *, durable: bool = True) -> Path:
    """`mkdir -p`, each directory it creates made durable in its parent (unless not
    `durable`: scratch directories, tests)."""
    path = Path(path)
    if not durable:
        path.mkdir(parents=True, exist_ok=True)
        return path
    missing = []
    probe = path
    while not probe.is_dir():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        fsync_dir(directory.parent)
    return path


def replace_durably(tmp: Path, path: Path) -> None:
    """Renames the written `tmp` over `path`: its bytes fsynced first, the rename after."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_durably(path: Path, data: str | bytes) -> None:
    """Writes `path` whole by rename (readers see the old file or the new one), durably."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    replace_durably(tmp, path)
