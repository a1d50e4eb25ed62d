"""Every trainer loss against values worked out by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from astra.trainer.config import LossConfig
from astra.trainer.losses import (
    StalenessAccumulator,
    aggregate,
    clipped_surrogate,
    kl_penalty,
    m2po_cut,
    m2po_mask,
    staleness_score,
    token_losses,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def lg(*probs: float) -> torch.Tensor:
    return t(*probs).log()


def close(a: torch.Tensor, b: torch.Tensor | list[float]) -> None:
    torch.testing.assert_close(
        a.double(), torch.as_tensor(b, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_clipped_surrogate_separate_low_and_high_clip_and_dual_clip() -> None:
    ratio, adv = t(0.5, 1.5, 0.5, 2.0, 1.0), t(1, 1, -1, -1, 2)
    # r=0.5,A=1: max(-0.5, -0.8) = -0.5; r=1.5,A=1: max(-1.5, -1.3) = -1.3 (clipped high at 1.3);
    # r=0.5,A=-1: max(0.5, 0.8) = 0.8 (clipped low at 0.8); r=2,A=-1: 2.0; r=1,A=2: -2.
    loss, clipped, dual = clipped_surrogate(ratio, adv, 0.2, 0.3, None)
    close(loss, [-0.5, -1.3, 0.8, 2.0, -2.0])
    assert clipped.tolist() == [False, True, True, False, False] and not dual.any()
    loss, _, dual = clipped_surrogate(ratio, adv, 0.2, 0.3, 1.8)  # -A*c = 1.8 bounds the 2.0
    close(loss, [-0.5, -1.3, 0.8, 1.8, -2.0])
    assert dual.tolist() == [False, False, False, True, False]


def test_ppo_ratio_is_against_behaviour_and_clipped_tokens_have_no_gradient() -> None:
    cfg = LossConfig(kind="ppo", clip_low=0.2, clip_high=0.3)
    logp = lg(0.5, 0.6).requires_grad_()
    out = token_losses(logp, lg(1.0, 0.4), t(1.0, 1.0), cfg)  # r = 0.5, 1.5
    close(out.loss.detach(), [-0.5, -1.3])
    out.loss.sum().backward()
    close(logp.grad, [-0.5, 0.0])  # d(-A r)/dlogp = -A r; clipped: 0


def test_decoupled_weight_is_proximal_over_behaviour_truncated_or_masked() -> None:
    logp = lg(0.5, 0.4).requires_grad_()
    mu = lg(0.25, 0.05)  # w = 2, 8
    out = token_losses(logp, mu, t(1.0, 1.0), LossConfig(behaviour_cap=5.0))
    close(out.loss.detach(), [-2.0, -5.0])  # r = 1 (proximal = current), w truncated to 5
    assert out.capped.tolist() == [False, True]
    out.loss.sum().backward()
    close(logp.grad, [-2.0, -5.0])
    masked = token_losses(logp, mu, t(1.0, 1.0), LossConfig(behaviour_mode="mask"))
    close(masked.loss.detach(), [-2.0, 0.0])
    # An explicit proximal policy: r = 0.6 / 0.5 = 1.2 (inside 1 + 0.28), w = 0.5 / 0.25 = 2.
    out = token_losses(lg(0.6), lg(0.25), t(1.0), LossConfig(), proximal_logp=lg(0.5))
    close(out.loss, [-2.4])
    close(out.ratio, [1.2])


def test_truncated_importance_sampling() -> None:
    logp = lg(0.5).requires_grad_()
    out = token_losses(logp, lg(0.1), t(1.5), LossConfig(kind="tis", behaviour_cap=2.0))
    close(out.loss.detach(), [-2.0 * 1.5 * math.log(0.5)])  # weight min(5, 2) = 2
    out.loss.sum().backward()
    close(logp.grad, [-3.0])


def test_truncated_importance_sampling_can_mask_instead() -> None:
    logp = lg(0.5).requires_grad_()
    cfg = LossConfig(kind="tis", behaviour_cap=2.0, behaviour_mode="mask")
    out = token_losses(logp, lg(0.1), t(1.5), cfg)  # weight 5 > 2: the token is dropped
    out.loss.sum().backward()
    assert float(out.loss.detach()) == 0.0 and float(logp.grad) == 0.0 and bool(out.capped)


def test_a_masked_position_cannot_make_the_step_nan() -> None:
    # A prompt position (m = 0) where the policy is 93 nats less sure than the reference: k3
    # would be exp(93) = inf there, and inf * 0 = NaN in the loss and in every gradient.
    logp = torch.tensor([[-95.0, -1.0, -0.5]], requires_grad=True)
    ref, behaviour = torch.tensor([[-2.0, -1.0, -0.6]]), torch.tensor([[0.0, -1.1, -0.4]])
    cfg = LossConfig(kind="decoupled", kl_coef=0.01, kl_estimator="k3")
    out = token_losses(logp, behaviour, torch.full((1, 3), 0.7), cfg, ref_logp=ref)
    mask = torch.tensor([[False, True, True]])
    for mode in ("token", "sequence"):
        logp.grad = None
        loss = aggregate(out.loss, mask, mode, num_tokens=2, num_sequences=1)
        loss.backward(retain_graph=True)
        assert math.isfinite(float(loss.detach())) and torch.isfinite(logp.grad).all()
        assert float(logp.grad[0, 0]) == 0.0  # the masked position trains nothing
    assert float(kl_penalty(t(-95.0), t(-2.0), "k3")) == 10.0  # clamped as verl clamps


def test_kl_estimators_and_entropy_bonus() -> None:
    logp, ref = lg(0.5), lg(0.25)
    d = math.log(0.5)  # ref - logp
    close(kl_penalty(logp, ref, "k1"), [-d])
    close(kl_penalty(logp, ref, "k2"), [0.5 * d * d])
    close(kl_penalty(logp, ref, "k3"), [math.exp(d) - d - 1])
    cfg = LossConfig(kind="ppo", kl_coef=0.1, entropy_coef=0.01)
    out = token_losses(logp, logp, t(1.0), cfg, ref_logp=ref, entropy=t(2.0))
    close(out.loss, [-1.0 + 0.1 * (math.exp(d) - d - 1) - 0.01 * 2.0])


def test_token_and_sequence_aggregation_use_step_wide_normalisers() -> None:
    loss = t(1, 2, 3, 4, 5, 6).reshape(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    close(aggregate(loss, mask, "token", 3, 2), 7 / 3)
    close(aggregate(loss, mask, "token", 6, 2), 7 / 6)  # other micro-batches hold 3 more tokens
    close(aggregate(loss, mask, "sequence", 3, 2), (1.5 + 4.0) / 2)
    close(aggregate(loss, mask, "sequence", 3, 4), (1.5 + 4.0) / 4)


def test_staleness_signals() -> None:
    acc = StalenessAccumulator()
    logp, mu = lg(0.5, 0.5, 0.2), lg(0.5, 0.25, 0.4)  # r = 1, 2, 0.5
    versions = torch.tensor([3, 2, 1])
    acc.add(logp[:2], mu[:2], versions[:2], torch.ones(2, dtype=torch.bool), 4)
    acc.add(logp[2:], mu[2:], versions[2:], torch.ones(1, dtype=torch.bool), 4)
    acc.add(logp, mu, versions, torch.zeros(3, dtype=torch.bool), 4)  # nothing trained
    m = acc.finish()
    assert m.num_tokens == 3 and m.version_gap_max == 3
    assert m.version_gap_mean == pytest.approx(2.0)
    assert m.importance_weight_mean == pytest.approx(3.5 / 3)
    assert m.importance_weight_variance == pytest.approx(5.25 / 3 - (3.5 / 3) ** 2)
    kl = (0 + (1 - math.log(2)) + (-0.5 + math.log(2))) / 3
    assert m.kl_behaviour_current == pytest.approx(kl)
    assert m.score == pytest.approx(0.4 * 1 + 0.3 * m.importance_weight_variance / 2 + 0.3 * 2 / 5)
    assert staleness_score(0.0, 0.0, 0.0) == 0.0 and staleness_score(1, 10, 10) == 1.0


def test_on_policy_tokens_are_not_stale() -> None:
    acc = StalenessAccumulator()
    logp = lg(0.3, 0.7)
    acc.add(logp, logp, torch.tensor([5, 5]), torch.ones(2, dtype=torch.bool), 5)
    m = acc.finish()
    assert (m.version_gap_max, m.kl_behaviour_current, m.importance_weight_variance) == (0, 0, 0)
    assert m.score == 0.0


def test_m2po_masks_the_fewest_largest_squared_log_ratios() -> None:
    log_r = t(0.1, -0.5, 0.3, 0.0, 1.0)  # (log r)^2 = .01 .25 .09 0 1, mean 1.35 / 5 = .27
    every = torch.ones(5, dtype=torch.bool)
    assert m2po_mask(log_r, every, 0.3).tolist() == [False] * 5  # .27 <= .3: nothing
    # tau .1: without the 1.0 the mean is .35 / 4 = .0875 <= .1: one token masked
    assert m2po_mask(log_r, every, 0.1).tolist() == [False, False, False, False, True]
    # tau .05: .0875 > .05; without .25 as well: .10 / 3 = .0333: two masked
    assert m2po_mask(log_r, every, 0.05).tolist() == [False, True, False, False, True]
    # a position that is not trained (prompt, padding) is neither counted nor masked:
    # trained .01 .25 .09 0, mean .0875 > .05; without .25: .0333
    trained = torch.tensor([True, True, True, True, False])
    assert m2po_mask(log_r, trained, 0.05).tolist() == [False, True, False, False, False]


def test_m2po_cuts_over_every_token_it_is_given_not_each_part() -> None:
    # two micro-batches: the second alone has a mean (log r)^2 of .16 / 2 = .08 > .05 and
    # would mask its .16; over the step the mean is .16 / 6 = .027 <= .05: nothing is masked
    first, second = t(0.0, 0.0, 0.0, 0.0), t(0.4, 0.0)
    assert m2po_mask(second, torch.ones(2, dtype=torch.bool), 0.05).tolist() == [True, False]
    cut = m2po_cut(torch.cat([first, second]).double().square(), 0.05)
    assert cut == math.inf
    assert not m2po_mask(second, torch.ones(2, dtype=torch.bool), 0.05, cut).any()
    # with tau .02 the step masks the .16 (the rest: 0 <= .02): the cut is .16
    assert m2po_cut(torch.cat([first, second]).double().square(), 0.02) == pytest.approx(0.16)
    assert m2po_cut(t(0.1, 0.0).double().square(), 0.05) == math.inf  # nothing to mask
    # ties at the cut are masked together: the rest's mean stays <= tau
    assert m2po_mask(t(1.0, -1.0, 0.0, 0.0), torch.ones(4, dtype=torch.bool), 0.3).sum() == 2


def test_m2po_and_the_ratio_band_zero_the_policy_term_of_the_tokens_they_mask() -> None:
    logp = lg(0.5, 0.5, 0.5, 0.5).requires_grad_()
    mu = lg(1.25, 0.5, 0.2, 0.8333333333333334)  # r_b = p / mu = 0.4, 1.0, 2.5, 0.6
    adv = t(1.0, 1.0, 1.0, 1.0)
    plain = token_losses(logp, mu, adv, LossConfig(kind="tis", behaviour_cap=None))
    close(plain.loss.detach(), [-0.4 * math.log(0.5), -math.log(0.5), -2.5 * math.log(0.5),
                                -0.6 * math.log(0.5)])  # fmt: skip
    band = token_losses(
        logp, mu, adv, LossConfig(kind="tis", behaviour_cap=None, ratio_band=(0.5, 2.0))
    )
    assert band.band_masked.tolist() == [True, False, True, False]
    close(band.loss.detach(), [0.0, -math.log(0.5), 0.0, -0.6 * math.log(0.5)])
    band.loss.sum().backward()
    assert logp.grad[0] == 0 and logp.grad[2] == 0 and logp.grad[1] != 0
    # M2PO after the band: the kept tokens' (log r_b)^2 = 0 and log(.6)^2 = .2609, mean .1305;
    # tau .1: masking .2609 leaves 0 <= .1
    both = token_losses(
        logp.detach(), mu, adv,
        LossConfig(kind="tis", behaviour_cap=None, ratio_band=(0.5, 2.0), m2po_tau=0.1),
    )  # fmt: skip
    assert both.m2po_masked.tolist() == [False, False, False, True]
    close(both.loss, [0.0, -math.log(0.5), 0.0, 0.0])


@pytest.mark.parametrize(
    ("key", "value"), [("ratio_band", (1.2, 3.0)), ("ratio_band", (0.5, 0.9)), ("m2po_tau", 0.0)]
)
def test_bad_off_policy_masks_are_refused_naming_the_key(key, value) -> None:
    with pytest.raises(ValueError, match=key):
        LossConfig(**{key: value})


def test_a_step_masks_the_same_tokens_however_it_is_split_into_micro_batches() -> None:
    """M2PO's cut is over the whole step: packing the batch into more micro-batches changes
    neither the tokens masked nor the step taken."""
    from astra.trainer.config import TrainerConfig
    from astra.trainer.loop import Trainer
    from astra.trainer.synthetic import MemorySink, SyntheticSource

    def run(max_tokens: int) -> dict[str, float]:
        torch.manual_seed(0)
        cfg = TrainerConfig.model_validate(
            {
                "policy_id": "p",
                "port": None,
                "optim": {"lr": 1e-2},
                "loss": {"kind": "tis", "behaviour_cap": None, "m2po_tau": 0.5},
                "batch": {"num_groups": 4, "max_tokens_per_microbatch": max_tokens},
            }
        )
        source = SyntheticSource("p", vocab_size=100, max_lag=1, seed=3)
        trainer = Trainer(cfg, source=source, sink=MemorySink())
        (step,) = list(trainer.run_training(1))
        assert (step.training_result.num_microbatches > 1) == (max_tokens < 1000)
        trainer.close()
        return step.training_result.metrics

    whole, split = run(10_000), run(12)
    assert 0.0 < whole["m2po_masked_fraction"] < 1.0  # the bound binds, not on every token
    for key in ("m2po_masked_fraction", "loss", "policy_loss", "grad_norm"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5), key
