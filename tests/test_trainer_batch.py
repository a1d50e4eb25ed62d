"""Fetched trajectories -> training tensors: shifting, validation reasons, packing, rank split."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from astra.common.arrays import to_array
from astra.trainer.batch import (
    BatchRejected,
    build_batch,
    collate,
    pack,
    plan_microbatches,
    recompute_advantages,
    split_for_ranks,
)
from astra.trainer.synthetic import make_sequence, make_trajectory

V = 100


def traj(tokens, prompt_len=2, *, adv=0.5, reward=1.0, policy="p", group="g", index=0, lp=None):
    lp = lp if lp is not None else [-0.5] * len(tokens)
    seq = make_sequence(policy, tokens, prompt_len, logprobs=lp, versions=3)
    return make_trajectory(group, index, [seq], reward, adv)


def build(trajectories, **kw):
    return build_batch(trajectories, "p", vocab_size=V, max_seq_len=64, **kw)


def test_sequences_are_shifted_and_the_advantage_broadcast() -> None:
    batch = build([traj([1, 2, 3, 4, 5], lp=[0, 0, -1, -2, -3], adv=0.5)])
    (s,) = batch.sequences
    assert s.input_ids.tolist() == [1, 2, 3, 4] and s.targets.tolist() == [2, 3, 4, 5]
    assert s.loss_mask.tolist() == [False, True, True, True]  # token 2 is prompt
    assert s.behaviour_logprobs.tolist() == [0, -1, -2, -3]
    assert s.advantages.tolist() == [0.5] * 4
    assert s.versions.tolist() == [-1, 3, 3, 3]
    assert (batch.num_tokens, batch.num_sequences, batch.num_trajectories) == (3, 1, 1)


def _break(field: str):
    t = traj([1, 2, 3, 4])
    seq = t.sequences[0]
    if field == "length":
        seq.logprobs.CopyFrom(to_array(np.zeros(3, np.float32)))
    elif field == "nan_logprob":
        seq.logprobs.CopyFrom(to_array(np.array([0, 0, math.nan, -1], np.float32)))
    elif field == "nan_reward":
        t.reward = math.nan
    elif field == "inf_advantage":
        t.advantage = math.inf
    elif field == "policy":
        seq.policy_id = "other"
    elif field == "token":
        seq.token_ids.CopyFrom(to_array(np.array([1, 2, 3, V], np.int32)))
    elif field == "dtype":
        seq.token_ids.dtype = "complex64"
    elif field == "error":
        t.error.code = 13
    elif field == "unversioned":
        seq.weight_versions.CopyFrom(to_array(np.array([-1, -1, -1, 2], np.int64)))
    elif field == "empty":
        seq.loss_mask.CopyFrom(to_array(np.zeros(4, np.uint8)))
    return t


@pytest.mark.parametrize(
    ("field", "reason"),
    [
        ("length", "LENGTH_MISMATCH"),
        ("nan_logprob", "NAN_LOGPROB"),
        ("nan_reward", "NAN_REWARD"),
        ("inf_advantage", "NAN_ADVANTAGE"),
        ("policy", "WRONG_POLICY"),
        ("token", "TOKEN_OUT_OF_RANGE"),
        ("dtype", "MALFORMED_ARRAY"),
        ("error", "TRAJECTORY_ERROR"),
        ("unversioned", "UNVERSIONED_TOKEN"),
    ],
)
def test_a_broken_trajectory_rejects_the_batch_with_its_reason(field: str, reason: str) -> None:
    with pytest.raises(BatchRejected) as exc:
        build([traj([5, 6, 7, 8], group="ok"), _break(field)])
    assert exc.value.reason == reason


def test_a_batch_without_trained_tokens_is_rejected() -> None:
    with pytest.raises(BatchRejected, match="EMPTY_BATCH"):
        build([_break("empty")])


def test_too_long_sequences_are_rejected() -> None:
    with pytest.raises(BatchRejected, match="SEQUENCE_TOO_LONG"):
        build_batch([traj(list(range(10)))], "p", vocab_size=V, max_seq_len=9)


def test_advantages_recomputed_per_group_or_batch() -> None:
    ts = [traj([1, 2, 3], reward=r, group=g, index=i) for i, (g, r) in enumerate(
        [("a", 1.0), ("a", 3.0), ("b", 0.0), ("b", 10.0)]
    )]  # fmt: skip
    group = recompute_advantages(ts, "group", True, 0.0)
    assert group == pytest.approx([-1, 1, -1, 1])
    assert recompute_advantages(ts, "group", False, 0.0) == pytest.approx([-1, 1, -5, 5])
    every = np.array([1.0, 3.0, 0.0, 10.0])
    assert recompute_advantages(ts, "batch", True, 0.0) == pytest.approx(
        (every - every.mean()) / every.std()
    )
    batch = build(ts, advantages="group", adv_eps=0.0)
    assert [s.advantages[0].item() for s in batch.sequences] == pytest.approx([-1, 1, -1, 1])


def _two_agents(index: int, solver: float, verifier: float, adv: float):
    """One policy playing both agents: a solver turn and a verifier turn, each its reward."""
    s = make_sequence("p", [1, 2, 3, 4, 5], 2, logprobs=[-1.0] * 5, reward=solver)
    v = make_sequence("p", [6, 7, 8, 9], 2, logprobs=[-1.0] * 4, reward=verifier)
    s.agent_id, v.agent_id = "solver", "verifier"
    return make_trajectory("g", index, [s, v], reward=solver, advantage=adv)


@pytest.mark.parametrize("mode", ["dataflow", "group", "batch"])
def test_one_policy_playing_two_agents_credits_each_agent_with_its_own_reward(mode: str) -> None:
    # Episode 0: the solver right, the verifier wrong; episode 1 the other way round. The
    # episode's reward (the solver's, which Dataflow's stamp follows) or the agents' mean
    # (0.5 in both: no signal) would reinforce the wrong verdicts.
    ts = [_two_agents(0, 1.0, 0.0, adv=1.0), _two_agents(1, 0.0, 1.0, adv=-1.0)]
    batch = build(ts, advantages=mode, adv_eps=0.0)
    got = [s.advantages[0].item() for s in batch.sequences]  # s0, v0, s1, v1
    assert got == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # One agent per episode: the trajectory's advantage, as before.
    single = [traj([1, 2, 3], adv=0.25, index=0), traj([1, 2, 4], adv=-0.25, index=1)]
    assert [s.advantages[0].item() for s in build(single).sequences] == [0.25, -0.25]


def test_equal_rewards_with_eps_zero_give_zero_advantages_not_nan() -> None:
    same = [traj([1, 2, 3], reward=0.1, index=i) for i in range(3)]  # the mean rounds
    got = [s.advantages[0].item() for s in build(same, advantages="group", adv_eps=0.0).sequences]
    assert got == [0.0, 0.0, 0.0]


def _seqs(lengths):
    return build(
        [traj(list(range(1, n + 2)), prompt_len=1, index=i) for i, n in enumerate(lengths)]
    ).sequences


def test_packing_by_padded_token_count() -> None:
    seqs = _seqs([10, 3, 3, 3, 8])
    assert [s.length for s in seqs] == [10, 3, 3, 3, 8]
    # Longest first: [10] (10+8 rows would pad to 20 > 16), [8, 3] (16), [3, 3, 3] (9).
    assert pack(seqs, 16) == [[0], [4, 1], [2, 3]]
    assert pack(seqs, 4) == [[0], [4], [1], [2], [3]]  # a long one still gets its own bin
    mb = collate([seqs[4], seqs[1]])
    assert mb.input_ids.shape == (2, 8) and mb.loss_mask[1, 3:].sum() == 0
    assert mb.num_tokens == 8 + 3


def test_ranks_get_balanced_shares_and_the_same_number_of_microbatches() -> None:
    batch = build(
        [
            traj(list(range(1, n + 2)), prompt_len=1, index=i)
            for i, n in enumerate([9, 1, 1, 1, 8, 2])
        ]
    )
    shares = split_for_ranks(batch.sequences, 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    loads = [sum(batch.sequences[i].length for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= 2
    plans = [plan_microbatches(batch, r, 2, 9) for r in range(2)]
    assert len(plans[0]) == len(plans[1])
    assert sum(mb.num_tokens for p in plans for mb in p) == batch.num_tokens
    alone = plan_microbatches(batch, 0, 1, 10_000)
    assert len(alone) == 1 and alone[0].num_tokens == batch.num_tokens
    many = plan_microbatches(batch, 2, 3, 4)  # a rank may be padded with empty micro-batches
    assert all(isinstance(mb.input_ids, torch.Tensor) for mb in many)
