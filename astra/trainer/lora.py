"""The trainer's LoRA: the adapter `trainer.lora` asks for, what its versions and checkpoints
carry, and the merged model it exports on request.

`plan` checks `trainer.lora` against the loaded base at start-up (one error naming the
key and the fix) and returns the `Adapter` (astra.lora.layer) with the base's digest,
computed from the tensors as read, before any cast (astra.lora.format). `start_state` is
what the model is built from: the base and the seeded starting adapter. With an
adapter, a published version holds only the adapter tensors and `adapter_config.json`
(`keep`, `version_files`); so does a checkpoint's `model/`, with its `config.json`.
`check_checkpoint` refuses a resume from a checkpoint of another base (naming
`base_digest`), of another adapter shape, or of the other kind of training.
`export_merged` / `merge_checkpoint` write the merged full model (`astra trainer
merge-lora`, astra.trainer.lora_cli).

Never touches the optimiser, the network or the step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from astra.config import ConfigError
from astra.engine.model import CausalLM
from astra.engine.model_config import ModelConfig
from astra.engine.torch_weights import load_state, save_state
from astra.lora.format import (
    ADAPTER_FILE,
    AdapterConfig,
    AdapterError,
    base_digest,
    is_adapter_tensor,
    pair_tensors,
    target_modules,
)
from astra.lora.layer import Adapter, initial_tensors, merge
from astra.trainer.ckpt_verify import verify
from astra.trainer.config import TrainerConfig
from astra.trainer.setup import load_weights
from astra.trainer.sources import model_files
from astra.weights import digest

KEY = "trainer.lora"
MERGE_FILE = "astra_lora_merge.json"  # in a merged export: the adapter config it holds


def plan(config: TrainerConfig, cfg: ModelConfig, base: Mapping[str, Tensor]) -> Adapter | None:
    """The adapter of `config.lora` on this base, or None for full fine-tuning.

    Raises ConfigError naming `trainer.lora.target_modules` for a name that is no linear
    layer of the model, and `trainer.lora.rank` for a rank above a layer's smaller side.
    """
    lora = config.lora
    if lora is None:
        return None
    with torch.device("meta"):
        skeleton = CausalLM(cfg)
    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in skeleton.named_modules() if isinstance(m, nn.Linear)}
    )
    unknown = [t for t in lora.target_modules if t not in linear]
    if unknown:
        raise ConfigError(
            f"{KEY}.target_modules: {unknown} name no linear layer of model {config.model!r}; "
            f"write some of {linear}"
        )
    try:
        modules = target_modules(base.keys(), lora.target_modules)
    except AdapterError as exc:  # lm_head of a model that ties it to the embedding
        raise ConfigError(
            f"{KEY}.target_modules: {exc} (a tied lm_head is the embedding, not a layer of "
            f"its own); write some of {[n for n in linear if n != 'lm_head']}"
        ) from None
    smallest = min(min(base[m + ".weight"].shape) for m in modules)
    if lora.rank > smallest:
        raise ConfigError(
            f"{KEY}.rank: {lora.rank} is more than the smallest adapted layer's side "
            f"({smallest}); write a rank of at most {smallest}"
        )
    adapter_config = AdapterConfig(
        rank=lora.rank,
        alpha=lora.alpha,
        dropout=lora.dropout,
        targets=tuple(lora.target_modules),
        base_digest=base_digest(base),
    )
    return Adapter(adapter_config, tuple(modules))


def start_state(adapter: Adapter | None, base: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    """The tensors the trained model is built from: the base, and the starting adapter."""
    if adapter is None:
        return base
    shapes = {n: tuple(t.shape) for n, t in base.items()}
    return {**base, **initial_tensors(adapter, shapes, seed)}


def keep(adapter: Adapter | None) -> Callable[[str], bool] | None:
    """Which of the model's tensors a version or checkpoint holds (None: all)."""
    return is_adapter_tensor if adapter is not None else None


def adapter_files(adapter: Adapter | None) -> dict[str, bytes]:
    return {} if adapter is None else {ADAPTER_FILE: adapter.config.to_json().encode()}


def version_files(
    config: TrainerConfig, hf_config: Mapping[str, Any], adapter: Adapter | None
) -> dict[str, bytes]:
    """The files a published version carries: the model's (config.json, tokenizer), or an
    adapter version's one file, adapter_config.json."""
    if adapter is None:
        return model_files(config.model, hf_config)
    return adapter_files(adapter)


def check_checkpoint(path: Path, adapter: Adapter | None) -> None:
    """Refuses (before anything is loaded) a checkpoint this trainer cannot continue."""
    saved_file = path / "model" / ADAPTER_FILE
    if adapter is None:
        if saved_file.is_file():
            raise ConfigError(
                f"{KEY}: checkpoint {path} holds a LoRA adapter ({ADAPTER_FILE}); set {KEY} as "
                "the run that wrote it had, or point checkpoint.dir elsewhere"
            )
        return
    if not saved_file.is_file():
        raise ConfigError(
            f"{KEY}: checkpoint {path} is of full fine-tuning (no model/{ADAPTER_FILE}); "
            f"remove {KEY}, or point checkpoint.dir elsewhere"
        )
    saved = AdapterConfig.from_json(saved_file.read_bytes())
    held = adapter.config.base_digest
    if digest.normalized(saved.base_digest) != digest.normalized(held):
        raise AdapterError(
            "base_digest",
            f"checkpoint {path} holds an adapter trained on base {saved.base_digest}; this "
            f"trainer loaded base {held}: resume with the model it was trained on, or point "
            "checkpoint.dir elsewhere",
        )
    mine = adapter.config
    for field_name, theirs, ours in (
        ("rank", saved.rank, mine.rank),
        ("alpha", saved.alpha, mine.alpha),
        ("target_modules", list(saved.targets), list(mine.targets)),
    ):
        if theirs != ours:
            raise ConfigError(
                f"{KEY}.{field_name}: checkpoint {path} was trained with {theirs!r}, the "
                f"config says {ours!r}; write {theirs!r} to resume it"
            )


def export_merged(
    directory: str | os.PathLike[str],
    state: Mapping[str, Tensor],
    hf_config: Mapping[str, Any],
    config: AdapterConfig,
) -> Path:
    """Writes the merged full model of `state` (base + adapter tensors, as a LoRA trainer's
    `full_state` gives them): every adapted W becomes W + alpha/rank * B @ A, in a Hugging
    Face directory any engine loads, with MERGE_FILE saying which adapter it holds."""
    merged = merge(state, config)
    info = {"merged_from": json.loads(config.to_json())}
    save_state(directory, merged, hf_config, files={MERGE_FILE: json.dumps(info).encode()})
    return Path(directory)


def merge_checkpoint(
    checkpoint: str | os.PathLike[str], model: str, out: str | os.PathLike[str]
) -> Path:
    """`export_merged` of a LoRA checkpoint's adapter on `model` ('tiny' or a directory),
    the base it was trained on: verified first (Damaged), then refused naming `base_digest`
    on another base."""
    path = Path(checkpoint)
    verify(path)
    saved_file = path / "model" / ADAPTER_FILE
    if not saved_file.is_file():
        raise ConfigError(f"{path}: not a LoRA checkpoint (no model/{ADAPTER_FILE})")
    saved = AdapterConfig.from_json(saved_file.read_bytes())
    _, hf_config, base = load_weights(model)
    held = base_digest(base)
    if digest.normalized(saved.base_digest) != digest.normalized(held):
        raise AdapterError(
            "base_digest",
            f"checkpoint {path} holds an adapter trained on base {saved.base_digest}; "
            f"model {model!r} is base {held}: name the model it was trained on",
        )
    tensors = load_state(path / "model")
    pair_tensors(tensors, {n: tuple(t.shape) for n, t in base.items()}, saved)
    return export_merged(out, {**base, **tensors}, hf_config, saved)
