"""Dataflow's SQLite file at rest: its integrity check and its checksummed key/value state.

Two defences, each for what the other misses. `PRAGMA quick_check` at every
start finds damage to the file's structure (pages, b-trees, records that do
not parse), which otherwise surfaces as `database disk image is malformed`
somewhere in the middle of a run. A value changed in place and still well
formed (the dataset position 41 -> 40) passes any structural check, so every
key/value entry (dataset positions, versions, counters, evaluation state) is
stored sealed: the CRC-32 of its key and JSON text before the text. A seal
that does not match is refused at read. The other tables' facts are checked
where they are used: blob records carry their own CRC (astra.dataflow.blobs), and the
facts beside them (rewards, versions, token counts: a row's `meta`) are sealed the same
way, keyed by their group and policy (astra.dataflow.store_schema); every other column
of every row carries a row seal (astra.dataflow.row_seals).
Never imports gRPC.
"""

from __future__ import annotations

import json
import re
import sqlite3
import zlib
from pathlib import Path
from typing import Any

from astra.damage import Damaged

_SEALED = re.compile(r"([0-9a-f]{8}):(.*)", re.DOTALL)


def fix_for(db: Path) -> str:
    """What to do about a damaged Dataflow database (the one-line report's second half)."""
    return (
        f"run `astra doctor` on the run directory to see all damage, then restore "
        f"{db.parent} from a backup, or move it aside to start Dataflow afresh "
        f"(its buffered groups are lost; trainer checkpoints are not)"
    )


def _crc(key: str, text: str) -> str:
    return f"{zlib.crc32((key + chr(0) + text).encode()):08x}"


def seal_text(key: str, text: str) -> str:
    """`text` stored under `key`: its seal, a colon, the text."""
    return f"{_crc(key, text)}:{text}"


def open_text(key: str, stored: str) -> str:
    """The text sealed under `key` (ValueError if its seal fails); unsealed text as it is."""
    m = _SEALED.fullmatch(stored)
    if m is None:
        return stored
    if _crc(key, m.group(2)) != m.group(1):
        raise ValueError(f"{key}: fails its checksum")
    return m.group(2)


def seal(key: str, value: Any) -> str:
    """The stored text of `value` under `key`: its seal, a colon, its JSON."""
    return seal_text(key, json.dumps(value))


def unseal(db: Path, key: str, stored: str) -> Any:
    """The value stored under `key`; Damaged if its seal fails or it does not parse. A value
    without a seal (written before schema 5) is read as plain JSON."""
    m = _SEALED.fullmatch(stored)
    text = stored if m is None else m.group(2)
    if m is not None and _crc(key, text) != m.group(1):
        raise Damaged(db, f"the value of {key!r} fails its checksum", fix_for(db))
    try:
        return json.loads(text)
    except ValueError as exc:
        raise Damaged(db, f"the value of {key!r} is not JSON ({exc})", fix_for(db)) from exc


def quick_check(conn: sqlite3.Connection, db: Path) -> None:
    """Damaged unless SQLite's quick_check finds the file sound."""
    try:
        rows = [r[0] for r in conn.execute("PRAGMA quick_check(8)")]
    except sqlite3.DatabaseError as exc:
        raise Damaged(db, f"SQLite cannot read it ({exc})", fix_for(db)) from exc
    if rows != ["ok"]:
        raise Damaged(db, "SQLite quick_check: " + " | ".join(rows), fix_for(db))


def damaged(db: Path, exc: sqlite3.DatabaseError) -> Damaged:
    """A SQLite error that means the file is damaged (not busy, not full), as Damaged."""
    return Damaged(db, f"SQLite: {exc}", fix_for(db))


def is_damage(exc: BaseException) -> bool:
    """Whether a SQLite error says the file itself is damaged."""
    text = str(exc).lower()
    return isinstance(exc, sqlite3.DatabaseError) and (
        "malformed" in text or "not a database" in text or "corrupt" in text
    )
