"""Trainer checkpoints at rest: digests written beside them, verified before a resume.

Each checkpoint directory gets `digests.json`: the Adler-32 of every model tensor
(the same value its shard's header records, astra.weights.checksum) and the
SHA-256 of every other file (optimizer.pt, rng.pt, trainer.json, config and
index). `verify` recomputes them all and raises `Damaged` naming the file and,
for a weight, the tensor. `newest_good` is what a resume starts from: the newest
checkpoint that verifies, the damaged ones after it reported; none good while
some exist is Damaged naming the directory. A checkpoint written before digests
existed is verified by its shards' own Adler-32s and a readable trainer.json.
Imports neither torch nor gRPC (the supervisor reads steps with it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from astra.damage import Damaged
from astra.weights.checksum import adler32_hex
from astra.weights.layout import SHARD_SUFFIX, Version
from astra.weights.records import sha256_file
from astra.weights.safetensors_io import FormatError

PREFIX = "step-"
DIGESTS = "digests.json"
FORMAT = "astra-checkpoint-digests/1"
MODEL = "model"
FIX = "move it aside (or delete it); a resume starts from the previous good checkpoint"


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(found, key=lambda p: p.name)


def _files(directory: Path) -> list[str]:
    """Every file of a checkpoint but the model's shards and the digests, relative."""
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != DIGESTS and not p.name.endswith(SHARD_SUFFIX)
    )


def write_digests(directory: Path) -> None:
    """Writes `digests.json` for a checkpoint directory written completely (before its
    rename into place): the tensors' Adler-32s from their shards, the files' SHA-256."""
    with Version(directory / MODEL) as model:
        tensors = {name: e.checksum for name, e in sorted(model.entries.items())}
    body = {
        "format": FORMAT,
        "tensors": tensors,
        "files": {name: sha256_file(directory / name) for name in _files(directory)},
    }
    with open(directory / DIGESTS, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _recorded(directory: Path) -> dict | None:
    path = directory / DIGESTS
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise Damaged(path, f"not JSON ({exc})", FIX) from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise Damaged(path, f"not a {FORMAT} file", FIX)
    return body


def verify(directory: str | os.PathLike[str]) -> None:
    """Damaged unless every tensor and file of the checkpoint is as it was written."""
    directory = Path(directory)
    recorded = _recorded(directory)
    want = recorded["tensors"] if recorded else {}
    try:
        with Version(directory / MODEL) as model:
            if recorded is not None and set(want) != set(model.entries):
                extra = sorted(set(want) ^ set(model.entries))
                raise Damaged(directory / MODEL, f"tensors differ from {DIGESTS}: {extra[:3]}", FIX)
            for name, entry in sorted(model.entries.items()):
                view = model.view(name)
                got = adler32_hex(view)
                view.release()
                expected = want.get(name, entry.checksum)
                if got != expected or got != entry.checksum:
                    raise Damaged(
                        entry.shard.path,
                        f"tensor {name!r}: bytes hash to {got}, recorded {expected}",
                        FIX,
                    )
    except FormatError as exc:
        raise Damaged(exc.path or directory / MODEL, str(exc), FIX) from exc
    if recorded is None:
        _readable_trainer_json(directory)
        return
    for name, digest in sorted(recorded["files"].items()):
        path = directory / name
        if not path.is_file():
            raise Damaged(path, "missing", FIX)
        if sha256_file(path) != digest:
            raise Damaged(path, f"SHA-256 differs from {DIGESTS}", FIX)


def _readable_trainer_json(directory: Path) -> None:
    path = directory / "trainer.json"
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise Damaged(path, f"unreadable ({exc})", FIX) from exc


def newest_good(
    root: str | os.PathLike[str], on_damaged: Callable[[Damaged], None] | None = None
) -> Path | None:
    """The newest checkpoint under `root` that verifies (None when there is none at all);
    `on_damaged` is told of each newer one refused. Damaged (naming `root`) if every
    checkpoint is damaged."""
    found = list_checkpoints(root)
    for path in reversed(found):
        try:
            verify(path)
        except Damaged as exc:
            if on_damaged is not None:
                on_damaged(exc)
            continue
        return path
    if found:
        raise Damaged(
            root,
            f"all {len(found)} checkpoints are damaged",
            "restore one from a backup, or move the directory aside to start from the "
            "initial model (`astra doctor RUN_DIR` lists what is damaged)",
        )
    return None
