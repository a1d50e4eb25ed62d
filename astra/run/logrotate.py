"""Child logs kept to a size over a run of weeks: copied aside, then truncated in place.

A child writes its log through a file descriptor the supervisor opened for it with O_APPEND
(astra.run.children), and so do its own helpers (an engine server, torchrun's ranks). Renaming
the file would leave them writing to the renamed one, so a log that passed
`supervision.max_log_bytes` is copied to ``<name>.log.1`` (older copies shift to ``.2`` ... up to
`supervision.log_backups`, the oldest dropped) and then truncated to nothing: with O_APPEND
each writer's next line lands at the new end, the start of the file. This is logrotate's
"copytruncate". Lines written in the instant between the last copy and the truncation are
lost; what was written while the bulk was copied is copied after it. A reader that follows the
log (the observer, for the trainers' step lines) is called just before the truncation and
starts again from the top after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)
CHECK_EVERY_S = 2.0  # how often the logs' sizes are looked at (a stat each)
HEAD_BYTES = 256  # what tells one generation of a log from another: its first bytes


def backup(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def _copy_rest(src: int, dst: int, offset: int) -> int:
    """Copies `src` from `offset` to its current end into `dst`; returns the new offset."""
    while True:
        sent = os.sendfile(dst, src, offset, 1 << 24)
        if sent == 0:
            return offset
        offset += sent


def _bulk(path: Path, tmp: Path) -> int:
    """Copies `path` as it is now into `tmp`; returns how much (the slow part, on a thread)."""
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        return _copy_rest(src.fileno(), dst.fileno(), 0)


def _finish(
    path: Path,
    tmp: Path | None,
    offset: int,
    backups: int,
    before_truncate: Callable[[Path], None] | None,
) -> None:
    """Copies what came after `offset` into `tmp`, truncates `path`, shifts the backups."""
    with open(path, "rb") as src:
        if before_truncate is not None:
            before_truncate(path)
        if tmp is not None:
            with open(tmp, "r+b") as dst:  # not "ab": sendfile refuses an O_APPEND target
                dst.seek(0, os.SEEK_END)
                _copy_rest(src.fileno(), dst.fileno(), offset)
        os.truncate(path, 0)
    if tmp is not None:
        for n in range(backups - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(backup(path, n), backup(path, n + 1))
        os.replace(tmp, backup(path, 1))


def _copies(path: Path) -> list[Path]:
    """The copies of `path` there are now, newest first: the one being made (under its
    temporary name, maybe absent), then ``.1``, ``.2`` ..."""
    copies = [path.with_name(f".{path.name}.rotating")]
    while backup(path, len(copies)).exists():
        copies.append(backup(path, len(copies)))
    return copies


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def copy_ids(path: Path) -> frozenset[tuple[int, int]]:
    """(device, inode) of each copy of `path` there is now: what a writer's start notes, so a
    reader can tell the copies made since (a copy keeps its inode as it shifts to ``.2``)."""
    return frozenset(i for i in map(_file_id, _copies(path)) if i is not None)


def missed_since_start(
    path: Path, offset: int, known: frozenset[tuple[int, int]]
) -> tuple[bytes, bytes] | None:
    """What a reader's first look at `path` finds rotated away since its writer started (at
    `offset`, with the copies `known` there were then): the oldest copy made since from
    `offset` on, then the newer ones whole, oldest first; and the first bytes of the newest of
    them (the generation the file now follows). (b"", b"") when none was made; None while one
    is being made (look again)."""
    copies = _copies(path)
    tmp_id = _file_id(copies[0])
    if tmp_id is not None and tmp_id not in known:
        return None
    new = [c for c in copies[1:] if (i := _file_id(c)) is not None and i not in known]
    if not new:
        return b"", b""
    try:
        whole = [copy.read_bytes() for copy in reversed(new)]  # oldest first
    except FileNotFoundError:  # shifted out meanwhile: look again
        return None
    return whole[0][offset:] + b"".join(whole[1:]), whole[-1][:HEAD_BYTES]


def missed_before_truncation(path: Path, offset: int, head: bytes) -> bytes | None:
    """What a reader that had read `path` up to `offset` before it was truncated did not
    read: the rest of the copy of the file it was reading (the copy that starts with `head`,
    the file's first bytes as the reader saw them, and reaches `offset`), then every newer
    copy whole, oldest first (rotated more than once since it read). The copy may still be
    under its temporary name, in the instant after the truncation. None when no copy is that
    file's (none kept, or it was dropped): what came after `offset` is lost."""
    if not head:
        return None
    copies = _copies(path)
    for k, copy in enumerate(copies):
        rest = _rest(copy, offset, head)
        if rest is None:
            continue
        newer = reversed(copies[1:k]) if k else ()  # .k-1 ... .1, all after ours
        parts = [rest]
        for later in newer:
            try:
                parts.append(later.read_bytes())
            except FileNotFoundError:  # rotated again meanwhile: what it held is lost
                return None
        return b"".join(parts)
    return None


def missed_after(path: Path, head: bytes) -> bytes | None:
    """Every copy of a generation that came after the one starting with `head`, whole, oldest
    first: what a reader that saw `path` empty after that generation did not see, when the
    file was written and rotated since. b"" when no such copy exists yet (the file now is the
    one the reader saw empty); None when the copy of `head`'s generation is gone."""
    copies = _copies(path)
    for k, copy in enumerate(copies):
        try:
            with open(copy, "rb") as f:
                if os.pread(f.fileno(), len(head), 0) != head:
                    continue
        except FileNotFoundError:
            continue
        parts = []
        for later in reversed(copies[1:k]) if k else ():
            try:
                parts.append(later.read_bytes())
            except FileNotFoundError:
                return None
        return b"".join(parts)
    return None


def _rest(copy: Path, offset: int, head: bytes) -> bytes | None:
    """`copy` from `offset` on, where it starts with `head` and reaches `offset`."""
    try:
        with open(copy, "rb") as f:
            if os.pread(f.fileno(), len(head), 0) != head or f.seek(0, os.SEEK_END) < offset:
                return None
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return None


def _due(path: Path, max_bytes: int) -> bool:
    try:
        return path.stat().st_size > max_bytes
    except FileNotFoundError:
        return False


def _tmp(path: Path, backups: int) -> Path | None:
    return path.with_name(f".{path.name}.rotating") if backups > 0 else None


def rotate(
    path: Path,
    max_bytes: int,
    backups: int,
    before_truncate: Callable[[Path], None] | None = None,
) -> bool:
    """Rotates `path` when it holds more than `max_bytes`; returns whether it did. With
    `backups` 0 the log is truncated without a copy."""
    if not _due(path, max_bytes):
        return False
    tmp = _tmp(path, backups)
    offset = _bulk(path, tmp) if tmp is not None else 0
    _finish(path, tmp, offset, backups, before_truncate)
    return True


async def keep_logs_small(
    logs: Callable[[], Iterable[Path]],
    max_bytes: int,
    backups: int,
    before_truncate: Callable[[Path], None] | None = None,
    every_s: float = CHECK_EVERY_S,
) -> None:
    """Until cancelled: every `every_s`, rotates each of `logs()` that passed `max_bytes`. The
    bulk copy runs on a thread; the rest (the reader's call, the truncation) on the loop."""
    while True:
        await asyncio.sleep(every_s)
        for path in list(logs()):
            try:
                if not _due(path, max_bytes):
                    continue
                tmp = _tmp(path, backups)
                offset = await asyncio.to_thread(_bulk, path, tmp) if tmp is not None else 0
                _finish(path, tmp, offset, backups, before_truncate)
                log.info("%s passed %d bytes: rotated (%d kept)", path, max_bytes, backups)
            except OSError as exc:  # a full disk, say: the log grows on, the run goes on
                log.warning("could not rotate %s: %s", path, exc)
