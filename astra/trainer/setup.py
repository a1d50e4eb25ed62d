"""Builds what a trainer starts from: weights, model, optimiser, source and sink; agrees versions.

Version agreement after a (re)start: the trainer continues from the largest
of its checkpoint's version, the WeightService's newest version and
Dataflow's current version, so versions stay monotonic across restarts; a
version the WeightService holds but Dataflow never heard of (the trainer
died between the two) is announced first; when Dataflow already has the
WeightService's newest version, that version is announced again (a repeat,
idempotent), so Dataflow loads it from the address the trainer uses now.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from astra.engine.model import CausalLM
from astra.engine.model_config import ModelConfig
from astra.engine.tiny import TINY, TINY_CONFIG, tiny_model
from astra.engine.torch_weights import load_state, torch_dtype
from astra.lora.layer import Adapter
from astra.trainer.config import TrainerConfig
from astra.trainer.parallel import build_model
from astra.trainer.sources import (
    BatchSource,
    WeightSink,
)

log = logging.getLogger(__name__)


def load_weights(model: str) -> tuple[ModelConfig, dict[str, Any], dict[str, Tensor]]:
    """(architecture, config.json contents, HF-named CPU tensors) of 'tiny' or a directory."""
    if model == TINY:
        return ModelConfig.from_hf(TINY_CONFIG), dict(TINY_CONFIG), tiny_model().hf_state_dict()
    raw = json.loads((Path(model) / "config.json").read_text())
    return ModelConfig.from_hf(raw), raw, load_state(model)


def make_model(
    config: TrainerConfig,
    cfg: ModelConfig,
    state: dict[str, Tensor],
    mesh: DeviceMesh | None,
    *,
    frozen: bool = False,
    adapter: Adapter | None = None,
) -> CausalLM:
    """The trained model (with `adapter`: its LoRA layers, `state` holding their tensors
    too), or a frozen one."""
    dtype = torch_dtype(config.dtype)
    model = build_model(
        cfg,
        state,
        device=config.device,
        dtype=dtype,
        mesh=mesh,
        trainable=not frozen,
        adapter=adapter,
    )
    if frozen:
        model.eval().requires_grad_(False)
    return model


def make_reference(
    config: TrainerConfig, initial: dict[str, Tensor], mesh: DeviceMesh | None
) -> CausalLM | None:
    """The frozen KL reference, or None when the loss has no KL term."""
    if config.reference_model is None or config.loss.kl_coef == 0:
        return None
    if config.reference_model == "initial":
        cfg = load_weights(config.model)[0]
        return make_model(config, cfg, initial, mesh, frozen=True)
    cfg, _, state = load_weights(config.reference_model)
    return make_model(config, cfg, state, mesh, frozen=True)


def make_optimizer(config: TrainerConfig, model: CausalLM) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (all of them, or a LoRA trainer's adapters)."""
    o = config.optim
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
    )


async def agree_version(
    version: int, source: BatchSource | None, sink: WeightSink | None, *, announce: bool
) -> tuple[int, bool]:
    """(version to continue from, whether the sink holds any version)."""
    latest = await sink.latest_version() if sink is not None else None
    current = await source.current_version() if source is not None else None
    if announce and source is not None and latest is not None and current is not None:
        for v in range(current + 1, latest + 1):
            log.info("announcing version %d, published before the restart", v)
            await source.announce(v, str(v))
        if latest >= current:
            # A repeat, so Dataflow takes this WeightService's address for every load of the
            # policy (after a restart the service may be on another port, and the address
            # Dataflow kept may be dead), and marked `resumed`: batches this trainer's last
            # run acknowledged past this version were never trained.
            # `resumed_from`: the weights it continues from; the batches of the steps after
            # them are counted discarded (their groups are not in the weights any more).
            log.info(
                "announcing version %d again (resumed from version %d), with this address",
                latest,
                version,
            )
            await source.announce(latest, str(latest), resumed=True, resumed_from=version)
    known = max(latest if latest is not None else 0, current or 0)
    if latest is not None and version > known:
        # The checkpoint is of a version whose publish never completed (the trainer died
        # between the two): Dataflow takes versions one at a time, so the steps after the
        # newest version it can have are numbered from there.
        log.warning(
            "checkpoint at version %d, newest published %d: its publish was lost; the next "
            "step publishes %d",
            version,
            known,
            known + 1,
        )
        return known, True
    agreed = max(version, known)
    if agreed != version:
        log.warning("continuing at version %d (checkpoint had %d)", agreed, version)
    return agreed, latest is not None
