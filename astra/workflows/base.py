"""What a workflow is given and must return: `WorkflowContext`, `Workflow`, `run_episode`.

A workflow runs one episode (one sample of a prompt group) against an
`InferenceEngine` (astra.engine.api) and returns a `TrajectorySpec`.
`run_episode` is how every caller runs one: an exception from the workflow
or its reward becomes that sample's `error` (with the exception type), so a
failure is reported and counted, never dropped. Workflows never see gRPC,
weights or the servicer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from astra.engine.api import InferenceEngine, Sampling, Tokenizer
from astra.raas.backend import GroupSpec, TrajectorySpec
from astra.rewards.registry import score

log = logging.getLogger(__name__)

SEED_MODULUS = 2**31 - 1  # what every engine accepts as a seed


class RewardFailed(RuntimeError):
    """The reward function raised or returned something that is not a finite float."""


def sample_seed(group: GroupSpec, sample_index: int, *salt: object) -> int | None:
    """The sampler seed of one sample (and `salt`, e.g. a turn); None when the group is unseeded.

    Derived from the group's seed, id and the sample index, so a re-dispatched
    group draws the same tokens and the samples of a group differ.
    """
    if group.seed == 0:
        return None
    key = "\x1f".join(str(p) for p in (group.seed, group.group_id, sample_index, *salt))
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_MODULUS + 1


@dataclass(slots=True)
class WorkflowContext:
    """Everything one episode needs. `options` are the workflow's settings (max_turns ...)."""

    group: GroupSpec
    sample_index: int
    engine: InferenceEngine
    reward_fn: Callable[..., float]
    reward_name: str
    workflow: str
    versions: Mapping[str, int] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    agents: Any = None  # astra.agents.endpoint.Gateway where the RaaS serves agents

    @property
    def record(self) -> dict[str, Any]:
        return self.group.data

    @property
    def seed(self) -> int | None:
        return sample_seed(self.group, self.sample_index)

    def tokenizer(self, policy_id: str) -> Tokenizer:
        return self.engine.tokenizer(policy_id)

    def max_seq_len(self, policy_id: str) -> int | None:
        """The engine's context (prompt + new tokens) for the policy; None when the engine
        names none (an engine without `max_seq_len`)."""
        limit = getattr(self.engine, "max_seq_len", None)
        return None if limit is None else int(limit(policy_id))

    def prompt_ids(self, policy_id: str) -> list[int]:
        """The group's prompt as token ids: the shipped ids, else the text encoded."""
        if self.group.prompt_token_ids is not None:
            return [int(t) for t in self.group.prompt_token_ids]
        return list(self.tokenizer(policy_id).encode(self.group.prompt_text))

    def chat_prompt_ids(
        self, policy_id: str, messages: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt through the policy's chat template (astra.engine.chat), as token ids.

        `messages` default to the record's one-turn conversation: its optional `system`
        field, then the prompt as the user's message. The assistant's turn is left open for
        the model. A tokenizer without a template raises ValueError (the episode fails,
        saying so; `astra run` refuses such a recipe at start-up).
        """
        from astra.engine.chat import render_chat, user_messages

        if messages is None:
            system = self.record.get("system")
            messages = user_messages(self.prompt_text(policy_id), system if system else None)
        tokenizer = self.tokenizer(policy_id)
        return list(tokenizer.encode(render_chat(tokenizer, messages)))

    def prompt_text(self, policy_id: str) -> str:
        """The prompt as text (decoded when only token ids were shipped)."""
        if self.group.prompt_text or self.group.prompt_token_ids is None:
            return self.group.prompt_text
        return self.tokenizer(policy_id).decode(self.prompt_ids(policy_id))

    def sampling(
        self,
        max_new_tokens: int | None = None,
        *,
        stop_strings: tuple[str, ...] = (),
        salt: tuple[object, ...] = (),
    ) -> Sampling:
        """The group's sampling controls, with more stop strings and a seed salted by `salt`."""
        g = self.group
        return Sampling(
            max_new_tokens=g.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p if g.top_p > 0 else 1.0,
            top_k=g.top_k,
            stop_strings=tuple(dict.fromkeys((*g.stop_strings, *stop_strings))),
            stop_token_ids=g.stop_token_ids,
            seed=sample_seed(g, self.sample_index, *salt),
        )

    async def reward(self, completion: str, **context: Any) -> tuple[float, dict[str, Any]]:
        """Scores `completion` against the record in a worker thread (rewards may block)."""
        context = {
            "prompt": self.group.prompt_text,
            "group_id": self.group.group_id,
            "sample_index": self.sample_index,
            "workflow": self.workflow,
            **context,
        }
        try:
            return await asyncio.to_thread(
                score, self.reward_fn, self.record, completion, **context
            )
        except Exception as exc:
            raise RewardFailed(
                f"reward {self.reward_name!r} raised {type(exc).__name__}: {exc}"
            ) from exc


@runtime_checkable
class Workflow(Protocol):
    """Runs one episode; `default_reward` is used when the group names none."""

    default_reward: str

    async def run(self, ctx: WorkflowContext) -> TrajectorySpec: ...


def failed(sample_index: int, error: str, **metadata: Any) -> TrajectorySpec:
    """A trajectory that reports a failure: no sequences, reward 0, `error` set."""
    return TrajectorySpec(
        sample_index=sample_index, sequences=[], reward=0.0, metadata=metadata, error=error
    )


async def run_episode(workflow: Workflow, ctx: WorkflowContext) -> TrajectorySpec:
    """Runs `workflow` for one sample; any exception becomes the sample's `error`.

    Cancellation propagates (the group was cancelled); the returned
    trajectory always has `sample_index == ctx.sample_index`.
    """
    try:
        trajectory = await workflow.run(ctx)
        if not isinstance(trajectory, TrajectorySpec):
            raise TypeError(f"workflow returned {type(trajectory).__name__}, not TrajectorySpec")
        trajectory.sample_index = ctx.sample_index
        return trajectory
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning(
            "%s sample %d of group %s failed: %s: %s",
            ctx.workflow,
            ctx.sample_index,
            ctx.group.group_id,
            type(exc).__name__,
            exc,
        )
        return failed(
            ctx.sample_index,
            f"{type(exc).__name__}: {exc}",
            workflow=ctx.workflow,
            reward_fn=ctx.reward_name,
        )
