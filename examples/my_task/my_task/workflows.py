"""A workflow with a second try: the model answers; when the answer is not right, the
prompt is asked again after it and the model answers once more, for half the reward."""

from typing import Any

from astra.raas.backend import TrajectorySpec
from astra.workflows import SequenceBuilder, WorkflowContext
from astra.workflows.episode import generated_text


class SecondTry:
    default_reward = "my_task.rewards:reversal"  # when the recipe's stream names none

    async def run(self, ctx: WorkflowContext) -> TrajectorySpec:
        policy_id = ctx.group.policy_ids[0]
        tokenizer = ctx.tokenizer(policy_id)
        prompt = ctx.prompt_ids(policy_id)
        seq = SequenceBuilder(policy_id, prompt)  # prompt tokens: context, not trained on
        gen = await ctx.engine.generate(policy_id, list(seq.token_ids), ctx.sampling())
        seq.add_generation(gen)  # generated tokens: trained on
        reward, info = await ctx.reward(generated_text(gen, tokenizer), policy_id=policy_id)
        tries = 1
        if reward < 1.0 and gen.finish_reason == "stop":
            seq.add_context(prompt)  # the question again, after the wrong answer
            gen = await ctx.engine.generate(
                policy_id, list(seq.token_ids), ctx.sampling(salt=("second try",))
            )
            seq.add_generation(gen)
            second, info = await ctx.reward(generated_text(gen, tokenizer), policy_id=policy_id)
            reward, tries = 0.5 * second, 2
        metadata: dict[str, Any] = {"workflow": ctx.workflow, "tries": tries, "reward_info": info}
        return TrajectorySpec(
            sample_index=ctx.sample_index,
            sequences=[seq.build(reward)],
            reward=reward,
            metadata=metadata,
        )
