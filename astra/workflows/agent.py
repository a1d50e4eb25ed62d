"""The `agent` workflow: a program the user wrote (any language) is the agent; every call it
makes to the RaaS's OpenAI-compatible endpoint is what gets trained.

Per sample: an episode is opened on the endpoint (astra.agents) with a key of its own, and the
agent command runs under the sandbox's limits (astra.rewards.sandbox.run_command: time,
memory, file size; the machine's files stay visible, since the agent runs its own interpreter;
the network is cut but for the endpoint, reached at the same URL through the endpoint's Unix
socket, where the machine allows network namespaces) with, in its environment:
  OPENAI_BASE_URL, OPENAI_API_KEY  the endpoint and the episode's key (any OpenAI client);
  ASTRA_MODEL                      the policy to name as `model`;
  ASTRA_PROMPT, ASTRA_RECORD       the prompt text, and the whole dataset record as JSON.
When it ends the episode is closed (later calls are refused) and its calls become sequences
(`trajectories`: a call continuing the previous one's tokens extends that sequence). The reward: the last stdout line when it is a JSON object with "reward", else the
workflow's reward function on that line (the agent's final answer) against the record.
An agent that fails, hangs past `timeout_s` or makes no call fails the sample, said why;
one that floods the endpoint is refused past `max_calls`.

Options (`workflow_options["agent"]`, from `astra serve raas --agent-command`): `command`
(argv), `timeout_s` (60), `max_calls` (64), `memory_bytes` (2 GiB), `network` (false: only the
endpoint; true: the machine's network).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.parse
from typing import Any

from astra.agents.recorder import Episode
from astra.raas.backend import SequenceSpec, TrajectorySpec
from astra.rewards.sandbox import SandboxLimits, run_command
from astra.workflows.base import WorkflowContext
from astra.workflows.episode import SequenceBuilder
from astra.workflows.registry import register_workflow


class AgentFailed(RuntimeError):
    """The agent program failed, hung or never called the endpoint."""


OPTIONS: dict[str, type] = {"network": bool, "max_calls": int, "memory_bytes": int}


def check_options(options: dict[str, Any]) -> None:
    """A recipe's `workflow_options.agent` (the command and its timeout have keys of their own:
    `agent_command`, `agent_timeout_s`); raises ValueError naming the key."""
    for key, value in options.items():
        kind = OPTIONS.get(key)
        if kind is None:
            raise ValueError(
                f"workflow_options.agent.{key}: unknown; one of {', '.join(sorted(OPTIONS))} "
                "(the command and its timeout: agent_command, agent_timeout_s)"
            )
        if type(value) is not kind or (isinstance(value, int) and kind is int and value < 1):
            raise ValueError(f"workflow_options.agent.{key}: {value!r} is not a {kind.__name__}"
                             f"{' >= 1' if kind is int else ''}")  # fmt: skip


def check_command(argv: list[str]) -> None:
    """Raises ValueError naming the program when it cannot be run (said at start-up)."""
    if not argv:
        raise ValueError("the agent command is empty")
    if shutil.which(argv[0]) is None:
        raise ValueError(f"agent command {argv[0]!r} is not a program on PATH or a path to one")


def final_reward(stdout: str) -> float | None:
    """The reward the agent printed last (`{"reward": x}`), or None."""
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    if not lines:
        return None
    try:
        last = json.loads(lines[-1])
    except ValueError:
        return None
    if isinstance(last, dict) and isinstance(last.get("reward"), (int, float)):
        return float(last["reward"])
    return None


def trajectories(episode: Episode, reward: float, agent_id: str = "") -> list[SequenceSpec]:
    """The episode's sequences, each with `reward`: a call whose prompt starts with the whole
    previous sequence (its prompt and generation) of the same policy continues it, the new
    tokens in between masked as context (tool output, the next user turn); any other call
    starts a new sequence."""
    out: list[SequenceSpec] = []
    builder: SequenceBuilder | None = None
    for call in episode.calls:
        prompt = list(call.prompt_ids)
        so_far = builder.token_ids if builder is not None else None
        same = builder is not None and builder.policy_id == call.policy_id
        if same and so_far is not None and prompt[: len(so_far)] == so_far:
            assert builder is not None
            builder.add_context(prompt[len(so_far) :])
        else:
            if builder is not None:
                out.append(builder.build(reward))
            builder = SequenceBuilder(call.policy_id, prompt, agent_id)
        builder.add_generation(call.generation)
    if builder is not None:
        out.append(builder.build(reward))
    return out


@register_workflow("agent")
class AgentWorkflow:
    default_reward = "exact_match"

    async def run(self, ctx: WorkflowContext) -> TrajectorySpec:
        gateway = ctx.agents
        if gateway is None:
            raise AgentFailed(
                "this RaaS serves no agent endpoint: start it with --agent-command "
                "(astra serve raas), or set agent_command on the recipe's raas entry"
            )
        opts: dict[str, Any] = dict(ctx.options)
        argv = [str(a) for a in opts.get("command") or ()]
        check_command(argv)
        policy = ctx.group.policy_ids[0]
        episode = gateway.episodes.open(policy, max_calls=int(opts.get("max_calls", 64)))
        env = {
            "OPENAI_BASE_URL": gateway.base_url,
            "OPENAI_API_KEY": episode.key,
            "ASTRA_MODEL": policy,
            "ASTRA_PROMPT": ctx.prompt_text(policy),
            "ASTRA_RECORD": json.dumps(ctx.record),
        }
        # No network but the endpoint (reached through its Unix socket), unless asked for.
        network = bool(opts.get("network", False)) or not gateway.unix_path
        port = urllib.parse.urlsplit(gateway.base_url).port
        limits = SandboxLimits(
            time_s=float(opts.get("timeout_s", 60.0)),
            memory_bytes=int(opts.get("memory_bytes", 2 << 30)),
            output_chars=65_536,
            network=network,
            files=True,
            endpoint=None if network or port is None else (port, gateway.unix_path),
        )
        try:
            result = await asyncio.to_thread(run_command, argv, env=env, limits=limits)
        finally:
            gateway.episodes.close(episode.key)
        if not result.ok:
            raise AgentFailed(f"the agent ended with {result.reason}: {result.stderr[-400:]}")
        reward = final_reward(result.stdout)
        metadata: dict[str, Any] = {"workflow": ctx.workflow, "calls": len(episode.calls)}
        if reward is None:
            lines = [x for x in result.stdout.strip().splitlines() if x.strip()]
            answer = lines[-1].strip() if lines else ""
            reward, info = await ctx.reward(answer, policy_id=policy)
            metadata.update({"reward_fn": ctx.reward_name, "answer": answer[:200]})
            if info:
                metadata["reward_info"] = info
        seqs = trajectories(episode, reward)
        if not seqs:
            raise AgentFailed("the agent made no call to the endpoint")
        return TrajectorySpec(
            sample_index=ctx.sample_index, sequences=seqs, reward=reward, metadata=metadata
        )
