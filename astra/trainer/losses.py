"""Token-level GRPO/PPO losses, their aggregation, and the staleness signals of a step.

Pure tensor functions: no model, optimiser, process group or I/O. Per trained
token (loss mask m = 1): logp is the current policy's log-prob (with gradient),
prox the proximal policy's (detached; the parameters at the start of the step,
since a batch gets exactly one optimiser step, so by default prox = sg(logp)),
mu the behaviour log-prob the rollout engine reported, A the sequence's
advantage, sg() stop-gradient.

    r          = exp(logp - base)
    l_clip     = max(-A*r, -A*clamp(r, 1 - clip_low, 1 + clip_high))
    dual clip  = for A < 0: min(l_clip, -c*A)  (Ye et al. 2020; c > 1)

kinds:
    ppo        base = mu; l = l_clip (dual-clipped).
    decoupled  AReaL's decoupled PPO: base = prox; l = w * l_clip with the behaviour
               weight w = sg(exp(prox - mu)), truncated to min(w, C) ("truncate") or
               its token dropped when w > C ("mask", AReaL's behav_imp_weight_cap).
    tis        truncated importance sampling: l = -sg(min(exp(logp - mu), C)) * A * logp,
               whose gradient is min(r, C) * A * grad(logp) (IMPALA's truncated rho);
               with "mask", tokens with r > C are dropped instead.

Off-policy masks (any kind; with r_b = exp(prox - mu), the trainer's probability at the start
of the step over the engine's that sampled the token: train/inference mismatch plus staleness):
    ratio_band [lo, hi]  IcePop: a token with r_b outside [lo, hi] gets l = 0;
    m2po_tau             M2PO: over the step's trained tokens (every micro-batch and every
                         rank: `m2po_cut` finds the cut, the trainer a pass before the
                         gradients), those with the largest (log r_b)^2 get l = 0, the fewest
                         such that the mean (log r_b)^2 of the tokens left is <= tau (after
                         the band's, when both are set).
A masked token stays in the normaliser (N_tokens), as in M2PO's objective.

KL to a frozen reference, d = ref - logp: k1 = -d, k2 = d^2 / 2,
k3 = exp(d) - d - 1 (unbiased and non-negative; d clamped to [-20, 20] and k3 to
at most 10, as verl does, so it stays finite). Per-token total:
l + kl_coef * k - entropy_coef * H, H the entropy of the next-token distribution.

Aggregation over a micro-batch laid out [B, T] (one sequence per row), with
normalisers counted over the whole step (every micro-batch and every rank), so
gradient accumulation yields the gradient of the full batch:
    token      sum(m * l) / N_tokens
    sequence   sum_rows(sum_t(m * l) / n_row) / N_sequences   (rows with n_row > 0)
(m * l selects l where m = 1: an inf at a masked position never reaches the sum).

Staleness (Flux's three signals): version gap = trainer version - token version
(max and token mean); KL(behaviour || current) by k3 over tokens sampled from
the behaviour policy, mean(r - 1 - log r) with r = exp(logp - mu); the variance
of r. score = 0.4*min(1, KL/0.1) + 0.3*min(1, var/2) + 0.3*min(1, mean gap/5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from astra.trainer.config import LossConfig

KL_DELTA_BOUND = 20.0  # |log ratio| to the reference, for the k3 estimator
KL_K3_BOUND = 10.0  # the k3 estimate per token


@dataclass
class TokenLosses:
    """Per-token outputs of `token_losses`; all but `loss` detached."""

    loss: Tensor
    policy: Tensor
    ratio: Tensor
    clipped: Tensor
    dual_clipped: Tensor
    behaviour_weight: Tensor
    capped: Tensor
    kl: Tensor | None
    entropy: Tensor | None
    band_masked: Tensor | None = None  # outside `ratio_band` (IcePop)
    m2po_masked: Tensor | None = None  # masked by M2PO's second-moment bound


def clipped_surrogate(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, clip active, dual clip active) of the PPO surrogate per token."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).detach()
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_active = ((adv < 0) & (loss > bound)).detach()
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return loss, clip_active, dual_active


def capped_weight(log_w: Tensor, cap: float | None, mode: str) -> tuple[Tensor, Tensor]:
    """(weight exp(log_w) capped at `cap` by truncation or masking, where the cap bound)."""
    w = log_w.detach().exp()
    if cap is None:
        return w, torch.zeros_like(w, dtype=torch.bool)
    over = w > cap
    return torch.where(
        over, torch.zeros_like(w) if mode == "mask" else torch.full_like(w, cap), w
    ), over


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """KL(π ‖ π_ref) per token, estimated from tokens sampled from π."""
    delta = ref_logp - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    # k3 overflows fp32 where the reference is ~88 nats surer than the policy (an untrained
    # prompt position can be); clamped as verl's low_var_kl is, so it and its gradient stay finite.
    delta = delta.clamp(-KL_DELTA_BOUND, KL_DELTA_BOUND)
    return (delta.exp() - delta - 1.0).clamp(max=KL_K3_BOUND)


def m2po_cut(squares: Tensor, tau: float) -> float:
    """The smallest (log r)^2 M2PO masks among these values (every valid token of the step):
    the fewest largest are masked such that the mean of the rest is <= tau; inf: none.
    Masking every value >= the cut keeps that bound also where values tie."""
    sq = squares.detach().double().flatten()
    n = sq.numel()
    if n == 0 or float(sq.mean()) <= tau:
        return math.inf
    values = sq.sort(descending=True).values
    # mean of the tokens left after masking the k largest, k = 1..n (the last one: none left)
    left = values.sum() - values.cumsum(0)
    count = torch.arange(n - 1, -1, -1, device=sq.device, dtype=sq.dtype)
    mean_left = torch.where(count > 0, left / count.clamp(min=1.0), torch.zeros_like(left))
    k = int(torch.nonzero(mean_left <= tau)[0]) + 1
    return float(values[k - 1])


def m2po_mask(log_r: Tensor, valid: Tensor, tau: float, cut: float | None = None) -> Tensor:
    """M2PO's mask: among `valid` tokens, those with (log r)^2 >= `cut`, by default the cut
    of these tokens alone (`m2po_cut`). Boolean, True where masked."""
    sq = log_r.detach().double().square()
    if cut is None:
        cut = m2po_cut(sq[valid], tau)
    return valid & (sq >= cut)


def off_policy_masks(
    log_r: Tensor, cfg: LossConfig, mask: Tensor | None, step_cut: float | None = None
) -> tuple[Tensor | None, Tensor | None]:
    """(outside ratio_band, masked by M2PO) for r = exp(log_r); None where off. `step_cut`:
    M2PO's cut over the whole step (`m2po_cut` of every micro-batch); None: these tokens'."""
    band = m2 = None
    valid = torch.ones_like(log_r, dtype=torch.bool) if mask is None else mask.bool()
    if cfg.ratio_band is not None:
        low, high = cfg.ratio_band
        r = log_r.detach().exp()
        band = (r < low) | (r > high)
        valid = valid & ~band
    if cfg.m2po_tau is not None:
        m2 = m2po_mask(log_r, valid, cfg.m2po_tau, step_cut)
    return band, m2


def m2po_squares(log_r: Tensor, cfg: LossConfig, mask: Tensor | None) -> Tensor:
    """(log r)^2 of the tokens M2PO chooses among (trained, inside the band), flat, fp64."""
    valid = torch.ones_like(log_r, dtype=torch.bool) if mask is None else mask.bool()
    if cfg.ratio_band is not None:
        r = log_r.detach().exp()
        valid = valid & (r >= cfg.ratio_band[0]) & (r <= cfg.ratio_band[1])
    return log_r.detach().double().square()[valid]


def token_losses(
    logp: Tensor,
    behaviour_logp: Tensor,
    adv: Tensor,
    cfg: LossConfig,
    *,
    proximal_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    mask: Tensor | None = None,
    step_cut: float | None = None,
) -> TokenLosses:
    """Per-token loss of the configured kind (see the module docstring); same shapes in and out."""
    behaviour_logp = behaviour_logp.to(logp.dtype)
    adv = adv.to(logp.dtype)
    prox = logp.detach() if proximal_logp is None else proximal_logp.to(logp.dtype).detach()
    if cfg.kind == "tis":
        ratio = (logp - behaviour_logp).exp()
        weight, capped = capped_weight(logp - behaviour_logp, cfg.behaviour_cap, cfg.behaviour_mode)
        policy = -weight * adv * logp
        clip_active = dual_active = torch.zeros_like(capped)
    else:
        base = behaviour_logp if cfg.kind == "ppo" else prox
        ratio = (logp - base).exp()
        policy, clip_active, dual_active = clipped_surrogate(
            ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip
        )
        if cfg.kind == "decoupled":
            weight, capped = capped_weight(
                prox - behaviour_logp, cfg.behaviour_cap, cfg.behaviour_mode
            )
            policy = weight * policy
        else:
            weight, capped = torch.ones_like(ratio).detach(), torch.zeros_like(clip_active)
    # IcePop's band and M2PO's bound on r = trainer / behaviour (train vs inference, plus
    # staleness): a masked token keeps its place in the normaliser but gets no policy gradient.
    band, m2 = off_policy_masks(prox - behaviour_logp, cfg, mask, step_cut)
    for dropped in (band, m2):
        if dropped is not None:
            policy = torch.where(dropped, torch.zeros_like(policy), policy)
    loss = policy
    kl = None
    if ref_logp is not None and cfg.kl_coef > 0:
        kl = kl_penalty(logp, ref_logp.to(logp.dtype).detach(), cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * entropy
    return TokenLosses(
        loss=loss,
        policy=policy.detach(),
        ratio=ratio.detach(),
        clipped=clip_active,
        dual_clipped=dual_active,
        behaviour_weight=weight,
        capped=capped,
        kl=None if kl is None else kl.detach(),
        entropy=None if entropy is None else entropy.detach(),
        band_masked=band,
        m2po_masked=m2,
    )


def aggregate(
    loss_BT: Tensor, mask_BT: Tensor, mode: str, num_tokens: int, num_sequences: int
) -> Tensor:
    """The micro-batch's share of the step loss; `num_*` count the whole step."""
    mask = mask_BT.to(loss_BT.dtype)
    # Selected, not multiplied: an inf at a masked position (prompt, tool output, padding)
    # would make inf * 0 = NaN of the whole step.
    kept_BT = torch.where(mask_BT.bool(), loss_BT, torch.zeros_like(loss_BT))
    if mode == "token":
        return kept_BT.sum() / max(num_tokens, 1)
    per_row = kept_BT.sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_row.sum() / max(num_sequences, 1)


def staleness_score(kl: float, iw_variance: float, version_gap: float) -> float:
    """Flux's combined staleness in [0, 1]."""
    terms = ((0.4, kl, 0.1), (0.3, iw_variance, 2.0), (0.3, version_gap, 5.0))
    return sum(w * min(1.0, max(0.0, x) / scale) for w, x, scale in terms)


@dataclass
class StalenessMetrics:
    """Staleness of one step's trained tokens."""

    version_gap_max: int
    version_gap_mean: float
    kl_behaviour_current: float
    importance_weight_mean: float
    importance_weight_variance: float
    score: float
    num_tokens: int


class StalenessAccumulator:
    """Sums over micro-batches (and, through `sums`, ranks) of the staleness signals."""

    def __init__(self) -> None:
        self.sums = torch.zeros(5, dtype=torch.float64)  # n, Σr, Σr², Σk3, Σgap
        self.max_gap = torch.zeros(1, dtype=torch.float64)

    @torch.no_grad()
    def add(
        self, logp: Tensor, behaviour_logp: Tensor, versions: Tensor, mask: Tensor, version: int
    ) -> None:
        m = mask.bool()
        log_r = (logp.detach().double() - behaviour_logp.double())[m]
        r = log_r.exp()
        gap = (version - versions[m]).double()
        n = float(m.sum())
        k3 = (r - 1.0 - log_r).sum()
        self.sums += torch.stack(
            (torch.tensor(n, dtype=torch.float64), r.sum(), r.square().sum(), k3, gap.sum())
        )
        if gap.numel():
            self.max_gap = torch.maximum(self.max_gap, gap.max().reshape(1))

    def finish(self) -> StalenessMetrics:
        n, s_r, s_r2, s_kl, s_gap = (float(x) for x in self.sums)
        d = max(n, 1.0)
        mean_r = s_r / d if n else 1.0
        var = max(s_r2 / d - mean_r * mean_r, 0.0) if n else 0.0
        kl, gap_mean = s_kl / d, s_gap / d
        gap_max = int(self.max_gap.item())
        return StalenessMetrics(
            version_gap_max=gap_max,
            version_gap_mean=gap_mean,
            kl_behaviour_current=kl,
            importance_weight_mean=mean_r,
            importance_weight_variance=var,
            score=staleness_score(kl, var, gap_mean),
            num_tokens=int(n),
        )
