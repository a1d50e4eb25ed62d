"""Restarting a service of `astra run` that died: the failure matrix of a run, kept without an operator.

A child that exits when nobody asked it to (SIGKILL, OOM, a crash) is started
again with the command its role needs, up to `supervision.max_restarts` times
per child (backoff `supervision.restart_backoff_s`, doubling, at most 60 s):

- Dataflow and the WeightService come back on the port they had, because every
  other process holds that address: the one of their first start, kept in
  `Supervisor.addresses` (a child's own is empty while it restarts, and stays so
  after a start that failed). Dataflow reloads its durable state (buffer,
  leases, dataset position); the RaaS register again by themselves; trainers
  retry their fetches and publishes meanwhile. A trainer restarted meanwhile is
  given those kept addresses too.
- A trainer comes back with `--resume`-style settings: from its newest
  checkpoint, for the steps it has left, on a new port (the observer is told).
  It continues at the newest published version, so versions stay monotonic.
- A RaaS (`on_raas_death: restart`) comes back under its name and state
  directory; Dataflow takes it as the same instance registering again. When
  its restarts are used up the run goes on without it (`continue`).

A child whose restarts are used up ends the run as a death did before (RaaS
aside). A child has at most one restart under way (`pending`); a child retired
(`Child.retired`: removed by astra.run.elastic, or stopped with the run) is not
started again, and `cancel` stops its restart. Every restart is logged, counted
in run.json (`restarts` of the child) and listed in summary.json (`restarts`).
No grpc here: the children speak for themselves once started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from astra.run import layout
from astra.run.children import Child, ChildFailed
from astra.run.run_view import RunView

log = logging.getLogger("astra.run")
MAX_BACKOFF_S = 60.0


class Restarts:
    """Decides whether a dead child comes back, and brings it back."""

    def __init__(self, sup: RunView) -> None:
        self.sup = sup
        self.events: list[dict[str, Any]] = []  # summary.json `restarts`
        self.pending: dict[Child, asyncio.Task[None]] = {}  # one restart under way per child

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
        self.pending[child] = task  # a retry (start from _restart) replaces its own task
        task.add_done_callback(lambda t: self._done(child, t))

    def _done(self, child: Child, task: asyncio.Task[None]) -> None:
        if self.pending.get(child) is task:
            del self.pending[child]

    def restarting(self, child: Child) -> bool:
        """Whether a restart of `child` is under way (waiting out its backoff, or starting)."""
        task = self.pending.get(child)
        return task is not None and not task.done()

    async def cancel(self, child: Child) -> None:
        """Retires `child` and stops its restart, if one is under way (astra.run.elastic's
        removal: the caller stops the child)."""
        child.retired = True
        task = self.pending.get(child)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _restart(self, child: Child, rc: int, backoff: float, event: dict[str, Any]) -> None:
        await asyncio.sleep(backoff)
        if self.sup.stop.is_set() or child.retired:
            return
        try:
            child.args = self.command(child)
            await self.sup.start_children([child])
        except ChildFailed as exc:
            if child.retired:  # removed while it started (its stop is what failed the start)
                if child.returncode is None:
                    await child.stop(0)
                return
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
        if child.retired:  # removed while it started: it does not stay
            await child.stop(0)
            return
        event["serving_after_s"] = round(time.monotonic() - self.sup.started_at, 3)
        if child.role == "trainer" and self.sup.observer is not None:
            self.sup.observer.set_trainer(child.name.removeprefix("trainer-"), child.address)
        self.sup.changed.set()  # the watch waits on the new process

    def command(self, child: Child) -> list[str]:
        """The command that brings `child` back (see the module docstring)."""
        sup, r, rd = self.sup, self.sup.started_recipe, self.sup.rd
        if child.role == "dataflow":
            return layout.dataflow_command(
                r, rd, sup.dataset, port=port_of(sup.addresses[child.role])
            )
        if child.role == "weights":
            return layout.weights_command(r, rd, port_of(sup.addresses[child.role]))
        if child.role == "trainer":
            policy = next(p for p in r.policies if f"trainer-{p.id}" == child.name)
            # the addresses they always come back on: they may be restarting right now
            core = sup.addresses
            return layout.trainer_command(
                r, policy, rd, dataflow=core["dataflow"], weights=core["weights"], resume=True
            )
        return child.args  # a RaaS: the same command (port 0, its own state directory)

    async def close(self) -> None:
        tasks = list(self.pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def port_of(address: str) -> int:
    """The port of an address (host:port)."""
    return int(address.rsplit(":", 1)[1])
