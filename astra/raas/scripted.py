"""`ScriptedGenerator`: a deterministic stand-in for an inference engine plus workflow.

It is not a model. It produces token ids, log-probs, masks, versions and
rewards of the right shapes and dtypes from a hash of the group id, sample
index and policy, so tests and benchmarks can drive the whole system (RaaS,
Dataflow, trainer) without weights or a GPU. The same group always yields the
same trajectories; only the weight versions follow what was loaded.

Latency: a fixed `delay_s` per group, and optionally a seeded long-tailed `LatencyModel`
(log-normal seconds per sample; a group is done when its slowest sample is), so benchmarks can
put a realistic rollout-length tail on the critical path without a model.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from astra.raas.backend import GroupSpec, SequenceSpec, TrajectorySpec, VersionSpec

PROMPT_LENGTH = 8
VOCAB_SIZE = 32_000
# Context length, as an engine has one: max_new_tokens is unbounded on the wire, and a sequence
# drawn up to 2**31 tokens long would take the process's memory and event loop.
MAX_SEQ_LEN = 1 << 17
# Success rate of a group's samples, picked per group: 0 and 1 give all-equal rewards.
SUCCESS_RATES = (0.0, 0.25, 0.5, 0.75, 1.0)


def _hash(*parts: object) -> int:
    key = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Per-sample generation time: log-normal, `exp(N(mu, sigma))` seconds.

    The median is `exp(mu)` and the mean `exp(mu + sigma**2 / 2)`. A sample's draw is a pure
    function of (`seed`, group id, group seed, sample index), so the same workload takes the
    same time wherever and whenever it runs. The samples of a group decode side by side and
    the group is returned with its slowest sample, so a group takes the maximum of its draws.
    """

    mu: float
    sigma: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mu) and math.isfinite(self.sigma)) or self.sigma < 0:
            raise ValueError("lognormal latency needs finite mu and sigma >= 0")

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> LatencyModel:
        """`lognormal:MU,SIGMA` (natural log of seconds), e.g. `lognormal:-1.6,0.8`."""
        kind, sep, params = text.partition(":")
        if kind.strip() != "lognormal" or not sep:
            raise ValueError(f"latency {text!r}: expected lognormal:MU,SIGMA")
        try:
            mu, sigma = (float(x) for x in params.split(","))
        except ValueError as exc:
            raise ValueError(f"latency {text!r}: expected lognormal:MU,SIGMA") from exc
        return cls(mu, sigma, seed)

    def sample_seconds(self, group_id: str, group_seed: int, sample: int) -> float:
        rng = np.random.default_rng(_hash("latency", self.seed, group_id, group_seed, sample))
        return float(np.exp(rng.normal(self.mu, self.sigma)))

    def group_seconds(self, group_id: str, group_seed: int, num_samples: int) -> float:
        return max(
            (self.sample_seconds(group_id, group_seed, i) for i in range(num_samples)),
            default=0.0,
        )


class ScriptedFailure(RuntimeError):
    """Raised for the groups `fail_every` selects, to exercise failure paths."""


class ScriptedGenerator:
    """A `RolloutBackend` named "scripted"; see the module docstring. Not a model.

    Per sample and policy it returns one sequence: PROMPT_LENGTH prompt
    tokens (loss_mask 0, logprob 0, version -1) then L generated tokens
    (loss_mask 1, negative finite log-probs, the version of that policy given
    to `generate`), L in [1, max_new_tokens] (within MAX_SEQ_LEN) from the hash, or exactly
    `tokens_override` when that is > 0. Rewards are 0.0 or 1.0.

    `delay_s` is slept once per group (cancellable), plus, with a `latency` model, the
    group's long-tailed generation time (see `LatencyModel`), recorded in each trajectory's
    metadata as `latency_s`. `fail_every` > 0 makes
    about one group in `fail_every` raise ScriptedFailure, chosen by hash.
    """

    engine = "scripted"

    def __init__(
        self,
        policy_ids: Sequence[str] = ("policy",),
        workflows: Sequence[str] = ("single_turn",),
        *,
        delay_s: float = 0.0,
        tokens_override: int = 0,
        fail_every: int = 0,
        latency: LatencyModel | None = None,
    ) -> None:
        if not policy_ids or not workflows:
            raise ValueError("at least one policy and one workflow are required")
        if delay_s < 0 or tokens_override < 0 or fail_every < 0:
            raise ValueError("delay_s, tokens_override and fail_every must be >= 0")
        self.policy_ids = tuple(policy_ids)
        self.workflows = tuple(workflows)
        self.delay_s = delay_s
        self.tokens_override = tokens_override
        self.fail_every = fail_every
        self.latency = latency
        self.loaded: dict[str, VersionSpec] = {}
        self.generated_groups = 0

    async def generate(self, group: GroupSpec, versions: dict[str, int]) -> list[TrajectorySpec]:
        metadata: dict[str, object] = {"engine": self.engine}
        wait = self.delay_s
        if self.latency is not None:
            drawn = self.latency.group_seconds(group.group_id, group.seed, group.num_samples)
            # What this group was made to take, so a benchmark can tell the generation tail
            # from the system's own overhead.
            metadata["latency_s"] = drawn
            wait += drawn
        if wait > 0:
            await asyncio.sleep(wait)
        if self.fail_every and _hash("fail", group.group_id) % self.fail_every == 0:
            raise ScriptedFailure(f"scripted failure of group {group.group_id}")
        rate = SUCCESS_RATES[_hash("rate", group.group_id, group.seed) % len(SUCCESS_RATES)]
        prompt = np.random.default_rng(_hash("prompt", group.group_id, group.seed)).integers(
            0, VOCAB_SIZE, PROMPT_LENGTH, dtype=np.int32
        )
        multi = len(group.policy_ids) > 1
        out = []
        for sample in range(group.num_samples):
            sequences = [
                self._sequence(group, sample, policy_id, versions.get(policy_id, 0), prompt, rate)
                for policy_id in group.policy_ids
            ]
            agent_rewards = {s.policy_id: s.reward for s in sequences}
            if multi:
                for s in sequences:
                    s.agent_id = s.policy_id
            out.append(
                TrajectorySpec(
                    sample_index=sample,
                    sequences=sequences,
                    reward=float(np.mean([s.reward for s in sequences])),
                    agent_rewards=agent_rewards if multi else {},
                    metadata=dict(metadata),
                )
            )
        self.generated_groups += 1
        return out

    def _sequence(
        self,
        group: GroupSpec,
        sample: int,
        policy_id: str,
        version: int,
        prompt: np.ndarray,
        rate: float,
    ) -> SequenceSpec:
        rng = np.random.default_rng(_hash("sample", group.group_id, group.seed, sample, policy_id))
        limit = min(group.max_new_tokens, MAX_SEQ_LEN - PROMPT_LENGTH)
        if self.tokens_override > 0:
            length = self.tokens_override
        else:
            length = int(rng.integers(1, limit + 1))
        p = len(prompt)
        tokens = np.concatenate([prompt, rng.integers(0, VOCAB_SIZE, length, dtype=np.int32)])
        logprobs = np.zeros(p + length, dtype=np.float32)
        logprobs[p:] = -(rng.exponential(1.0, length) + 1e-3)
        mask = np.zeros(p + length, dtype=np.uint8)
        mask[p:] = 1
        weight_versions = np.full(p + length, -1, dtype=np.int64)
        weight_versions[p:] = version
        return SequenceSpec(
            policy_id=policy_id,
            token_ids=tokens,
            logprobs=logprobs,
            loss_mask=mask,
            weight_versions=weight_versions,
            prompt_length=p,
            finish_reason="length" if length >= limit else "stop",
            reward=1.0 if rng.random() < rate else 0.0,
        )

    async def load_weights(self, versions: dict[str, VersionSpec], weights_address: str) -> int:
        """Records the versions; the scripted generator has no weights, so fetches 0 bytes."""
        self.loaded.update(versions)
        return 0
