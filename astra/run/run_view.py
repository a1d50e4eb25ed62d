"""What the supervisor's parts read and call of it: `RunView` and `RestartsView`.

The supervisor (astra.run.supervisor) owns the children and the run's state;
its parts (astra.run.starting, astra.run.elastic, astra.run.restarts,
astra.run.ending) are given the supervisor itself but type it by these
protocols, so none of them imports the module that imports them. Declares;
never runs anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from astra.run.children import Child
from astra.run.layout import RunDir
from astra.run.observe import Observer
from astra.run.recipe import RaasSpec, Recipe


class RestartsView(Protocol):
    """The restarts under way (astra.run.restarts.Restarts), as the other parts use them."""

    events: list[dict[str, Any]]

    def restarting(self, child: Child) -> bool: ...
    async def cancel(self, child: Child) -> None: ...
    async def close(self) -> None: ...


class RunView(Protocol):
    """The supervisor's state and actions its parts share (astra.run.supervisor.Supervisor)."""

    recipe: Recipe
    started_recipe: Recipe
    rd: RunDir
    resume: bool
    children: dict[str, list[Child]]
    warmup: dict[str, dict[str, Any]]
    addresses: dict[str, str]
    removed: list[dict[str, Any]]
    elastic_events: list[dict[str, Any]]
    observer: Observer | None
    restarts: RestartsView
    grace_s: float
    started_at: float
    dataset: Any
    stop: asyncio.Event
    changed: asyncio.Event
    new_child: Callable[..., Child]  # Child, or --ray's astra.run.ray_children.RayChildren
    weights_port: int  # the WeightService's port to take again on --resume (0: any)
    raas_specs: dict[str, RaasSpec]

    def fail(self, status: str) -> None: ...
    def spec_of(self, child: Child) -> RaasSpec: ...
    def add_child(
        self,
        name: str,
        role: str,
        args: list[str],
        policies: Sequence[str] = (),
        *,
        spec: RaasSpec | None = None,
    ) -> Child: ...
    async def start_children(self, group: list[Child]) -> None: ...
    async def until_stop(self, coro: Any) -> Any: ...
    def tail(self, child: Child) -> str: ...
    def write_run_json(self) -> None: ...
