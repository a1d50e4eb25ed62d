"""Trainer checkpoints on disk: written atomically, the newest N kept, read back whole.

Layout of one checkpoint, `<root>/step-<9 digits>/`:
    model/          Hugging Face safetensors (astra.weights.checkpoint.write_full:
                    config.json, shards with Adler-32, index), loadable by the engine;
                    a LoRA trainer's holds only its adapter and adapter_config.json
                    (astra.trainer.lora)
    optimizer.pt    optimiser state keyed by parameter name (unsharded)
    rng.pt          torch (CPU and CUDA) and Python RNG states
    trainer.json    step, version, fetch attempt, counters
    digests.json    Adler-32 of every tensor, SHA-256 of every other file
                    (astra.trainer.ckpt_verify: checked before a resume)
Everything is written under `<root>/.tmp-step-...` and renamed into place
(`stage_checkpoint`, then `commit_checkpoint`, which a trainer may call later):
a checkpoint directory exists complete or not at all, and a crash leaves at
worst a temporary directory, removed by the next write. Knows nothing of
models or process groups: the caller gathers the full state first.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from astra.durable import fsync_dir
from astra.engine.torch_weights import load_state, save_state
from astra.trainer.ckpt_verify import PREFIX, list_checkpoints, write_digests

TMP_PREFIX = ".tmp-"
__all__ = ["PREFIX", "list_checkpoints"]


@dataclass
class Checkpoint:
    path: Path
    model: dict[str, Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    trainer: dict[str, Any]


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def stage_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    model_state: Mapping[str, Tensor],
    model_config: Mapping[str, Any],
    optimizer_state: Mapping[str, Any],
    trainer_state: Mapping[str, Any],
    *,
    files: Mapping[str, bytes] | None = None,
) -> Path:
    """Writes the checkpoint of step N complete and durable under `<root>/.tmp-step-N`, not
    yet a checkpoint: `commit_checkpoint` renames it into place."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{PREFIX}{step:09d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_state(tmp / "model", model_state, model_config, version=f"step-{step}", files=files)
    for name, obj in (("optimizer.pt", optimizer_state), ("rng.pt", capture_rng())):
        with open(tmp / name, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    with open(tmp / "trainer.json", "w") as f:
        json.dump({"step": step, **trainer_state}, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    write_digests(tmp)
    fsync_dir(tmp)
    return tmp


def commit_checkpoint(staged: Path, *, keep_last: int | None = None) -> Path:
    """Renames a staged checkpoint (`stage_checkpoint`) into place, replacing one of the same
    step, and prunes to keep_last; returns `<root>/step-N`."""
    root = staged.parent
    final = root / staged.name.removeprefix(TMP_PREFIX)
    if final.exists():
        shutil.rmtree(final)
    os.rename(staged, final)
    fsync_dir(root)
    if keep_last is not None:
        prune(root, keep_last)
    return final


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Deletes all but the newest `keep_last` checkpoints and stale temporaries."""
    found = list_checkpoints(root)
    doomed = found[: max(len(found) - keep_last, 0)]
    stale = [p for p in Path(root).iterdir() if p.name.startswith(TMP_PREFIX)]
    for path in [*doomed, *stale]:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    path = Path(path)
    trainer = json.loads((path / "trainer.json").read_text())
    optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    rng = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)
    return Checkpoint(path, load_state(path / "model"), optimizer, rng, trainer)
