"""The `multi_turn_tools` workflow: the model calls tools, reads their output, and continues.

Each turn generates until `</tool>` (or the group's own stops, or the token
budget); a turn that ends in a tool call (syntax in astra.workflows.tools)
gets the tool's observation appended as context tokens (loss_mask 0, logprob
0, version -1) and the next turn continues from the whole sequence. The
episode ends on a turn without a call (or one that stopped at eos or another
stop than `</tool>`), at `max_turns` turns, when the group's `max_new_tokens`
(a budget for the whole episode) is spent, or when the engine's context
(`max_seq_len`) has no room for another model token ("length"). The
reward scores the model's own text (every turn, observations left out), so
quoting a tool result is not enough: the model has to state the answer.
"""

from __future__ import annotations

from typing import Any

from astra.raas.backend import TrajectorySpec
from astra.workflows.base import WorkflowContext
from astra.workflows.episode import SequenceBuilder, generated_text
from astra.workflows.registry import register_workflow
from astra.workflows.tools import CLOSE_TAG, observation, parse_tool_call, run_tool

DEFAULT_MAX_TURNS = 4


@register_workflow("multi_turn_tools")
class MultiTurnTools:
    """Options: `max_turns` (generate calls per episode, default 4)."""

    default_reward = "numeric"

    async def run(self, ctx: WorkflowContext) -> TrajectorySpec:
        max_turns = int(ctx.options.get("max_turns", DEFAULT_MAX_TURNS))
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        policy_id = ctx.group.policy_ids[0]
        tokenizer = ctx.tokenizer(policy_id)
        seq = SequenceBuilder(policy_id, ctx.prompt_ids(policy_id))
        budget = ctx.group.max_new_tokens
        limit = ctx.max_seq_len(policy_id)
        said: list[str] = []
        transcript: list[str] = []
        tools_used: list[str] = []
        errors = 0
        ended = "answer"
        for turn in range(max_turns):
            # Turn 1 asks for the whole budget, as single_turn does (the engine refuses a group
            # that does not fit); later turns only for the context left after the observations.
            new_tokens = (
                budget if turn == 0 or limit is None else min(budget, limit - len(seq.token_ids))
            )
            sampling = ctx.sampling(new_tokens, stop_strings=(CLOSE_TAG,), salt=("turn", turn))
            gen = await ctx.engine.generate(policy_id, list(seq.token_ids), sampling)
            seq.add_generation(gen)
            budget -= len(gen.token_ids)
            text = generated_text(gen, tokenizer)
            said.append(text)
            transcript.append(text)
            # A turn that stopped at anything but `</tool>` (eos, the group's own stops) ends the
            # episode: an open call is not run, nothing follows the model's own end. Engines that
            # do not name the stop count as stopped at `</tool>`.
            stop = gen.meta.get("stop", CLOSE_TAG) if gen.finish_reason == "stop" else None
            if stop is None or stop == CLOSE_TAG:
                call = parse_tool_call(text, stopped=stop == CLOSE_TAG)
            else:
                call = None
            if call is None:
                ended = "answer" if gen.finish_reason == "stop" else gen.finish_reason
                break
            if turn == max_turns - 1 or budget <= 0:
                ended = "max_turns" if budget > 0 else "length"
                break
            result = await run_tool(call.name, call.argument)
            obs = observation(result, call)
            obs_ids = tokenizer.encode(obs)
            if limit is not None and len(seq.token_ids) + len(obs_ids) >= limit:
                ended = "length"  # no room left for a model token after the observation
                break
            seq.add_context(obs_ids)
            transcript.append(obs)
            tools_used.append(call.name)
            errors += not result.ok
        reward, info = await ctx.reward(
            "".join(said), policy_id=policy_id, transcript="".join(transcript)
        )
        metadata: dict[str, Any] = {
            "workflow": ctx.workflow,
            "reward_fn": ctx.reward_name,
            "turns": len(said),
            "tool_calls": tools_used,
            "tool_errors": errors,
            "ended": ended,
        }
        if info:
            metadata["reward_info"] = info
        return TrajectorySpec(
            sample_index=ctx.sample_index,
            sequences=[seq.build(reward)],
            reward=reward,
            metadata=metadata,
        )
