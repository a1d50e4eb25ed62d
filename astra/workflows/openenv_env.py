"""The `openenv` workflow: the policy plays an OpenEnv environment (the `openenv` package,
github.com/huggingface/OpenEnv) through the environment's own client, reset then step.

Per sample a client (`client`, an `EnvClient` subclass; default `GenericEnvClient`, plain
dicts) connects to the environment server at `url` (a server the user runs: uvicorn on the
environment's `create_app`, a container, a Space) and resets it with `seed`, `episode_id`,
`prompt` (the prompt text) and `record` (the dataset record); the server passes on only the
arguments its `reset` accepts. Then, until the environment says done or `max_turns` turns:
the observation is rendered to text (`render`, default `observation_text`), the policy
generates on the RaaS's engine, the text becomes the action (`action`, a function of the text;
default `{action_field: text}`), and the environment steps. Each generation is recorded as the
agent endpoint records a call (astra.agents.recorder) and the episode becomes sequences with
astra.workflows.agent `trajectories`: in text mode (default) each turn's prompt continues the
last one's tokens, so one sequence holds the whole game with the observations masked; with
`chat` the conversation is rendered by the policy's chat template each turn. The reward is
the environment's: the sum of its step rewards, or the last (`reward_mode`); the stream's
reward function is not used. An environment that cannot be reached, does not answer within
`timeout_s`, or refuses an action fails the sample, saying which recipe key to look at.

Options: `workflow_options: {openenv: {...}}` on the recipe's raas entry. Never touches
gRPC, the agent endpoint's HTTP server or the trainer.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from astra.agents.recorder import Episode
from astra.raas.backend import TrajectorySpec
from astra.waits import within
from astra.workflows.agent import trajectories
from astra.workflows.base import WorkflowContext
from astra.workflows.episode import generated_text
from astra.workflows.registry import register_workflow

KEY = "workflow_options.openenv"
OPTIONS = (
    "url", "client", "action", "action_field", "render", "max_turns", "reward_mode",
    "timeout_s", "chat",
)  # fmt: skip
NOT_OBSERVED = ("reward", "done", "metadata")  # what a rendered observation leaves out
TEXT_FIELDS = ("prompt", "text", "message", "content", "observation")


class OpenEnvFailed(RuntimeError):
    """The environment could not be reached, timed out, or refused an action."""


def load_ref(ref: str, key: str) -> Any:
    """`package.module:name` imported; ValueError naming `key` when it does not resolve."""
    module_name, sep, attr = str(ref).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}: {ref!r} is not 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user module may fail in any way while importing
        raise ValueError(
            f"{key}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(module, attr):
        raise ValueError(f"{key}: {module_name} has no {attr!r}")
    return getattr(module, attr)


def observation_text(observation: Any) -> str:
    """The default rendering: a string as is; else the observation's fields less reward,
    done and metadata: its only field, else its first of prompt/text/message/content/
    observation that is a string, else all of them as JSON."""
    if isinstance(observation, str):
        return observation
    if hasattr(observation, "model_dump"):
        data = observation.model_dump()
    elif isinstance(observation, Mapping):
        data = dict(observation)
    else:
        data = dict(vars(observation))
    fields = {k: v for k, v in data.items() if k not in NOT_OBSERVED}
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    for name in TEXT_FIELDS:
        if isinstance(fields.get(name), str):
            return fields[name]
    return json.dumps(fields, sort_keys=True, default=str)


@dataclass(frozen=True)
class EnvOptions:
    url: str
    client: type
    to_action: Callable[[str], Any]
    render: Callable[[Any], str]
    max_turns: int
    reward_mode: str
    timeout_s: float
    chat: bool


def parse_options(opts: Mapping[str, Any]) -> EnvOptions:
    """The options checked, references imported; ValueError naming the recipe key."""
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{KEY}: unknown option(s) {unknown}; known: {', '.join(OPTIONS)}")
    url = str(opts.get("url") or "")
    if not url.startswith(("http://", "https://", "ws://", "wss://")):
        raise ValueError(f"{KEY}.url: the environment server's base URL, got {url!r}")
    try:
        import openenv.core as core
    except ImportError as exc:
        raise ValueError(f"{KEY}: the openenv package is not installed ({exc})") from None
    client = core.GenericEnvClient
    if opts.get("client"):
        client = load_ref(opts["client"], f"{KEY}.client")
        if not (isinstance(client, type) and issubclass(client, core.EnvClient)):
            raise ValueError(f"{KEY}.client: {opts['client']!r} is not an EnvClient subclass")
    field = str(opts.get("action_field", "message"))
    to_action: Callable[[str], Any] = lambda text: {field: text}  # noqa: E731
    if opts.get("action"):
        to_action = load_ref(opts["action"], f"{KEY}.action")
    render = load_ref(opts["render"], f"{KEY}.render") if opts.get("render") else None
    for name, fn in (("action", to_action), ("render", render)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{KEY}.{name}: {opts[name]!r} is not callable")
    max_turns = int(opts.get("max_turns", 4))
    if not 1 <= max_turns <= 256:
        raise ValueError(f"{KEY}.max_turns: 1 to 256, got {max_turns}")
    mode = str(opts.get("reward_mode", "sum"))
    if mode not in ("sum", "last"):
        raise ValueError(f"{KEY}.reward_mode: 'sum' or 'last', got {mode!r}")
    timeout_s = float(opts.get("timeout_s", 30.0))
    if not timeout_s > 0:
        raise ValueError(f"{KEY}.timeout_s: seconds > 0, got {timeout_s}")
    return EnvOptions(
        url, client, to_action, render or observation_text, max_turns, mode, timeout_s,
        bool(opts.get("chat", False)),
    )  # fmt: skip


async def env_call(what: str, make: Callable[[], Any], o: EnvOptions) -> Any:
    """One client call under the timeout, its failures said as OpenEnvFailed."""
    try:
        return await within(make(), o.timeout_s)
    except TimeoutError:
        raise OpenEnvFailed(
            f"the environment at {o.url} did not answer {what} within {o.timeout_s} s "
            f"({KEY}.timeout_s)"
        ) from None
    except (ConnectionError, OSError) as exc:
        raise OpenEnvFailed(f"cannot reach the environment at {o.url} ({KEY}.url): {exc}") from exc
    except Exception as exc:  # the server's error frame (a refused action), a closed socket
        raise OpenEnvFailed(f"the environment failed {what}: {type(exc).__name__}: {exc}") from exc


@register_workflow("openenv")
class OpenEnvWorkflow:
    default_reward = "exact_match"  # not used: the environment's rewards are the reward

    async def run(self, ctx: WorkflowContext) -> TrajectorySpec:
        o = parse_options(ctx.options)
        policy = ctx.group.policy_ids[0]
        tokenizer = ctx.tokenizer(policy)
        limit = ctx.max_seq_len(policy)
        episode = Episode("", policy, max_calls=o.max_turns)
        client = o.client(
            base_url=o.url, connect_timeout_s=o.timeout_s, message_timeout_s=o.timeout_s
        )
        rewards: list[float] = []
        ended = "max_turns"
        try:
            reset: dict[str, Any] = {
                "episode_id": f"{ctx.group.group_id}/{ctx.sample_index}",
                "prompt": ctx.prompt_text(policy),
                "record": ctx.record,
            }
            if ctx.seed is not None:
                reset["seed"] = ctx.seed
            result = await env_call("reset", lambda: client.reset(**reset), o)
            text = o.render(result.observation)
            messages = [{"role": "user", "content": text}]
            prompt = ctx.chat_prompt_ids(policy, messages) if o.chat else tokenizer.encode(text)
            for turn in range(o.max_turns):
                room = ctx.group.max_new_tokens if limit is None else limit - len(prompt)
                if room < 1:
                    ended = "length"
                    break
                sampling = ctx.sampling(min(ctx.group.max_new_tokens, room), salt=("turn", turn))
                gen = await ctx.engine.generate(policy, list(prompt), sampling)
                episode.record(prompt, gen, policy)
                said = generated_text(gen, tokenizer)
                try:
                    action = o.to_action(said)
                except Exception as exc:
                    raise OpenEnvFailed(
                        f"the action parser ({KEY}.action) raised on {said[:80]!r}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                step = functools.partial(client.step, action)
                result = await env_call(f"the action {said[:80]!r}", step, o)
                rewards.append(float(result.reward or 0.0))
                if result.done:
                    ended = "done"
                    break
                text = o.render(result.observation)
                if o.chat:
                    messages += [
                        {"role": "assistant", "content": said},
                        {"role": "user", "content": text},
                    ]
                    prompt = ctx.chat_prompt_ids(policy, messages)
                else:  # continue the same tokens: the observation is masked context
                    prompt = [*prompt, *gen.token_ids, *tokenizer.encode(text)]
        finally:
            with contextlib.suppress(Exception):
                await within(client.close(), 5.0)
        reward = (sum(rewards) if o.reward_mode == "sum" else rewards[-1]) if rewards else 0.0
        seqs = trajectories(episode, reward)
        metadata = {"workflow": ctx.workflow, "turns": len(episode.calls), "ended": ended}
        metadata["env_rewards"] = rewards
        return TrajectorySpec(
            sample_index=ctx.sample_index, sequences=seqs, reward=reward, metadata=metadata
        )
