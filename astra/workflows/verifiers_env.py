"""The `verifiers` workflow: a `verifiers` (0.4, `verifiers.v1`) environment plays each sample,
its model calls go to the RaaS's own agent endpoint, and what the endpoint recorded is trained.

The environment is the recipe's `verifiers_env` (on a `raas:` entry): verifiers' own env config
as a mapping, e.g. `{taskset: {id: my_taskset}, agent: {runtime: {type: subprocess}}}`. The
taskset id is an importable module exporting its `Taskset` (and, where it has them, its `Env`
and `Harness`) through `__all__`, as verifiers loads it. It is built once per RaaS process
(its tasks loaded once), and its serving resources (the interception server its harnesses
call) are held while any of its episodes runs (`Loaded.serving`); a config verifiers refuses,
or a module that does not import, fails the sample with an error naming `verifiers_env`.

Per sample: the record's `task` field is the index of the taskset's task to play (the records
`task_records` writes, one per task). An episode is opened on the endpoint (astra.agents) and
the environment runs that task (`Env.run_episode`: its harness, its multi-turn protocol, its
rewards) with the model context pointed at the endpoint, the episode's key in the
`X-Astra-Episode` header (verifiers' relay sets `Authorization` itself), the group's sampling
as verifiers' sampling. The reward is the episode's (the mean of its traces' rewards, one trace
for a single-agent env); the sequences are the recorded calls, merged as the `agent` workflow
merges them (astra.workflows.agent `trajectories`: model tokens trained, the environment's
turns in between masked). A failed episode (verifiers' error, a harness that failed, a
provider error) fails the sample with verifiers' message.

Never touches gRPC, weights or the endpoint's HTTP framing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from astra.agents.recorder import EPISODE_HEADER
from astra.raas.backend import TrajectorySpec
from astra.workflows.agent import AgentFailed, trajectories
from astra.workflows.base import WorkflowContext
from astra.workflows.registry import register_workflow

OPTION = "verifiers_env"  # the recipe key (raas.N.verifiers_env) the errors name
UNSET_KEY_VAR = "ASTRA_VERIFIERS_NO_KEY"  # an env var never set: verifiers sends "EMPTY"


class EnvironmentNotLoaded(ValueError):
    """The verifiers environment of `verifiers_env` could not be built."""


class Loaded:
    """An environment, its tasks, and its serving resources (verifiers' `Env.serving()`: the
    interception server its harnesses call) held while any of its episodes runs: the env
    object keeps them as its own state, so concurrent episodes share one entry."""

    def __init__(self, env: Any, tasks: list[Any]) -> None:
        self.env = env
        self.tasks = tasks
        self._users = 0
        self._stack: contextlib.AsyncExitStack | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (a test's asyncio.run): a fresh lock
            self._loop, self._lock = loop, asyncio.Lock()
        async with self._lock:
            if self._users == 0:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.env.serving())
                self._stack = stack
            self._users += 1
        try:
            yield
        finally:
            async with self._lock:
                self._users -= 1
                if self._users == 0 and self._stack is not None:
                    stack, self._stack = self._stack, None
                    await stack.aclose()


_LOADED: dict[str, Loaded] = {}


def load_env(config: Mapping[str, Any]) -> Loaded:
    """The environment of `config` and its tasks, built once per process (per config)."""
    if not isinstance(config, Mapping) or not config:
        raise EnvironmentNotLoaded(
            f"{OPTION}: set it to verifiers' env config, e.g. "
            "{taskset: {id: my_taskset}, agent: {runtime: {type: subprocess}}}"
        )
    key = json.dumps(config, sort_keys=True, default=str)
    if key not in _LOADED:
        try:
            from verifiers.v1.utils.loaders import load_environment, resolve_env_config
        except ImportError as exc:
            raise EnvironmentNotLoaded(
                f"{OPTION}: verifiers 0.4 is not installed (pip install 'astra-rl[envs]'): {exc}"
            ) from None
        try:
            env = load_environment(resolve_env_config(dict(config)))
            tasks = list(env.taskset)
        except Exception as exc:
            raise EnvironmentNotLoaded(f"{OPTION}: {type(exc).__name__}: {exc}") from None
        if not tasks:
            raise EnvironmentNotLoaded(f"{OPTION}: the taskset loaded no task")
        _LOADED[key] = Loaded(env, tasks)
    return _LOADED[key]


def prompt_text(prompt: Any) -> str:
    """A task's prompt as one text: a string as is, a conversation's last user message."""
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    messages = [m if isinstance(m, dict) else m.model_dump() for m in prompt]
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    texts = [u for u in users if isinstance(u, str)]
    return texts[-1] if texts else json.dumps(messages, default=str)


def task_records(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One dataset record per task of the environment: `prompt` (its text, what Dataflow and
    the logs show), `task` (the index the workflow plays), and the task's `answer` where its
    data has one."""
    out = []
    for i, task in enumerate(load_env(config).tasks):
        record: dict[str, Any] = {"prompt": prompt_text(task.data.prompt), "task": i}
        answer = getattr(task.data, "answer", None)
        if answer is not None:
            record["answer"] = str(answer)
        out.append(record)
    return out


def write_task_records(config: Mapping[str, Any], path: str | Path) -> Path:
    """`task_records` as JSONL at `path`: the recipe's `dataset: {kind: file, path: ...}`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in task_records(config)))
    return path


def _sampling(ctx: WorkflowContext) -> dict[str, Any]:
    s = ctx.sampling()
    out: dict[str, Any] = {"temperature": s.temperature, "top_p": s.top_p}
    out["max_tokens"] = s.max_new_tokens
    if s.seed is not None:
        out["seed"] = s.seed
    if s.stop_strings:
        out["stop"] = list(s.stop_strings)
    return out


def _failure(episode: Any) -> str:
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if errors:
        return "; ".join(f"{e.type}: {e.message}"[:400] for e in errors[:3])
    return "the episode did not complete"


@register_workflow("verifiers")
class VerifiersWorkflow:
    default_reward = "exact_match"  # not used: the environment's rewards score
    chat = True  # verifiers' harnesses talk chat: the model needs a chat template (preflight)

    async def run(self, ctx: WorkflowContext) -> TrajectorySpec:
        gateway = ctx.agents
        if gateway is None:
            raise AgentFailed(
                "this RaaS serves no agent endpoint: it starts one when it serves workflow "
                "`verifiers` (astra serve raas --workflow verifiers)"
            )
        loaded = load_env(ctx.options.get("env") or {})
        index = ctx.record.get("task")
        if isinstance(index, float) and index.is_integer():
            index = int(index)  # the record crossed the wire as a protobuf Struct (numbers float)
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"the record's `task` must be a task index, not {index!r}")
        if not 0 <= index < len(loaded.tasks):
            raise ValueError(f"the record's task {index} is not one of 0..{len(loaded.tasks) - 1}")
        from verifiers.v1 import EvalClientConfig, ModelContext, SamplingConfig

        policy = ctx.group.policy_ids[0]
        episode = gateway.episodes.open(policy, max_calls=int(ctx.options.get("max_calls", 64)))
        client = EvalClientConfig(
            base_url=gateway.base_url,
            api_key_var=UNSET_KEY_VAR,
            headers={EPISODE_HEADER: episode.key},
        )
        model = ModelContext(model=policy, client=client, sampling=SamplingConfig(**_sampling(ctx)))
        try:
            async with loaded.serving():
                result = await loaded.env.run_episode(loaded.tasks[index], model)
        finally:
            gateway.episodes.close(episode.key)
        if not result.ok or not result.traces:
            raise AgentFailed(f"the verifiers episode failed: {_failure(result)}")
        reward = sum(t.reward for t in result.traces) / len(result.traces)
        seqs = trajectories(episode, reward)
        if not seqs:
            raise AgentFailed("the verifiers episode made no model call")
        metadata: dict[str, Any] = {
            "workflow": ctx.workflow,
            "calls": len(episode.calls),
            "task": index,
            "rewards": {k: v.value for t in result.traces for k, v in t.rewards.items() if v},
        }
        return TrajectorySpec(
            sample_index=ctx.sample_index, sequences=seqs, reward=reward, metadata=metadata
        )
