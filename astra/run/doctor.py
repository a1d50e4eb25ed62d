"""`astra doctor RUN_DIR`: checks a run directory's bytes at rest, offline, changing nothing.

What it reads, each item OK or DAMAGED with its path and why:
- Dataflow's database (state/dataflow/dataflow.sqlite): SQLite's quick_check, the
  seal of every key/value entry (astra.dataflow.sealed) and of every row of its tables
  (astra.dataflow.row_seals);
- Dataflow's blob log: every record a row points at, its length and CRC-32, and that
  it decodes (astra.dataflow.blobs);
- every trainer checkpoint (checkpoints/<policy>/step-*): its digests
  (astra.trainer.ckpt_verify);
- every version of the WeightService store (state/weights): its record, the SHA-256
  of its files and the Adler-32 of its tensors (astra.weights.validate.inspect).
Prints one table; exit status 0 when everything is OK, 1 otherwise. Run it with the
services stopped. Never imports gRPC.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from astra.damage import Damaged
from astra.dataflow.blobs import CorruptRecord, read_checked, segment_path
from astra.dataflow.row_seals import ROWS_SEALED_FROM, verify_all
from astra.dataflow.sealed import unseal
from astra.dataflow.store_schema import CHECKED_FROM, batch_groups, unpack_trajectories
from astra.trainer.ckpt_verify import list_checkpoints, verify
from astra.weights.records import RECORD_NAME, VersionRecord, tree_sha256
from astra.weights.safetensors_io import FormatError
from astra.weights.validate import inspect

BLOB_TABLES = ("groups", "batch_replays", "replay_memory")


@dataclass(frozen=True)
class Finding:
    item: str
    path: Path
    ok: bool
    reason: str = ""


def check_dataflow(state: Path) -> Iterator[Finding]:
    db = state / "dataflow.sqlite"
    if not db.is_file():
        return
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        try:
            rows = [r[0] for r in conn.execute("PRAGMA quick_check(8)")]
            if rows != ["ok"]:
                yield Finding("dataflow database", db, False, " | ".join(rows))
                return
            checked_from = 0
            for key, value in conn.execute("SELECT key, value FROM kv ORDER BY key"):
                got = unseal(db, key, value)
                if key == CHECKED_FROM:
                    checked_from = int(got)
            for batch_id, policy_id, version, groups in conn.execute(
                "SELECT batch_id, policy_id, policy_version, groups FROM batches"
            ):
                try:
                    batch_groups(batch_id, policy_id, version, groups)
                except ValueError as exc:
                    what = f"batch {batch_id}'s groups are damaged ({exc})"
                    yield Finding("dataflow database", db, False, what)
                    return
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version >= ROWS_SEALED_FROM:  # before, its rows carry no seal
                verify_all(conn, db)
        except sqlite3.DatabaseError as exc:
            yield Finding("dataflow database", db, False, f"SQLite: {exc}")
            return
        except Damaged as exc:
            yield Finding("dataflow database", db, False, exc.what)
            return
        yield Finding("dataflow database", db, True)
        yield from _check_records(conn, state / "blobs", checked_from)
    finally:
        conn.close()


def _check_records(conn: sqlite3.Connection, blobs: Path, checked_from: int) -> Iterator[Finding]:
    good = 0
    for table in BLOB_TABLES:
        for gid, pid, meta, seg, off, length in conn.execute(
            f"SELECT group_id, policy_id, meta, seg, off, len FROM {table}"
        ):
            path = segment_path(blobs, seg)
            try:
                body = read_checked(path, off, length, checked=seg >= checked_from)
                unpack_trajectories(meta, body, gid, pid)
            except CorruptRecord as exc:
                reason = f"offset {off}: {exc.reason} (group {gid}, policy {pid}, {table})"
                yield Finding("dataflow blob record", path, False, reason)
                continue
            except (ValueError, TypeError) as exc:
                reason = f"offset {off}: does not decode: {exc} (group {gid}, {table})"
                yield Finding("dataflow blob record", path, False, reason)
                continue
            good += 1
    yield Finding(f"dataflow blob records ({good} sound)", blobs, True)


def check_checkpoints(root: Path) -> Iterator[Finding]:
    for policy_dir in sorted(p for p in root.glob("*") if p.is_dir()):
        for ckpt in list_checkpoints(policy_dir):
            try:
                verify(ckpt)
            except Damaged as exc:
                yield Finding("trainer checkpoint", Path(exc.path), False, exc.what)
                continue
            yield Finding("trainer checkpoint", ckpt, True)


def check_weights(store: Path) -> Iterator[Finding]:
    for vdir in sorted(store.glob("policies/*/versions/*")):
        if vdir.name.startswith(".") or not vdir.is_dir():
            continue
        yield _check_version(vdir)


def _check_version(vdir: Path) -> Finding:
    item = "weights version"
    try:
        record = VersionRecord.load(vdir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Finding(item, vdir / RECORD_NAME, False, f"unreadable record: {exc}")
    for form in ("full", "delta"):
        if (vdir / form).is_dir():
            try:
                inspect(vdir / form)
            except FormatError as exc:
                return Finding(item, Path(exc.path or vdir / form), False, str(exc))
    if record.file_sha256:
        found = tree_sha256(vdir)
        for name in sorted(set(found) | set(record.file_sha256)):
            if found.get(name) != record.file_sha256.get(name):
                why = "missing" if name not in found else "SHA-256 differs from the record"
                return Finding(item, vdir / name, False, why)
    return Finding(item, vdir, True)


def diagnose(run_dir: Path) -> list[Finding]:
    return [
        *check_dataflow(run_dir / "state" / "dataflow"),
        *check_checkpoints(run_dir / "checkpoints"),
        *check_weights(run_dir / "state" / "weights"),
    ]


def table(findings: list[Finding]) -> str:
    rows = [("STATUS", "ITEM", "PATH", "REASON")]
    rows += [("OK" if f.ok else "DAMAGED", f.item, str(f.path), f.reason) for f in findings]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)), r[3]]).rstrip()
        for r in rows
    )


@click.command("doctor")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def doctor_command(run_dir: Path) -> None:
    """Check a run directory's state offline: OK / DAMAGED per item; exit 1 if any is damaged."""
    findings = diagnose(run_dir)
    if not findings:
        click.echo(f"{run_dir}: no Dataflow state, checkpoints or weights found", err=True)
        sys.exit(1)
    click.echo(table(findings))
    sys.exit(0 if all(f.ok for f in findings) else 1)
