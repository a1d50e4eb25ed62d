"""Workflows by name: built-ins registered with `register_workflow`, plugins from the
entry-point group `astra.workflows`, or a dotted path `package.module:Name` to any
importable workflow (a module on PYTHONPATH, e.g. through a recipe's `env:`).

A registered (or entry-point) object is a `Workflow` class (instantiated
without arguments), a `Workflow` instance, or an `async def run(ctx)`
function (its `default_reward` attribute, else "numeric", is its reward).
`get_workflow` returns a ready `Workflow`; an unknown name raises
`UnknownWorkflow` listing the known ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from astra.plugins import Registry, UnknownName
from astra.raas.backend import TrajectorySpec
from astra.workflows.base import Workflow, WorkflowContext

FALLBACK_REWARD = "numeric"


class UnknownWorkflow(UnknownName):
    """No workflow of that name is registered or installed as a plugin."""


WORKFLOWS: Registry[Any] = Registry("workflow", "astra.workflows", UnknownWorkflow)


class FunctionWorkflow:
    """A `Workflow` around an `async def run(ctx) -> TrajectorySpec` function."""

    def __init__(
        self, fn: Callable[[WorkflowContext], Awaitable[TrajectorySpec]], default_reward: str
    ) -> None:
        self.fn = fn
        self.default_reward = default_reward

    async def run(self, ctx: WorkflowContext) -> TrajectorySpec:
        return await self.fn(ctx)

    def __repr__(self) -> str:
        return f"FunctionWorkflow({self.fn.__module__}.{self.fn.__qualname__})"


def register_workflow(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator registering a Workflow class, instance or async function under `name`."""
    return WORKFLOWS.register(name, replace=replace)


def as_workflow(obj: Any, name: str = "?") -> Workflow:
    """The `Workflow` a registered object stands for (see the module docstring)."""
    if inspect.isclass(obj):
        obj = obj()
    elif inspect.iscoroutinefunction(obj):
        return FunctionWorkflow(obj, getattr(obj, "default_reward", FALLBACK_REWARD))
    run = getattr(obj, "run", None)
    if not inspect.iscoroutinefunction(run):
        raise TypeError(f"workflow {name!r} ({obj!r}) has no `async def run(ctx)`")
    if not isinstance(getattr(obj, "default_reward", None), str):
        raise TypeError(f"workflow {name!r} ({obj!r}) has no `default_reward` string")
    return obj


def get_workflow(name: str) -> Workflow:
    """A `Workflow` for `name` (or a dotted path); raises UnknownWorkflow (listing the known
    names, and why a path did not import) or TypeError."""
    return as_workflow(WORKFLOWS.resolve(name), name)


def known_workflows() -> tuple[str, ...]:
    return WORKFLOWS.names()
