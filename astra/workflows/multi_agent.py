"""The `multi_agent` workflow: a solver and a verifier, two policies in one episode.

The solver (`policy_ids[0]`, agent "solver") answers the prompt. The verifier
(`policy_ids[1]`, agent "verifier"; the solver's policy again when the group
names only one) reads the problem and the solver's answer and replies
"correct" or "incorrect". Rewards: the solver's is the reward function's
score of its answer; the verifier's is 1 when its verdict matches whether
that score reaches `correct_threshold` (default 1.0), else 0 (no verdict: 0).
The team reward (TrajectorySpec.reward) is the solver's score. `agent_rewards`
holds each individual reward under the agent id and, when the agents are two
policies, under the policy id too (Dataflow computes a policy's advantage
from agent_rewards[policy_id]). Each agent has
its own sequence, tagged with its policy and agent id; the other agent's
text is context in the verifier's prompt, never trained on.
"""

from __future__ import annotations

import random
import re
from typing import Any

from astra.raas.backend import TrajectorySpec
from astra.workflows.base import WorkflowContext
from astra.workflows.episode import SequenceBuilder, generated_text
from astra.workflows.registry import register_workflow

SOLVER, VERIFIER = "solver", "verifier"
VERIFIER_TEMPLATE = (
    "Problem:\n{problem}\n\nProposed answer:\n{answer}\n\n"
    'Is the proposed answer correct? Reply "correct" or "incorrect".\nVerdict: '
)
_VERDICT = re.compile(r"\b(incorrect|correct)\b", re.IGNORECASE)


def parse_verdict(text: str) -> bool | None:
    """True for "correct", False for "incorrect" (the first one written), None for neither."""
    match = _VERDICT.search(text)
    return None if match is None else match.group(1).lower() == "correct"


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer of the kind a solver writes: off by a little, or by a digit."""
    try:
        value = int(answer)
    except ValueError:
        return answer + "0"
    wrong = value
    while wrong == value or wrong < 0:
        wrong = value + rng.choice((-10, -2, -1, 1, 2, 10, 11, -11, 20))
    return str(wrong)


@register_workflow("multi_agent")
class SolverVerifier:
    """Options: `verifier_template` (str.format with problem, answer), `correct_threshold`."""

    default_reward = "numeric"

    @staticmethod
    def warmup_records(records: list[dict[str, Any]], role: int, seed: int) -> list[dict[str, Any]]:
        """Supervised warm-up records for the policy in position `role` of the group
        (`astra run`'s warm-up stage): the solver (0) learns the task's own prompt/answer
        records; the verifier (1) learns to check a proposed answer by working the problem
        out first: the prompt is VERIFIER_TEMPLATE with the right answer half of the time and
        a near miss otherwise, the answer "<the right answer> correct|incorrect" (the verdict
        is the first "correct"/"incorrect" it writes, so the working may come before it)."""
        if role == 0:
            return records
        rng = random.Random(f"astra-verifier/{seed}")
        out = []
        for r in records:
            answer, right = str(r["answer"]), rng.random() < 0.5
            proposed = answer if right else near_miss(answer, rng)
            prompt = VERIFIER_TEMPLATE.format(problem=r["prompt"], answer=proposed)
            verdict = "correct" if right else "incorrect"
            out.append({"prompt": prompt, "answer": f"{answer} {verdict}"})
        return out

    async def run(self, ctx: WorkflowContext) -> TrajectorySpec:
        policies = ctx.group.policy_ids
        solver_policy = policies[0]
        verifier_policy = policies[1] if len(policies) > 1 else policies[0]
        threshold = float(ctx.options.get("correct_threshold", 1.0))
        template = str(ctx.options.get("verifier_template", VERIFIER_TEMPLATE))

        solver = SequenceBuilder(solver_policy, ctx.prompt_ids(solver_policy), SOLVER)
        gen = await ctx.engine.generate(
            solver_policy, list(solver.token_ids), ctx.sampling(salt=(SOLVER,))
        )
        solver.add_generation(gen)
        answer = generated_text(gen, ctx.tokenizer(solver_policy))
        solver_reward, info = await ctx.reward(answer, policy_id=solver_policy, agent_id=SOLVER)
        correct = solver_reward >= threshold

        verifier_tok = ctx.tokenizer(verifier_policy)
        prompt = template.format(problem=ctx.prompt_text(solver_policy), answer=answer)
        verifier = SequenceBuilder(verifier_policy, verifier_tok.encode(prompt), VERIFIER)
        # The verifier's prompt holds the solver's answer: a long answer must not push it past
        # the context (the engine would refuse, and the whole episode, the solver's turn with
        # it, would be lost). Fewer new tokens then; no room at all: no verdict.
        limit = ctx.max_seq_len(verifier_policy)
        room = ctx.group.max_new_tokens if limit is None else limit - len(verifier.token_ids)
        verdict = None
        if room >= 1:
            gen = await ctx.engine.generate(
                verifier_policy,
                list(verifier.token_ids),
                ctx.sampling(min(ctx.group.max_new_tokens, room), salt=(VERIFIER,)),
            )
            verifier.add_generation(gen)
            verdict = parse_verdict(generated_text(gen, verifier_tok))
        verifier_reward = float(verdict is not None and verdict == correct)

        agent_rewards = {SOLVER: solver_reward, VERIFIER: verifier_reward}
        if verifier_policy != solver_policy:
            agent_rewards |= {solver_policy: solver_reward, verifier_policy: verifier_reward}
        metadata: dict[str, Any] = {
            "workflow": ctx.workflow,
            "reward_fn": ctx.reward_name,
            "solver_correct": correct,
            "verdict": "none" if verdict is None else ("correct" if verdict else "incorrect"),
        }
        if room < 1:
            metadata["verifier"] = "no room in the context for a verdict"
        if info:
            metadata["reward_info"] = info
        return TrajectorySpec(
            sample_index=ctx.sample_index,
            sequences=[solver.build(solver_reward), verifier.build(verifier_reward)],
            reward=solver_reward,
            agent_rewards=agent_rewards,
            metadata=metadata,
        )
