"""Synthetic batches for tests, benchmarks and custom loops, with an in-memory source and sink.

`SyntheticSource` is a BatchSource whose batch for a request id is a pure
function of (seed, request id) — like Dataflow, a retried id returns the same
batch, and two runs asking the same ids train on the same data. `MemorySink`
is a WeightSink that keeps every published version's bytes. Neither touches
the network.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from astra.common.arrays import to_array
from astra.common.v1 import rollout_pb2
from astra.trainer.sources import BatchNotReady, FetchedBatch


def make_sequence(
    policy_id: str,
    token_ids: Sequence[int],
    prompt_length: int,
    *,
    logprobs: Sequence[float] | None = None,
    versions: Sequence[int] | int = 0,
    reward: float = 0.0,
) -> rollout_pb2.Sequence:
    """A Sequence whose tokens after the prompt are generated and trained on."""
    T = len(token_ids)
    gen = np.arange(T) >= prompt_length
    lp = np.zeros(T, np.float32) if logprobs is None else np.asarray(logprobs, np.float32)
    ver = np.full(T, versions, np.int64) if isinstance(versions, int) else np.asarray(versions)
    return rollout_pb2.Sequence(
        policy_id=policy_id,
        prompt_length=prompt_length,
        token_ids=to_array(np.asarray(token_ids, np.int32)),
        logprobs=to_array(np.where(gen, lp, 0.0).astype(np.float32)),
        loss_mask=to_array(gen.astype(np.uint8)),
        weight_versions=to_array(np.where(gen, ver, -1).astype(np.int64)),
        finish_reason=rollout_pb2.FINISH_REASON_STOP,
        reward=reward,
    )


def make_trajectory(
    group_id: str,
    index: int,
    sequences: Sequence[rollout_pb2.Sequence],
    reward: float,
    advantage: float,
) -> rollout_pb2.Trajectory:
    return rollout_pb2.Trajectory(
        trajectory_id=f"{group_id}/{index}",
        group_id=group_id,
        sample_index=index,
        sequences=list(sequences),
        reward=reward,
        advantage=advantage,
    )


def random_group(
    rng: np.random.Generator,
    policy_id: str,
    group_id: str,
    *,
    vocab_size: int,
    group_size: int,
    prompt_len: int,
    max_new: int,
    version: int,
    max_lag: int = 0,
) -> list[rollout_pb2.Trajectory]:
    """One prompt group: shared prompt, random continuations, group-normalised advantages."""
    prompt = rng.integers(0, vocab_size, prompt_len).tolist()
    rewards = rng.random(group_size)
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    out = []
    for i in range(group_size):
        n = int(rng.integers(1, max_new + 1))
        tokens = prompt + rng.integers(0, vocab_size, n).tolist()
        lp = np.concatenate([np.zeros(prompt_len), -rng.uniform(0.5, 6.0, n)])
        lag = rng.integers(0, max_lag + 1, len(tokens))
        seq = make_sequence(
            policy_id, tokens, prompt_len, logprobs=lp, versions=np.maximum(version - lag, 0)
        )
        out.append(make_trajectory(group_id, i, [seq], float(rewards[i]), float(adv[i])))
    return out


class SyntheticSource:
    """A BatchSource of seeded random groups; records acks and announcements."""

    def __init__(
        self,
        policy_id: str,
        *,
        vocab_size: int,
        seed: int = 0,
        group_size: int = 4,
        prompt_len: int = 4,
        max_new: int = 8,
        max_lag: int = 0,
        mutate: Callable[[str, list[rollout_pb2.Trajectory]], None] | None = None,
    ) -> None:
        self.policy_id, self.vocab_size, self.seed = policy_id, vocab_size, seed
        self.group_size, self.prompt_len, self.max_new = group_size, prompt_len, max_new
        self.max_lag, self.mutate = max_lag, mutate
        self.version = 0
        self.batches: dict[str, FetchedBatch] = {}
        self.acked: list[str] = []
        self.untrained: dict[str, str] = {}  # batch id -> why no step was taken on it
        self.announced: list[tuple[int, str]] = []
        self.not_ready = 0  # answer BatchNotReady this many more times

    async def fetch(
        self, request_id: str, num_groups: int, trainer_version: int = 0
    ) -> FetchedBatch:
        if self.not_ready > 0:
            self.not_ready -= 1
            raise BatchNotReady("synthetic: not ready")
        if request_id not in self.batches:
            rng = np.random.default_rng([self.seed, zlib.crc32(request_id.encode())])
            trajectories = [
                t
                for g in range(num_groups)
                for t in random_group(
                    rng,
                    self.policy_id,
                    f"{request_id}/{g}",
                    vocab_size=self.vocab_size,
                    group_size=self.group_size,
                    prompt_len=self.prompt_len,
                    max_new=self.max_new,
                    version=self.version,
                    max_lag=self.max_lag,
                )
            ]
            if self.mutate is not None:
                self.mutate(request_id, trajectories)
            self.batches[request_id] = FetchedBatch(f"b-{request_id}", self.version, trajectories)
        return self.batches[request_id]

    async def ack(self, batch_id: str, untrained_reason: str = "") -> None:
        self.acked.append(batch_id)
        if untrained_reason:
            self.untrained[batch_id] = untrained_reason

    async def current_version(self) -> int | None:
        return self.version

    async def announce(
        self, version: int, identity: str, resumed: bool = False, resumed_from: int | None = None
    ) -> None:
        if version not in (self.version, self.version + 1):
            raise ValueError(f"version {version} after {self.version}")
        self.version = version
        self.announced.append((version, identity))

    async def close(self) -> None:
        pass


class MemorySink:
    """A WeightSink keeping each version's raw tensors as bytes."""

    def __init__(self) -> None:
        self.versions: dict[int, dict[str, tuple[str, tuple, bytes]]] = {}

    async def latest_version(self) -> int | None:
        return max(self.versions) if self.versions else None

    async def publish(
        self, version: int, identity: str, tensors: Mapping[str, tuple[str, tuple, Any]]
    ) -> None:
        self.versions[version] = {n: (d, tuple(s), bytes(b)) for n, (d, s, b) in tensors.items()}

    async def close(self) -> None:
        pass
