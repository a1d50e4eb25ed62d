"""`astra weights`: commands on version directories (inspect, diff, apply) and, added
from cli_remote, on a WeightService (publish, fetch, list, rollback).

Results are JSON on stdout; logs and errors go to stderr. Exit codes: 0
success, 1 operational failure (a corrupt or inconsistent directory, a
checksum mismatch, I/O errors), 2 bad arguments. numpy and zstandard are
imported inside the commands, so `--help` stays fast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TypeVar

import click

from astra.weights.cli_common import DIR, emit, identity_option, run_command
from astra.weights.cli_remote import COMMANDS

log = logging.getLogger("astra.weights")
T = TypeVar("T")


def _new_path(ctx: click.Context, param: click.Parameter, value: Path) -> Path:
    if value.exists():
        raise click.BadParameter(f"{value} already exists; versions are never overwritten")
    return value


@click.group("weights")
@click.option("--log-level", default="warning", show_default=True, help="Log level on stderr.")
def weights(log_level: str) -> None:
    """Validate, diff and apply weight version directories."""
    from astra.logs import configure

    configure(log_level)


@weights.command("inspect")
@click.argument("directory", type=DIR)
def inspect_command(directory: Path) -> None:
    """Validate a full or delta version directory and describe it.

    A WeightService store's version directory (STORE/policies/P/versions/N, holding `full/`
    and or `delta/`) is described part by part: {"full": ..., "delta": ...}."""
    from astra.weights.validate import inspect

    parts = [p for p in ("full", "delta") if (directory / p).is_dir()]
    if parts and not (directory / "model.safetensors.index.json").exists():
        emit(run_command(lambda: {p: inspect(directory / p) for p in parts}))
        return
    emit(run_command(lambda: inspect(directory)))


@weights.command("diff")
@click.option("--base", "base_dir", type=DIR, required=True, help="Full base version.")
@click.option("--new", "new_dir", type=DIR, required=True, help="Full new version.")
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), required=True, callback=_new_path
)
@click.option("--version", callback=identity_option, help="Identity of the new version.")
@click.option("--base-version", callback=identity_option, help="Identity of the base version.")
@click.option(
    "--level", type=click.IntRange(1, 22), default=1, show_default=True, help="zstd level."
)
@click.option(
    "--max-shard-bytes", type=click.IntRange(min=1), default=5_000_000_000, show_default=True
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=None, help="Threads (default: CPUs)."
)
@click.option("--no-fsync", is_flag=True, help="Skip fsync (tests, scratch directories).")
def diff_command(
    base_dir: Path,
    new_dir: Path,
    out_dir: Path,
    version: str | None,
    base_version: str | None,
    level: int,
    max_shard_bytes: int,
    workers: int | None,
    no_fsync: bool,
) -> None:
    """Write the xor+zstd delta taking --base to --new."""
    from astra.weights.checkpoint import write_delta

    result = run_command(
        lambda: write_delta(
            base_dir,
            new_dir,
            out_dir,
            version,
            base_version,
            level=level,
            max_shard_bytes=max_shard_bytes,
            workers=workers,
            durable=not no_fsync,
        )
    )
    log.info("wrote %s: %s changed tensors", out_dir, result["changed_tensor_count"])
    emit(result)


@weights.command("apply")
@click.option("--base", "base_dir", type=DIR, required=True, help="Full base version.")
@click.option("--delta", "delta_dir", type=DIR, required=True, help="Delta against --base.")
@click.option(
    "--out", "out_dir", type=click.Path(path_type=Path), required=True, callback=_new_path
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=None, help="Threads (default: CPUs)."
)
@click.option("--no-fsync", is_flag=True, help="Skip fsync (tests, scratch directories).")
def apply_command(
    base_dir: Path, delta_dir: Path, out_dir: Path, workers: int | None, no_fsync: bool
) -> None:
    """Rebuild the full version --base + --delta at --out, every checksum verified first."""
    from astra.weights.checkpoint import apply_delta

    result = run_command(
        lambda: apply_delta(base_dir, delta_dir, out_dir, workers=workers, durable=not no_fsync)
    )
    log.info("applied %s onto %s at %s", delta_dir, base_dir, out_dir)
    emit(result)


for command in COMMANDS:  # publish, fetch, list, rollback: on a WeightService (cli_remote.py)
    weights.add_command(command)
