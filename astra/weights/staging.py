"""Makes a directory appear whole or not at all: write into a sibling, then rename.

A version directory is built in a hidden staging directory next to its
target and renamed into place only after everything in it is written (and,
when durable, fsynced); any failure removes the staging directory. Knows
nothing of what the directory holds.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from astra.durable import fsync_path, make_dirs
from astra.errors import FailedPrecondition


def require_absent(out_dir: str | os.PathLike[str]) -> Path:
    """The target path, refused (FAILED_PRECONDITION) if anything is there: versions are immutable."""
    target = Path(out_dir)
    if target.exists():
        raise FailedPrecondition(
            f"{target} already exists", reason="OUTPUT_EXISTS", metadata={"path": str(target)}
        )
    return target


@contextmanager
def staged_dir(out_dir: str | os.PathLike[str], *, durable: bool = True) -> Iterator[Path]:
    """Yields an empty sibling staging directory and renames it to out_dir on success.

    On any exception the staging directory is removed and out_dir never
    appears. With `durable`, files and directories are fsynced before and after
    the rename, so a crash leaves either nothing or the whole directory.
    """
    target = require_absent(out_dir)
    make_dirs(target.parent)  # each new directory durable in its parent
    staging = target.parent / f".{target.name}.staging-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        yield staging
        if durable:
            for child in staging.iterdir():
                fsync_path(child)
            fsync_path(staging)
        if target.exists():
            raise FailedPrecondition(
                f"{target} appeared meanwhile",
                reason="OUTPUT_EXISTS",
                metadata={"path": str(target)},
            )
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if durable:
        fsync_path(target.parent)
