"""The contract between workflows and an inference engine.

A workflow (single turn, multi-turn tools, multi-agent) turns prompts into
episodes by calling `InferenceEngine.generate` one sequence at a time; the
engine batches concurrent calls itself (continuous batching) and records the
weight version of every token it samples. Engines: the built-in torch engine
(astra.engine.torch_engine), and HTTP adapters for vLLM, SGLang and OpenAI-
compatible servers. Plain Python: no gRPC, no torch in this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "aborted", "error"]


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling controls of one generate call."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = no limit
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # same seed + weights + prompt -> same tokens


@dataclass(slots=True)
class Generation:
    """What one generate call produced: only the new tokens, aligned lists."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution
    versions: list[int]  # weight version that produced each token
    finish_reason: FinishReason
    text: str = ""
    meta: dict = field(default_factory=dict)


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class InferenceEngine(Protocol):
    """Serves one or more policies; safe to call `generate` concurrently."""

    name: str
    policy_ids: tuple[str, ...]

    def tokenizer(self, policy_id: str) -> Tokenizer: ...

    def version(self, policy_id: str) -> int: ...

    def max_seq_len(self, policy_id: str) -> int:
        """Longest prompt + max_new_tokens the engine accepts for the policy (its context).

        Callers that must work with engines predating this method use
        `WorkflowContext.max_seq_len`, which treats a missing method as no limit.
        """
        ...

    async def generate(
        self, policy_id: str, prompt_ids: list[int], sampling: Sampling
    ) -> Generation:
        """Samples one continuation. Cancel-safe: cancelling frees the slot at once.

        An engine whose `streams_tokens` is True also takes `on_token=f` (keyword): f(token)
        on the caller's loop as each token is sampled, all before the result returns.
        """
        ...

    async def swap_weights(
        self, versions: Mapping[str, int], state: Mapping[str, Mapping[str, object]]
    ) -> None:
        """Installs new weights for several policies together, between decode steps.

        `state` maps policy -> tensor name -> tensor (engine-native). Sequences in
        flight continue on the new weights or finish on the old ones, as the engine
        is configured; every token records the version that produced it.
        """
        ...

    async def close(self) -> None: ...
