"""`SequenceBuilder`: assembles one policy's token sequence from prompt, generations and
observations, with the loss mask, log-probs and weight versions aligned.

Prompt and observation tokens (tool output, another agent's text) are context:
loss_mask 0, logprob 0, version -1. Generated tokens carry the engine's
log-probs and per-token versions with loss_mask 1. The builder checks what
the engine returned (aligned lists, finite log-probs) so a broken generation
fails the episode instead of reaching the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from astra.engine.api import Generation, Tokenizer
from astra.raas.backend import FinishReason, SequenceSpec


class GenerationFailed(RuntimeError):
    """The engine reported finish_reason "error", or returned misaligned lists."""


def generated_text(gen: Generation, tokenizer: Tokenizer) -> str:
    """The text of a generation: the engine's, else its tokens decoded."""
    if gen.text or not gen.token_ids:
        return gen.text
    return tokenizer.decode(list(gen.token_ids))


class SequenceBuilder:
    """Tokens of one sequence in order; `token_ids` is the context for the next generate call."""

    def __init__(self, policy_id: str, prompt_ids: Sequence[int], agent_id: str = "") -> None:
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        self.policy_id = policy_id
        self.agent_id = agent_id
        self.prompt_length = len(prompt_ids)
        self.token_ids: list[int] = [int(t) for t in prompt_ids]
        self._logprobs: list[float] = [0.0] * len(prompt_ids)
        self._mask: list[int] = [0] * len(prompt_ids)
        self._versions: list[int] = [-1] * len(prompt_ids)
        self.finish_reason: FinishReason = "length"
        self.generated_tokens = 0

    def add_generation(self, gen: Generation) -> None:
        """Appends sampled tokens (trained on) and records the finish reason."""
        n = len(gen.token_ids)
        if len(gen.logprobs) != n or len(gen.versions) != n:
            raise GenerationFailed(
                f"engine returned {n} tokens, {len(gen.logprobs)} log-probs, "
                f"{len(gen.versions)} versions"
            )
        if gen.finish_reason == "error":
            raise GenerationFailed(f"engine failed: {gen.meta.get('error', 'no detail')}")
        if not all(math.isfinite(lp) for lp in gen.logprobs):
            raise GenerationFailed("engine returned a log-prob that is not finite")
        if any(v < 0 for v in gen.versions):
            raise GenerationFailed("engine returned a negative weight version")
        self.token_ids.extend(int(t) for t in gen.token_ids)
        self._logprobs.extend(float(lp) for lp in gen.logprobs)
        self._mask.extend([1] * n)
        self._versions.extend(int(v) for v in gen.versions)
        self.finish_reason = gen.finish_reason
        self.generated_tokens += n

    def add_context(self, token_ids: Sequence[int]) -> None:
        """Appends tokens the policy did not sample (observations): masked out of the loss."""
        self.token_ids.extend(int(t) for t in token_ids)
        self._logprobs.extend([0.0] * len(token_ids))
        self._mask.extend([0] * len(token_ids))
        self._versions.extend([-1] * len(token_ids))

    def build(self, reward: float) -> SequenceSpec:
        return SequenceSpec(
            policy_id=self.policy_id,
            token_ids=np.asarray(self.token_ids, dtype=np.int32),
            logprobs=np.asarray(self._logprobs, dtype=np.float32),
            loss_mask=np.asarray(self._mask, dtype=np.uint8),
            weight_versions=np.asarray(self._versions, dtype=np.int64),
            prompt_length=self.prompt_length,
            finish_reason=self.finish_reason,
            reward=float(reward),
            agent_id=self.agent_id,
        )
