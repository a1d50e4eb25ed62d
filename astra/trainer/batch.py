"""Turns a fetched batch (Trajectory protos, advantages filled in) into training tensors.

One `SequenceSample` per sequence of the trained policy, shifted for next-token
prediction: position t predicts token t+1, so inputs are token_ids[:-1] and
targets, loss mask, behaviour log-probs and versions are the arrays' [1:].
The trajectory's advantage is broadcast over its tokens. A batch that breaks
the contract (array lengths, non-finite reward, advantage or log-prob, another
policy, a token out of the vocabulary, a trained token without a version) is
refused whole with `BatchRejected(reason)`; the caller counts it and skips the
step. Packing groups sequences into right-padded micro-batches by padded token
count; `split_for_ranks` balances tokens across ranks. Never touches a model.

Legend: B rows (sequences), L longest row of a micro-batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from astra.common.arrays import Malformed, from_array
from astra.common.v1 import rollout_pb2


class BatchRejected(Exception):
    """A batch that must not be trained on; `reason` is an UPPER_SNAKE code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class SequenceSample:
    """One trained sequence, shifted: every tensor has length T - 1."""

    trajectory_id: str
    input_ids: Tensor  # int64
    targets: Tensor  # int64
    loss_mask: Tensor  # bool
    behaviour_logprobs: Tensor  # float32
    advantages: Tensor  # float32
    versions: Tensor  # int64; -1 where not generated

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class TrainBatch:
    sequences: list[SequenceSample]
    num_trajectories: int

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def num_sequences(self) -> int:
        """Sequences with at least one trained token (the sequence-mean normaliser)."""
        return sum(1 for s in self.sequences if s.num_tokens)


@dataclass
class MicroBatch:
    """Right-padded [B, L] tensors; padding has loss mask 0."""

    input_ids: Tensor
    targets: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    versions: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


def _normalised(rewards: np.ndarray, keys: list, std_normalize: bool, eps: float) -> np.ndarray:
    """Each reward centred (and divided by std + eps) over the rewards sharing its key."""
    members: dict[object, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        members[key].append(i)
    out = np.zeros_like(rewards)
    for idx in members.values():
        r = rewards[idx]
        if r.max() == r.min():
            continue  # equal rewards carry no signal: exactly 0 (with eps 0, not 0/0 or +-1)
        centred = r - r.mean()
        out[idx] = centred / (r.std() + eps) if std_normalize else centred
    return out


def _reward(t: rollout_pb2.Trajectory) -> float:
    """Reward a recomputed advantage uses: in a multi-agent episode the mean of its agents'
    sequence rewards (a multi-policy episode reaches a trainer holding only its policy's)."""
    agent = [s.reward for s in t.sequences if s.agent_id]
    return sum(agent) / len(agent) if agent else t.reward


def recompute_advantages(
    trajectories: Sequence[rollout_pb2.Trajectory], mode: str, std_normalize: bool, eps: float
) -> list[float]:
    """Group- or batch-relative advantages from rewards, as Dataflow computes them."""
    rewards = np.array([_reward(t) for t in trajectories], dtype=np.float64)
    keys = [t.group_id if mode == "group" else "" for t in trajectories]
    return [float(a) for a in _normalised(rewards, keys, std_normalize, eps)]


def agent_advantages(
    trajectories: Sequence[rollout_pb2.Trajectory], scope: str, std_normalize: bool, eps: float
) -> dict[tuple[int, int], float]:
    """(trajectory, sequence) -> advantage, for episodes in which this policy plays several
    agents: each agent credited with its own reward (the mean of its sequences' rewards),
    normalised over the same agent's episodes in the group (or the batch), as two policies
    would each be. Episodes with one agent (or none) are not in the result."""
    cells: list[tuple[int, str, str]] = []  # (trajectory, agent, group key)
    rewards: list[float] = []
    for i, t in enumerate(trajectories):
        by_agent: dict[str, list[float]] = defaultdict(list)
        for s in t.sequences:
            by_agent[s.agent_id].append(s.reward)
        if len(by_agent) < 2:
            continue
        for agent, rs in by_agent.items():
            cells.append((i, agent, t.group_id if scope == "group" else ""))
            rewards.append(sum(rs) / len(rs))
    if not cells:
        return {}
    keys = [(g, agent) for _, agent, g in cells]
    advs = _normalised(np.array(rewards, dtype=np.float64), keys, std_normalize, eps)
    per_agent = {(i, agent): float(a) for (i, agent, _), a in zip(cells, advs, strict=True)}
    return {
        (i, j): per_agent[(i, s.agent_id)]
        for i, t in enumerate(trajectories)
        for j, s in enumerate(t.sequences)
        if (i, s.agent_id) in per_agent
    }


def _sequence(
    s: rollout_pb2.Sequence, tid: str, adv: float, vocab_size: int, max_len: int
) -> SequenceSample:
    where = f"trajectory {tid!r}"
    try:
        ids = from_array(s.token_ids, "token_ids").astype(np.int64)
        lp = from_array(s.logprobs, "logprobs").astype(np.float32)
        mask = from_array(s.loss_mask, "loss_mask").astype(bool)
        ver = from_array(s.weight_versions, "weight_versions").astype(np.int64)
    except Malformed as exc:
        raise BatchRejected("MALFORMED_ARRAY", f"{where}: {exc}") from exc
    if any(a.ndim != 1 for a in (ids, lp, mask, ver)) or not (
        len(ids) == len(lp) == len(mask) == len(ver)
    ):
        lens = [len(a.reshape(-1)) for a in (ids, lp, mask, ver)]
        raise BatchRejected("LENGTH_MISMATCH", f"{where}: array lengths {lens}")
    if len(ids) > max_len:
        raise BatchRejected("SEQUENCE_TOO_LONG", f"{where}: {len(ids)} tokens > {max_len}")
    if not np.isfinite(lp).all():
        raise BatchRejected("NAN_LOGPROB", f"{where}: non-finite log-prob")
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise BatchRejected("TOKEN_OUT_OF_RANGE", f"{where}: token id outside [0, {vocab_size})")
    if (mask & (ver < 0)).any():
        raise BatchRejected("UNVERSIONED_TOKEN", f"{where}: trained token with version -1")
    shifted = max(len(ids) - 1, 0)
    return SequenceSample(
        trajectory_id=tid,
        input_ids=torch.from_numpy(ids[:-1].copy())
        if shifted
        else torch.zeros(0, dtype=torch.long),
        targets=torch.from_numpy(ids[1:].copy()),
        loss_mask=torch.from_numpy(mask[1:].copy()),
        behaviour_logprobs=torch.from_numpy(lp[1:].copy()),
        advantages=torch.full((shifted,), adv, dtype=torch.float32),
        versions=torch.from_numpy(ver[1:].copy()),
    )


def build_batch(
    trajectories: Sequence[rollout_pb2.Trajectory],
    policy_id: str,
    *,
    vocab_size: int,
    max_seq_len: int,
    advantages: str = "dataflow",
    std_normalize: bool = True,
    adv_eps: float = 1e-6,
) -> TrainBatch:
    """Validated, shifted sequences of `policy_id`; raises BatchRejected."""
    for t in trajectories:
        where = f"trajectory {t.trajectory_id!r}"
        if t.HasField("error") and t.error.code:
            raise BatchRejected("TRAJECTORY_ERROR", f"{where} carries an error")
        if not math.isfinite(t.reward) or any(not math.isfinite(s.reward) for s in t.sequences):
            raise BatchRejected("NAN_REWARD", f"{where}: non-finite reward")
        if not math.isfinite(t.advantage):
            raise BatchRejected("NAN_ADVANTAGE", f"{where}: non-finite advantage")
        for s in t.sequences:
            if s.policy_id != policy_id:
                raise BatchRejected("WRONG_POLICY", f"{where}: sequence of {s.policy_id!r}")
    if advantages == "dataflow":
        advs = [t.advantage for t in trajectories]
    else:
        advs = recompute_advantages(trajectories, advantages, std_normalize, adv_eps)
    # Dataflow stamps one advantage per trajectory: an episode in which this policy plays
    # several agents gets each agent's own, computed here (group-relative under "dataflow").
    scope = "group" if advantages == "dataflow" else advantages
    per_agent = agent_advantages(trajectories, scope, std_normalize, adv_eps)
    sequences = [
        _sequence(s, t.trajectory_id, per_agent.get((i, j), adv), vocab_size, max_seq_len)
        for i, (t, adv) in enumerate(zip(trajectories, advs, strict=True))
        for j, s in enumerate(t.sequences)
    ]
    batch = TrainBatch([s for s in sequences if s.length > 0], len(trajectories))
    if batch.num_tokens == 0:
        raise BatchRejected("EMPTY_BATCH", f"{len(trajectories)} trajectories, no trained token")
    return batch


def split_for_ranks(sequences: Sequence[SequenceSample], world_size: int) -> list[list[int]]:
    """Sequence indices per rank, longest first to the rank with the fewest tokens so far."""
    order = sorted(range(len(sequences)), key=lambda i: (-sequences[i].length, i))
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        ranks[r].append(i)
        load[r] += sequences[i].length
    return [sorted(r) for r in ranks]


def pack(sequences: Sequence[SequenceSample], max_tokens: int) -> list[list[int]]:
    """Bins of indices whose padded size (rows x longest) stays within max_tokens.

    Longest first, so a bin's first sequence fixes its width; a sequence longer
    than max_tokens gets a bin of its own.
    """
    order = sorted(range(len(sequences)), key=lambda i: (-sequences[i].length, i))
    bins: list[list[int]] = []
    for i in order:
        if bins and (len(bins[-1]) + 1) * sequences[bins[-1][0]].length <= max_tokens:
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def collate(sequences: Sequence[SequenceSample]) -> MicroBatch:
    """Right-pads sequences into one micro-batch (ids 0, mask 0 in the padding)."""
    L = max(s.length for s in sequences)

    def stack(field: str, dtype: torch.dtype) -> Tensor:
        out = torch.zeros(len(sequences), L, dtype=dtype)
        for row, s in enumerate(sequences):
            out[row, : s.length] = getattr(s, field)
        return out

    return MicroBatch(
        input_ids=stack("input_ids", torch.long),
        targets=stack("targets", torch.long),
        loss_mask=stack("loss_mask", torch.bool),
        behaviour_logprobs=stack("behaviour_logprobs", torch.float32),
        advantages=stack("advantages", torch.float32),
        versions=stack("versions", torch.long),
    )


def empty_microbatch() -> MicroBatch:
    """A one-token micro-batch with nothing trained: keeps ranks' collectives in step."""
    z = torch.zeros(1, 1, dtype=torch.long)
    return MicroBatch(z, z, z.bool(), z.float(), z.float(), z.clone())


def plan_microbatches(
    batch: TrainBatch, rank: int, world_size: int, max_tokens: int
) -> list[MicroBatch]:
    """This rank's micro-batches, padded with empty ones to the busiest rank's count."""
    shares = split_for_ranks(batch.sequences, world_size)
    counts = [len(pack([batch.sequences[i] for i in share], max_tokens)) for share in shares]
    mine = [batch.sequences[i] for i in shares[rank]]
    micro = [collate([mine[i] for i in b]) for b in pack(mine, max_tokens)]
    return micro + [empty_microbatch() for _ in range(max(counts) - len(micro))]
