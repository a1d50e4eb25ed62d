"""Picks the next token of every row of a batch, each row under its own request's settings.

Conventions (the engine repeats them in `Generation.meta`):
- `logprobs`: log_softmax(logits / temperature) at the sampled token, over the
  whole vocabulary, before top-k/top-p; temperature 0 (greedy) counts as 1.
  This is the policy at temperature, which is what an RL trainer recomputes
  from the same weights, so on-policy importance ratios are exactly 1.
- `sampling_logprobs`: log-prob of the sampled token under the distribution it
  was actually drawn from: the tempered distribution cut to the top-k tokens,
  renormalised, cut to the smallest prefix whose mass reaches top_p (a token
  is kept while the mass before it is < top_p), renormalised again; 0.0 for
  greedy (a point mass). Equal to `logprobs` when top_k=0 and top_p=1.
- Randomness: each sampled row takes exactly one fp64 uniform from its own
  CPU `torch.Generator` and inverts the CDF of its distribution (vocabulary
  order when uncut, descending-probability order with a stable sort when
  cut). A request's draws therefore depend only on its seed and its own
  logits, never on the other rows of the batch or on the device's RNG.
- Greedy is argmax (lowest id on exact ties); it draws nothing.

Legend: B batch rows, R rows being sampled, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from astra.engine.api import Sampling


@dataclass(frozen=True, slots=True)
class Draws:
    """One step's choices, aligned with the batch rows."""

    tokens: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]


def _invert_cdf(probs_RV: Tensor, u_R: Tensor, kept_R: Tensor | None = None) -> Tensor:
    cdf_RV = probs_RV.double().cumsum(-1)
    idx_R1 = torch.searchsorted(cdf_RV, u_R[:, None] * cdf_RV[:, -1:])
    top = (kept_R if kept_R is not None else torch.full_like(idx_R1[:, 0], probs_RV.shape[-1])) - 1
    return torch.minimum(idx_R1[:, 0], top)


def _draw_uncut(logp_RV: Tensor, u_R: Tensor) -> tuple[Tensor, Tensor]:
    idx_R = _invert_cdf(logp_RV.exp(), u_R)
    return idx_R, logp_RV.gather(1, idx_R[:, None])[:, 0]


def _draw_cut(
    logp_RV: Tensor, top_k_R: Tensor, top_p_R: Tensor, u_R: Tensor
) -> tuple[Tensor, Tensor]:
    sorted_RV, order_RV = logp_RV.sort(dim=-1, descending=True, stable=True)
    rank_V = torch.arange(logp_RV.shape[-1], device=logp_RV.device)
    keep_RV = rank_V < top_k_R[:, None]
    probs_RV = sorted_RV.double().exp() * keep_RV
    probs_RV = probs_RV / probs_RV.sum(-1, keepdim=True)
    keep_RV &= (probs_RV.cumsum(-1) - probs_RV) < top_p_R[:, None]
    cut_RV = torch.log_softmax(sorted_RV.masked_fill(~keep_RV, float("-inf")), dim=-1)
    idx_R = _invert_cdf(cut_RV.exp(), u_R, keep_RV.sum(-1))
    token_R = order_RV.gather(1, idx_R[:, None])[:, 0]
    return token_R, cut_RV.gather(1, idx_R[:, None])[:, 0]


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> Tensor:
    draws = []
    for g in generators:
        if g is None:
            raise ValueError("a sampled row needs a generator")
        draws.append(torch.rand((), generator=g, dtype=torch.float64))
    return torch.stack(draws).to(device)


def _is_cut(p: Sampling, V: int) -> bool:
    return p.top_k not in (0, V) or p.top_p < 1.0


def sample(
    logits_BV: Tensor,
    params: Sequence[Sampling],
    generators: Sequence[torch.Generator | None],
) -> Draws:
    """Chooses one token per row; `generators[i]` may be None only for greedy rows."""
    logits_BV = logits_BV.float()
    (B, V), dev = logits_BV.shape, logits_BV.device
    temp_B = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
    logp_BV = torch.log_softmax(logits_BV / temp_B[:, None], dim=-1)
    tokens_B = logits_BV.argmax(-1)
    cut_lp_B = torch.zeros(B, device=dev)
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    for cut in (False, True):
        rows = [i for i in sampled if _is_cut(params[i], V) == cut]
        if not rows:
            continue
        rows_R = torch.tensor(rows, device=dev)
        u_R = _uniforms([generators[i] for i in rows], dev)
        if cut:
            top_k_R = torch.tensor([params[i].top_k or V for i in rows], device=dev).clamp(max=V)
            top_p_R = torch.tensor([params[i].top_p for i in rows], device=dev, dtype=torch.float64)
            token_R, lp_R = _draw_cut(logp_BV[rows_R], top_k_R, top_p_R, u_R)
        else:
            token_R, lp_R = _draw_uncut(logp_BV[rows_R], u_R)
        tokens_B[rows_R] = token_R
        cut_lp_B[rows_R] = lp_R.float()
    lp_B = logp_BV.gather(1, tokens_B[:, None])[:, 0]
    out = torch.stack((tokens_B.double(), lp_B.double(), cut_lp_B.double())).cpu().tolist()
    return Draws([int(t) for t in out[0]], out[1], out[2])
