"""`EngineBackend`: the `RolloutBackend` that joins an inference engine with workflows and rewards.

`generate` runs a group's samples as concurrent episodes of the named
workflow (the engine batches them) and returns their trajectories in sample
order; a sample whose workflow or reward raised comes back with `error` set
and is counted, the others are unaffected. `load_weights` fetches every
policy's new weights through a `WeightLoader` and only when all of them
arrived swaps them into the engine together (the version barrier): a failed
fetch leaves every policy on the version it had. No gRPC here: the loader
is implemented over the WeightService client elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from astra.engine.api import InferenceEngine
from astra.errors import FailedPrecondition, InvalidArgument
from astra.lora.serving import AdapterVersion
from astra.raas.backend import GroupSpec, TrajectorySpec, VersionSpec
from astra.rewards import UnknownReward, get_reward
from astra.workflows import Workflow, WorkflowContext, get_workflow, run_episode
from astra.workflows.registry import UnknownWorkflow

log = logging.getLogger(__name__)


class WeightLoader(Protocol):
    """Fetches one policy's weights of one version from a WeightService."""

    async def fetch(
        self, policy_id: str, version: VersionSpec, weights_address: str
    ) -> tuple[dict[str, object], int]:
        """Returns (tensor name -> engine-native tensor, bytes fetched).

        Raises astra.errors.Unavailable when the service cannot be reached and
        DataLoss when a checksum fails; nothing is installed by fetching.
        """
        ...


class EngineBackend:
    """A `RolloutBackend` over one `InferenceEngine` (see the module docstring).

    `engine` is the engine's name (what GetStatus reports); the engine object
    is `inference_engine`. `workflow_options` maps a workflow name to its
    options (e.g. {"multi_turn_tools": {"max_turns": 6}}). `rewards`, when
    given, is the only reward names a group may ask for (resolved now, so a
    typo fails at startup); otherwise any registered name, plugin or dotted
    path is accepted, which imports whatever module a request names.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        workflows: Sequence[str] = ("single_turn",),
        weight_loader: WeightLoader | None = None,
        *,
        workflow_options: Mapping[str, Mapping[str, Any]] | None = None,
        rewards: Sequence[str] | None = None,
        agents: Any = None,
    ) -> None:
        """`agents`: the agent endpoint's Gateway (astra.agents.endpoint) for `agent`."""
        if not workflows:
            raise ValueError("at least one workflow is required")
        if not engine.policy_ids:
            raise ValueError(f"engine {engine.name!r} serves no policy")
        self.inference_engine = engine
        self.engine = engine.name
        self.policy_ids = tuple(engine.policy_ids)
        self.workflows = tuple(dict.fromkeys(workflows))
        self._workflows: dict[str, Workflow] = {name: get_workflow(name) for name in self.workflows}
        self._options = {k: dict(v) for k, v in (workflow_options or {}).items()}
        self.weight_loader = weight_loader
        self.agents = agents
        # Called with the versions of every swap the engine completed (the RaaS servicer's
        # bookkeeping of what it serves), also for a swap whose load call was cancelled.
        self.on_swapped: Callable[[dict[str, VersionSpec]], None] | None = None
        self.rewards = None if rewards is None else tuple(dict.fromkeys(rewards))
        for name in self.rewards or ():
            get_reward(name)
        self.counters: Counter[str] = Counter()

    def default_reward(self, workflow: str) -> str:
        return self._workflow(workflow).default_reward

    def check_reward(self, workflow: str, reward: str) -> str:
        """The reward a group of `workflow` asking for `reward` ("" = default) gets.

        Raises UnknownWorkflow or UnknownReward (a servicer can answer
        INVALID_ARGUMENT at submit with these).
        """
        if not reward:
            return self.default_reward(workflow)
        if self.rewards is not None and reward not in self.rewards:
            raise UnknownReward(
                f"reward {reward!r} is not allowed here; allowed: {', '.join(self.rewards)}"
            )
        get_reward(reward)
        return reward

    def _workflow(self, name: str) -> Workflow:
        wf = self._workflows.get(name)
        if wf is None:
            raise UnknownWorkflow(
                f"workflow {name!r} is not served here; served: {', '.join(self.workflows)}"
            )
        return wf

    async def generate(self, group: GroupSpec, versions: dict[str, int]) -> list[TrajectorySpec]:
        """Runs the group's samples concurrently; raises only for a group no sample can run
        (unknown workflow, reward or policy)."""
        workflow = self._workflow(group.workflow)
        unknown = [p for p in group.policy_ids if p not in self.policy_ids]
        if not group.policy_ids or unknown:
            raise InvalidArgument(
                f"policies {unknown or 'none'} are not served by this engine",
                reason="UNKNOWN_POLICY",
            )
        reward_name = self.check_reward(group.workflow, group.reward)
        reward_fn = get_reward(reward_name)
        options = self._options.get(group.workflow, {})
        contexts = [
            WorkflowContext(
                group=group,
                sample_index=i,
                engine=self.inference_engine,
                reward_fn=reward_fn,
                reward_name=reward_name,
                workflow=group.workflow,
                versions=dict(versions),
                options=options,
                agents=self.agents,
            )
            for i in range(group.num_samples)
        ]
        trajectories = await asyncio.gather(*(run_episode(workflow, c) for c in contexts))
        failed = sum(t.error is not None for t in trajectories)
        self.counters["samples"] += len(trajectories)
        self.counters["samples_failed"] += failed
        return list(trajectories)

    async def load_weights(self, versions: dict[str, VersionSpec], weights_address: str) -> int:
        """Fetches every policy's weights, then swaps them all at once; returns bytes fetched.

        A policy whose VersionSpec names a `weights_address` is fetched from there, the
        others from `weights_address`.

        A failed fetch (Unavailable, DataLoss, anything) cancels the others and
        propagates before the engine is touched.
        """
        if self.weight_loader is None:
            raise FailedPrecondition("this RaaS has no weight loader", reason="NO_WEIGHT_LOADER")
        unknown = sorted(set(versions) - set(self.policy_ids))
        if unknown:
            raise InvalidArgument(f"policies {unknown} are not served", reason="UNKNOWN_POLICY")
        loader = self.weight_loader
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = {
                    p: tg.create_task(
                        loader.fetch(p, spec, spec.weights_address or weights_address)
                    )
                    for p, spec in versions.items()
                }
        except BaseExceptionGroup as group:
            self.counters["weight_loads_failed"] += 1
            raise _first_leaf(group) from None
        state = {p: t.result()[0] for p, t in tasks.items()}
        adapters = sorted(p for p, v in state.items() if isinstance(v, AdapterVersion))
        if adapters and not getattr(self.inference_engine, "serves_adapters", False):
            raise FailedPrecondition(
                f"versions of {adapters} are LoRA adapters; the {self.engine} engine serves "
                "full versions only (the built-in torch engine serves adapters, and vLLM "
                "launched with --enable-lora)",
                reason="ADAPTER_UNSUPPORTED",
                metadata={"field": "versions"},
            )
        fetched = sum(t.result()[1] for t in tasks.values())
        # Once handed to the engine the swap completes even if this call is cancelled (a load
        # timeout): `on_swapped` hears of it then too, so what is reported stays what is served.
        engine: Any = self.inference_engine
        paused = getattr(engine, "swap_pause_s", None)
        started = time.perf_counter()
        swap = asyncio.ensure_future(
            engine.swap_weights({p: s.version for p, s in versions.items()}, state)
        )
        swap.add_done_callback(lambda done: self._swapped(done, versions))
        await asyncio.shield(swap)
        # The time generation stood still for this swap: the engine's own count where it keeps
        # one (the torch engine: installing between two decode steps; HTTP engines: admission
        # closed to reopened, staging excluded), else the whole call.
        pause = (
            engine.swap_pause_s - paused if paused is not None else time.perf_counter() - started
        )
        self.counters["weight_swap_pause_us"] += round(pause * 1e6)
        self.counters["weight_swaps"] += 1
        self.counters["weight_loads"] += 1
        log.info("loaded %s (%d bytes)", {p: s.version for p, s in versions.items()}, fetched)
        return fetched

    def _swapped(self, done: asyncio.Future, versions: dict[str, VersionSpec]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        if self.on_swapped is not None:
            self.on_swapped(versions)

    async def close(self) -> None:
        await self.inference_engine.close()


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
