"""One optimiser step of the policy over this rank's micro-batches; no I/O, no versions.

Log-prob convention (the engine's, astra.engine.sampler): the log-prob of a
token is log_softmax(logits / temperature) over the whole vocabulary, in
fp32, at the token; `forward_full` gives the logits of every position, and
position t scores token t + 1. At temperature 1 this is the plain model
distribution, and an on-policy token's ratio to the engine's log-prob is 1.
The model is called as `model(ids)` (`forward` is `forward_full`), never
`model.forward_full(ids)`: FSDP2 gathers parameters in `__call__` hooks.

Every micro-batch is forwarded and backpropagated (gradient accumulation);
with M2PO on, a forward pass without gradients over every micro-batch comes
first, so its mask is cut over the whole step (every rank's tokens);
the loss is normalised by the step-wide counts, so the sum of the
micro-batch gradients over every rank is the gradient of the whole batch.
Figures are all-reduced before any decision, so ranks always agree: a
non-finite loss or gradient norm clears the gradients and leaves the
parameters and optimiser untouched (`applied` False).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from astra.engine.model import CausalLM
from astra.trainer.batch import MicroBatch, TrainBatch, plan_microbatches
from astra.trainer.config import LossConfig, TrainerConfig
from astra.trainer.losses import (
    StalenessAccumulator,
    StalenessMetrics,
    aggregate,
    m2po_cut,
    m2po_squares,
    token_losses,
)
from astra.trainer.parallel import all_gather_flat, all_reduce, compute, world

# Order of the figures summed across micro-batches and ranks.
SUMS = (
    "loss", "policy_loss", "kl_ref", "entropy", "clipped", "dual_clipped", "capped", "tokens",
    "band_masked", "m2po_masked",
)  # fmt: skip


@dataclass
class TrainingStepResult:
    """What one step did to the parameters."""

    loss: float
    applied: bool
    grad_norm: float
    num_tokens: int
    num_sequences: int
    num_microbatches: int
    metrics: dict[str, float] = field(default_factory=dict)


def token_logprobs(
    logits_BTV: Tensor, targets_BT: Tensor, temperature: float = 1.0, *, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(log-prob of each target [B, T], entropy [B, T] or None), fp32, the engine's convention."""
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    logp_BT = logp_BTV.gather(-1, targets_BT[..., None])[..., 0]
    ent_BT = -(logp_BTV.exp() * logp_BTV).sum(-1) if entropy else None
    return logp_BT, ent_BT


def sequence_logprobs(model: CausalLM, ids_BT: Tensor, temperature: float = 1.0) -> Tensor:
    """log-prob [B, T-1] of tokens 1.. of each row under `model` (no gradient)."""
    with torch.no_grad(), compute(model):
        logits = model(ids_BT[:, :-1].to(model.device))
        return token_logprobs(logits, ids_BT[:, 1:].to(model.device), temperature)[0]


def _count(flags: Any, mask: Tensor) -> float:
    """Trained tokens where `flags` (a boolean tensor, or None: none) is set."""
    return 0.0 if flags is None else float((flags * mask).sum())


def _share(x: Tensor | None, mask: Tensor, num_tokens: int) -> float:
    """This micro-batch's part of a token mean over the step (0 for an absent figure)."""
    return 0.0 if x is None else float((x.detach() * mask).sum()) / max(num_tokens, 1)


def _grad_norm(model: CausalLM, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.grad is not None], max_norm or math.inf
    )
    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP
    return float(full() if full is not None else norm)


def step_m2po_cut(model: CausalLM, micro: list[MicroBatch], cfg: LossConfig) -> float | None:
    """M2PO's cut over the whole step (every micro-batch, every rank), from a forward pass
    without gradients at the step's parameters (which the gradient passes then see unchanged);
    None where M2PO is off."""
    if cfg.m2po_tau is None:
        return None
    squares = []
    for mb in micro:
        with torch.no_grad(), compute(model):
            logits = model(mb.input_ids.to(model.device))
            logp = token_logprobs(logits, mb.targets.to(model.device), cfg.temperature)[0]
        log_r = logp.cpu() - mb.behaviour_logprobs.to(logp.dtype)
        squares.append(m2po_squares(log_r, cfg, mb.loss_mask))
    every = torch.cat(squares) if squares else torch.zeros(0, dtype=torch.float64)
    return m2po_cut(all_gather_flat(every), cfg.m2po_tau)


def train_step(
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    micro: list[MicroBatch],
    cfg: LossConfig,
    *,
    num_tokens: int,
    num_sequences: int,
    version: int,
    max_grad_norm: float = 1.0,
    ref_model: CausalLM | None = None,
) -> tuple[TrainingStepResult, StalenessMetrics]:
    """Forward/backward every micro-batch, then one clipped AdamW step if everything is finite."""
    device, world_size = model.device, world()[1]
    sums = torch.zeros(len(SUMS), dtype=torch.float64)
    stale = StalenessAccumulator()
    want_entropy = cfg.entropy_coef > 0
    optimizer.zero_grad(set_to_none=True)
    cut = step_m2po_cut(model, micro, cfg)
    for mb in micro:
        ids, targets = mb.input_ids.to(device), mb.targets.to(device)
        mask = mb.loss_mask.to(device)
        behaviour = mb.behaviour_logprobs.to(device)
        with compute(model):
            logits = model(ids)
        logp, ent = token_logprobs(logits, targets, cfg.temperature, entropy=want_entropy)
        if ent is None:
            # Entropy only as a metric: no graph kept for it through backward.
            with torch.no_grad():
                ent = token_logprobs(logits.detach(), targets, cfg.temperature, entropy=True)[1]
        ref = None
        if ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad(), compute(ref_model):
                ref = token_logprobs(ref_model(ids), targets, cfg.temperature)[0]
        out = token_losses(
            logp,
            behaviour,
            mb.advantages.to(device),
            cfg,
            ref_logp=ref,
            entropy=ent if want_entropy else None,
            mask=mask,
            step_cut=cut,
        )
        loss = aggregate(out.loss, mask, cfg.aggregation, num_tokens, num_sequences)
        (loss * world_size).backward()  # FSDP averages over ranks; we want the sum
        m = mask.float()
        figures = (
            float(loss.detach()),
            _share(out.policy, mask, num_tokens),
            _share(out.kl, mask, num_tokens),
            _share(ent, mask, num_tokens),
            float((out.clipped * m).sum()),
            float((out.dual_clipped * m).sum()),
            float((out.capped * m).sum()),
            float(m.sum()),
            _count(out.band_masked, m),
            _count(out.m2po_masked, m),
        )
        sums += torch.tensor(figures, dtype=torch.float64)
        stale.add(logp.cpu(), mb.behaviour_logprobs, mb.versions, mb.loss_mask, version)
    all_reduce(sums)
    all_reduce(stale.sums)
    all_reduce(stale.max_gap, "max")
    figures = dict(zip(SUMS, sums.tolist(), strict=True))
    grad_norm = _grad_norm(model, max_grad_norm)
    applied = math.isfinite(figures["loss"]) and math.isfinite(grad_norm)
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = max(figures["tokens"], 1.0)
    metrics = {
        "loss": figures["loss"],
        "policy_loss": figures["policy_loss"],
        "kl_ref": figures["kl_ref"],
        "entropy": figures["entropy"],
        "clip_fraction": figures["clipped"] / tokens,
        "dual_clip_fraction": figures["dual_clipped"] / tokens,
        "behaviour_capped_fraction": figures["capped"] / tokens,
        "ratio_band_masked_fraction": figures["band_masked"] / tokens,
        "m2po_masked_fraction": figures["m2po_masked"] / tokens,
        "grad_norm": grad_norm,
        "lr": float(optimizer.param_groups[0]["lr"]),
    }
    result = TrainingStepResult(
        loss=figures["loss"],
        applied=applied,
        grad_norm=grad_norm,
        num_tokens=int(figures["tokens"]),
        num_sequences=num_sequences,
        num_microbatches=len(micro),
        metrics=metrics,
    )
    return result, stale.finish()


def train_on_batch(
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    config: TrainerConfig,
    *,
    version: int,
    ref_model: CausalLM | None = None,
) -> tuple[TrainingStepResult, StalenessMetrics]:
    """This rank's share of `batch`, packed into micro-batches, as one `train_step`."""
    rank, world_size = world()
    micro = plan_microbatches(batch, rank, world_size, config.batch.max_tokens_per_microbatch)
    return train_step(
        model,
        optimizer,
        micro,
        config.loss,
        num_tokens=batch.num_tokens,
        num_sequences=batch.num_sequences,
        version=version,
        max_grad_norm=config.optim.max_grad_norm,
        ref_model=ref_model,
    )
