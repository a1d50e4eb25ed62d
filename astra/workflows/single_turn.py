"""The `single_turn` workflow (RLVR): prompt -> one generation -> reward -> one sequence.

The sequence is the prompt (context) followed by the generated tokens
(trained on); the reward scores the decoded completion against the record.
Only the first policy of the group plays.
"""

from __future__ import annotations

from typing import Any

from astra.raas.backend import TrajectorySpec
from astra.workflows.base import WorkflowContext
from astra.workflows.episode import SequenceBuilder, generated_text
from astra.workflows.registry import register_workflow


@register_workflow("single_turn")
class SingleTurn:
    """The prompt text as it is (completion style): what a base model or the char tokenizer
    continues."""

    default_reward = "numeric"

    def prompt_ids(self, ctx: WorkflowContext, policy_id: str) -> list[int]:
        return ctx.prompt_ids(policy_id)

    async def run(self, ctx: WorkflowContext) -> TrajectorySpec:
        policy_id = ctx.group.policy_ids[0]
        seq = SequenceBuilder(policy_id, self.prompt_ids(ctx, policy_id))
        gen = await ctx.engine.generate(policy_id, list(seq.token_ids), ctx.sampling())
        seq.add_generation(gen)
        completion = generated_text(gen, ctx.tokenizer(policy_id))
        reward, info = await ctx.reward(completion, policy_id=policy_id)
        metadata: dict[str, Any] = {"workflow": ctx.workflow, "reward_fn": ctx.reward_name}
        if info:
            metadata["reward_info"] = info
        return TrajectorySpec(
            sample_index=ctx.sample_index,
            sequences=[seq.build(reward)],
            reward=reward,
            metadata=metadata,
        )
