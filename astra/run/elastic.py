"""Elastic RaaS: the supervisor adds and removes RaaS while the run goes on.

By schedule (the recipe's `elastic:` events, astra.run.sections.ElasticEvent, in
list order) and by hand (`astra raas add|remove`, requests under <run>/control/,
astra.run.control), one change at a time, every `control.POLL_S`. An added RaaS
is a child like the recipe's: `astra serve raas --dataflow ...`; it registers with
Dataflow by itself and gets work at once. A removed one is asked for its counters
(RolloutService.GetStatus: the work it did), then stopped: SIGTERM to its
process group, it stops serving, deregisters, and Dataflow puts back in the
queue every group it held (finished or not: none is lost, a late copy is
dropped as a duplicate). A removal is a normal event, not a death: run.json
moves the child to `removed`, and `elastic` lists every change with its source,
its trigger and the trainer step it happened at. On --resume the RaaS added by
hand and not removed are started again (their specs are in that list).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from pydantic import ValidationError

from astra.run import control, layout
from astra.run.children import Child, ChildFailed
from astra.run.recipe import RaasSpec, reserved_name
from astra.run.run_view import RunView
from astra.waits import within

log = logging.getLogger("astra.run")
WORK_COUNTERS = (
    "groups_accepted",
    "groups_finished",
    "results_acknowledged",
    "weight_swaps",
    "weight_swap_pause_us",  # decoding stopped for weight swaps, in all (astra.raas)
)


RESTORED = "resume: added by hand before"


def hand_added(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> RaaS spec of every RaaS that `events` (run.json `elastic`, in order) show added
    by hand (or restored on a resume) and not removed afterwards."""
    alive: dict[str, dict[str, Any]] = {}
    for e in events:
        name = str(e.get("name"))
        if e.get("action") == "add" and "error" not in e:
            if e.get("source") in ("cli", RESTORED) and isinstance(e.get("spec"), dict):
                alive[name] = e["spec"]
            else:
                alive.pop(name, None)  # a scheduled add of that name replaces it
        elif e.get("action") == "remove":
            alive.pop(name, None)
    return alive


class ElasticError(Exception):
    """A change that cannot be made now; the message says why."""


class Elastic:
    def __init__(self, sup: RunView) -> None:
        self.sup = sup
        self.up_at = time.monotonic()
        self.next_event = 0

    # ----- what the run looks like -----------------------------------------------------------

    def running(self) -> dict[str, Child]:
        return {c.name: c for c in self.sup.children["raas"] if c.returncode is None}

    def step(self) -> int:
        """The step every trainer has reached: per policy the further of its last step line and
        Dataflow's current version (durable across --resume); the least over policies."""
        obs = self.sup.observer
        if obs is None:
            return 0
        versions = obs.last_dataflow.get("versions") or {}
        done = []
        for p in self.sup.recipe.policies:
            last = obs.history[p.id].last_step if p.id in obs.history else None
            done.append(max(last or 0, int(versions.get(p.id, 0))))
        return min(done, default=0)

    def _record(self, event: dict[str, Any]) -> dict[str, Any]:
        event = {"time": time.time(), "step": self.step(), **event}
        self.sup.elastic_events.append(event)
        self.sup.write_run_json()
        return event

    # ----- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: the schedule's due events, then the requests waiting."""
        while True:
            try:
                await self._schedule()
                for request in control.take_requests(self.sup.rd):
                    control.answer(self.sup.rd, request["id"], await self._serve(request))
            except OSError:  # the control folder: try again next time
                log.exception("elastic: control requests")
            await asyncio.sleep(control.POLL_S)

    def due(self) -> bool:
        events = self.sup.recipe.elastic
        if self.next_event >= len(events):
            return False
        e = events[self.next_event]
        if e.at_step is not None:
            return self.step() >= e.at_step
        return time.monotonic() - self.up_at >= float(e.at_s or 0)

    async def _schedule(self) -> None:
        while self.due():
            i = self.next_event
            e = self.sup.recipe.elastic[i]
            self.next_event += 1
            source = f"schedule: elastic.{i} at {e.trigger}"
            try:
                if e.add is not None:
                    await self.add(e.add, str(e.add.name), source)
                else:
                    await self.remove(str(e.remove), source)
            except ElasticError as exc:
                log.error("%s: %s", source, exc)
                if self.sup.recipe.on_raas_death == "stop":
                    self.sup.fail(f"failed: {source}: {exc}")

    async def _serve(self, request: dict[str, Any]) -> dict[str, Any]:
        if "error" in request:
            return {"ok": False, "error": request["error"]}
        action = request.get("action")
        try:
            if action == "add":
                spec = RaasSpec.model_validate(request.get("spec") or {})
                return {"ok": True, **await self.add(spec, spec.name or self.free_name(), "cli")}
            if action == "remove":
                return {"ok": True, **await self.remove(str(request.get("name")), "cli")}
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                for e in exc.errors()
            )
            return {"ok": False, "error": f"invalid RaaS: {problems}"}
        except ElasticError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": False, "error": f"unknown action {action!r} (add or remove)"}

    # ----- the changes -------------------------------------------------------------------------

    def free_name(self) -> str:
        """raas-<i> with the least i no child of this run ever had."""
        used = {c.name for g in self.sup.children.values() for c in g}
        used |= {str(r.get("name")) for r in self.sup.removed}
        return next(f"raas-{i}" for i in range(len(used) + 1) if f"raas-{i}" not in used)

    async def add(self, spec: RaasSpec, name: str, source: str) -> dict[str, Any]:
        """Starts a RaaS; returns its run.json entry. ElasticError when it cannot start."""
        sup, recipe = self.sup, self.sup.started_recipe
        if name in {c.name for c in sup.children["raas"] if c.returncode is None}:
            raise ElasticError(f"name taken: RaaS {name!r} is running")
        if any(sup.restarts.restarting(c) for c in sup.children["raas"] if c.name == name):
            raise ElasticError(f"name taken: RaaS {name!r} is restarting (remove it first)")
        if reserved_name(name):
            raise ElasticError(f"name taken: {name!r} is another child's name")
        ids = [p.id for p in recipe.policies]
        if unknown := [p for p in spec.policies if p not in ids]:
            raise ElasticError(f"unknown policies {unknown} (the run's: {ids})")
        spec = spec.model_copy(update={"name": name})
        dataflow = sup.addresses["dataflow"]  # Dataflow's own is empty while it restarts
        # A RaaS of the same name that died or was removed before: its entry goes.
        sup.children["raas"] = [c for c in sup.children["raas"] if c.name != name]
        command = layout.raas_spec_command(recipe, spec, name, sup.rd, dataflow)
        child = sup.add_child(name, "raas", command, recipe.raas_policies(spec), spec=spec)
        child.extra = {"capacity": spec.capacity, "labels": dict(spec.labels), "joined": source}
        try:
            await sup.start_children([child])
        except ChildFailed as exc:
            if child.returncode is None:
                await child.stop(0)
            sup.children["raas"].remove(child)
            self._record({"action": "add", "name": name, "source": source, "error": str(exc)})
            raise ElasticError(f"{name} did not start: {exc}") from exc
        sup.changed.set()  # the watch follows the new child
        log.info(
            "RaaS %s added (%s): capacity %d, labels %s, pid %s, %s",
            name,
            source,
            spec.capacity,
            spec.labels or "{}",
            child.pid,
            child.address,
        )
        spec_json = spec.model_dump(mode="json")
        self._record(
            {"action": "add", "name": name, "source": source, "pid": child.pid, "spec": spec_json}
        )
        return child.describe()

    async def restore(self, events: list[dict[str, Any]]) -> None:
        """On --resume: starts again the RaaS added by hand (or restored) before and not
        removed since, from the run's previous change list."""
        for name, spec in hand_added(events).items():
            try:
                await self.add(RaasSpec.model_validate(spec), name, RESTORED)
            except (ElasticError, ValidationError) as exc:
                log.error("RaaS %s added by hand before --resume: not started again: %s", name, exc)

    async def remove(self, name: str, source: str) -> dict[str, Any]:
        """Stops a RaaS (SIGTERM: it deregisters, Dataflow re-dispatches what it held)."""
        sup = self.sup
        child = next((c for c in sup.children["raas"] if c.name == name), None)
        if child is None:
            raise ElasticError(
                f"unknown RaaS {name!r} (running: {', '.join(self.running()) or 'none'})"
            )
        if child.returncode is None:
            rest = [c for n, c in self.running().items() if n != name]
            if not rest:
                raise ElasticError(f"{name} is the last RaaS running: add another first")
            specs = [sup.spec_of(c) for c in rest]
            for s in sup.started_recipe.streams:
                if not any(sup.started_recipe.serves(r, s) for r in specs):
                    raise ElasticError(
                        f"without {name} no running RaaS serves streams.{s.name}: "
                        "add one that does first"
                    )
        await sup.restarts.cancel(child)  # retired: no restart under way brings it back
        work = await raas_work(child)
        rc = await child.stop(sup.grace_s)
        sup.children["raas"].remove(child)
        entry = {**child.describe(), "removed": source, "removed_at": time.time(), "work": work}
        sup.removed.append(entry)
        log.info(
            "RaaS %s removed (%s): exit %s, %s groups finished",
            name,
            source,
            rc,
            work.get("groups_finished", "?"),
        )
        self._record(
            {"action": "remove", "name": name, "source": source, "returncode": rc, "work": work}
        )
        return entry


async def raas_work(child: Child, timeout_s: float = 3.0) -> dict[str, Any]:
    """The RaaS's work counters (RolloutService.GetStatus); {} when it does not answer."""
    if child.returncode is not None or not child.address:
        return {}
    from astra.clients.raas import RolloutClient

    client = RolloutClient(child.address, timeout_s=timeout_s)
    try:
        status = await within(client.get_status(), timeout_s)
        counters = dict(status.counters)
        return {k: int(counters.get(k, 0)) for k in WORK_COUNTERS}
    except Exception as exc:  # a RaaS that cannot answer is stopped all the same
        log.warning("%s: no status (%s)", child.name, exc)
        return {}
    finally:
        with contextlib.suppress(Exception):
            await client.close()
