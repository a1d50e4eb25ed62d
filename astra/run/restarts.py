"""Restarting a service of `astra run` that died: the failure matrix of a run, kept without an operator.

A child that exits when nobody asked it to (SIGKILL, OOM, a crash) is started
again with the command its role needs, up to `supervision.max_restarts` times
per child (backoff `supervision.restart_backoff_s`, doubling, at most 60 s):

- Dataflow and the WeightService come back on the port they had, because every
  other process holds that address. Dataflow reloads its durable state (buffer,
  leases, dataset position); the RaaS register again by themselves; trainers
  retry their fetches and publishes meanwhile.
- A trainer comes back with `--resume`-style settings: from its newest
  checkpoint, for the steps it has left, on a new port (the observer is told).
  It continues at the newest published version, so versions stay monotonic.
- A RaaS (`on_raas_death: restart`) comes back under its name and state
  directory; Dataflow takes it as the same instance registering again. When
  its restarts are used up the run goes on without it (`continue`).

A child whose restarts are used up ends the run as a death did before (RaaS
aside). Every restart is logged, counted in run.json (`restarts` of the child)
and listed in summary.json (`restarts`). No grpc here: the children speak for
themselves once started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from astra.run import layout
from astra.run.children import Child, ChildFailed

if TYPE_CHECKING:
    from astra.run.supervisor import Supervisor

log = logging.getLogger("astra.run")
MAX_BACKOFF_S = 60.0


class Restarts:
    """Decides whether a dead child comes back, and brings it back."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.events: list[dict[str, Any]] = []  # summary.json `restarts`
        self.pending: set[asyncio.Task[None]] = set()

    def count(self, child: Child) -> int:
        return int(child.extra.get("restarts", 0))

    def allowed(self, child: Child) -> bool:
        """Whether `child`'s death is answered by a restart (budget left, role restartable)."""
        r = self.sup.recipe
        if child.role == "raas" and r.on_raas_death != "restart":
            return False
        if child.role not in ("dataflow", "weights", "trainer", "raas"):
            return False
        return self.count(child) < r.supervision.max_restarts

    def start(self, child: Child, rc: int) -> None:
        """Schedules the restart of `child` (which exited with `rc`); the watch is told when it
        serves again (`changed`) or when it could not be brought back (`fail`)."""
        n = self.count(child) + 1
        child.extra["restarts"] = n
        backoff = min(self.sup.recipe.supervision.restart_backoff_s * 2 ** (n - 1), MAX_BACKOFF_S)
        event = {"child": child.name, "role": child.role, "exit": rc, "restart": n}
        event["at_s"] = round(time.monotonic() - self.sup.started_at, 3)
        self.events.append(event)
        log.warning(
            "%s exited with %s: restart %d of %d in %.1fs",
            child.name,
            rc,
            n,
            self.sup.recipe.supervision.max_restarts,
            backoff,
        )
        task = asyncio.create_task(self._restart(child, rc, backoff, event))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _restart(self, child: Child, rc: int, backoff: float, event: dict[str, Any]) -> None:
        await asyncio.sleep(backoff)
        if self.sup.stop.is_set() or child.stopping:
            return
        try:
            child.args = self.command(child)
            await self.sup.start_children([child])
        except ChildFailed as exc:
            event["error"] = str(exc).splitlines()[0]
            log.error("%s could not be restarted: %s", child.name, exc)
            if child.returncode is None:
                await child.stop(0)
            child.stopping = False  # not stopped on purpose: the next decision is the watch's
            if self.allowed(child):
                self.start(child, child.returncode if child.returncode is not None else rc)
            elif child.role == "raas":
                log.warning("%s: restarts used up; the run goes on without it", child.name)
            else:
                self.sup.fail(f"failed: {child.name} could not be restarted")
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the run is stopping (Interrupted), or a bug: never a silent hang
            if not self.sup.stop.is_set():
                log.exception("restarting %s", child.name)
                self.sup.fail(f"failed: restarting {child.name}: {exc!r}")
            return
        event["serving_after_s"] = round(time.monotonic() - self.sup.started_at, 3)
        if child.role == "trainer" and self.sup.observer is not None:
            self.sup.observer.set_trainer(child.name.removeprefix("trainer-"), child.address)
        self.sup.changed.set()  # the watch waits on the new process

    def command(self, child: Child) -> list[str]:
        """The command that brings `child` back (see the module docstring)."""
        sup, r, rd = self.sup, self.sup.started_recipe, self.sup.rd
        if child.role == "dataflow":
            return layout.dataflow_command(r, rd, sup.dataset, port=port_of(child))
        if child.role == "weights":
            return layout.weights_command(r, rd, port_of(child))
        if child.role == "trainer":
            policy = next(p for p in r.policies if f"trainer-{p.id}" == child.name)
            core = {c.role: c.address for c in sup.children["core"]}
            return layout.trainer_command(
                r, policy, rd, dataflow=core["dataflow"], weights=core["weights"], resume=True
            )
        return child.args  # a RaaS: the same command (port 0, its own state directory)

    async def close(self) -> None:
        for task in list(self.pending):
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)


def port_of(child: Child) -> int:
    """The port of a child's last address (host:port)."""
    return int(child.address.rsplit(":", 1)[1])
