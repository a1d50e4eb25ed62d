"""`astra run`'s supervisor: starts the services as separate processes, watches them, stops them.

Start order (astra.run.starting): the supervised warm-up with Dataflow and the
WeightService starting beside it, then every RaaS and one trainer per policy,
together. While the run goes on, RaaS are added and removed by
the recipe's `elastic:` schedule and by `astra raas add|remove` (astra.run.elastic;
a removal is no death), and a child that exits is reported with the tail of its
log and started again (astra.run.restarts: Dataflow and the WeightService on their
ports, a trainer from its checkpoint, a RaaS under its name) until its
`supervision.max_restarts` are used up; then a RaaS's death is carried (any other
death stops the run).
run.json says who runs: the supervisor (pid, state starting / running /
stopping / ended), every child, the RaaS removed and every elastic change.
The run ends when every trainer exits 0 after its num_steps. SIGINT/SIGTERM/SIGHUP/
SIGQUIT (a second one: no more grace) stop everything; a SIGKILL of the supervisor
ends each child by its parent-death signal (astra.run.children). Shutdown (astra.run.ending)
goes trainers, RaaS (their work counters asked first), then Dataflow and the WeightService,
each group SIGTERM -> grace -> SIGKILL by process group, so no child outlives the run
(descendants in sessions of their own aside: see astra.run.children).
Then summary.json is written (astra.run.summary; `raas`: each RaaS's capacity,
labels, how it joined and left, and its work; `elastic`: every change).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from astra.damage import EXIT_DAMAGED
from astra.durable import write_durably
from astra.run import control, layout, threads
from astra.run.children import Child, ChildFailed, stop_all
from astra.run.elastic import Elastic
from astra.run.ending import shutdown
from astra.run.evals import EvalLog
from astra.run.layout import RunDir
from astra.run.logrotate import keep_logs_small
from astra.run.observe import Observer
from astra.run.recipe import RaasSpec, Recipe
from astra.run.restarts import Restarts
from astra.run.starting import start_all
from astra.run.summary import learned, write_failure_summary
from astra.waits import cancel_and_wait

log = logging.getLogger("astra.run")
EXIT_OK, EXIT_FAILED = 0, 1


class Interrupted(Exception):
    pass


class Supervisor:
    def __init__(
        self, recipe: Recipe, run_dir: RunDir, *, resume: bool = False, child_factory: Any = None
    ) -> None:
        self.recipe, self.rd, self.resume = recipe, run_dir, resume
        self.new_child = child_factory or Child  # --ray: astra.run.ray_children.RayChildren
        self.children: dict[str, list[Child]] = {
            "warmup": [],
            "core": [],
            "raas": [],
            "trainer": [],
        }
        self.started_recipe = recipe  # after the warm-up: the policies' warmed-up models
        self.warmup: dict[str, dict[str, Any]] = {}
        self.stop = asyncio.Event()
        self.signals: list[int] = []
        self.grace_s = recipe.supervision.stop_grace_s
        self.observer: Observer | None = None
        self.state = "starting"  # run.json: starting, running, stopping, ended
        self.changed = asyncio.Event()  # children added, or a failure: the watch looks again
        self.failure: str | None = None
        self.raas_specs: dict[str, RaasSpec] = {}
        self.removed: list[dict[str, Any]] = []  # run.json entries of the RaaS removed
        self.elastic_events: list[dict[str, Any]] = []
        self.elastic: Elastic | None = None
        self.weights_port = 0
        # dataflow, weights: the address of their first start, which a restart keeps (their
        # own is empty while they restart); what every other process is given
        self.addresses: dict[str, str] = {}
        self.restarts = Restarts(self)
        self.started_at = time.monotonic()
        self.dataset: Any = None  # the run's dataset file, once prepared

    def fail(self, status: str) -> None:
        """Ends the run as failed (the watch returns `status`)."""
        self.failure = status
        self.changed.set()

    def spec_of(self, child: Child) -> RaasSpec:
        return self.raas_specs.get(child.name) or RaasSpec(name=child.name)

    def add_child(
        self,
        name: str,
        role: str,
        args: list[str],
        policies: Sequence[str] = (),
        *,
        spec: RaasSpec | None = None,
    ) -> Child:
        """`spec`: a RaaS's, which decides its torch thread share (astra.run.threads)."""
        env = threads.child_env(self.recipe, role, spec)
        child = self.new_child(name, role, args, self.rd.log(name), env)
        child.policies = tuple(policies)  # its credential's scope, with `tls: true`
        self.children["core" if role in ("dataflow", "weights") else role].append(child)
        return child

    def _on_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if len(self.signals) > 1:  # asked twice: no more waiting
            self.grace_s = 0.0
            for child in (c for group in self.children.values() for c in group):
                child.signal_group(signal.SIGKILL)
        log.warning("%s: stopping every child", signal.Signals(sig).name)
        self.stop.set()

    async def until_stop(self, coro: Any) -> Any:
        """`coro`'s result, unless the run is asked to stop first: then Interrupted."""
        task, stopped = asyncio.ensure_future(coro), asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # a restart cancelled (astra.run.elastic's removal)
            task.cancel()
            raise
        finally:
            stopped.cancel()
        if not task.done():
            with contextlib.suppress(Exception):
                await cancel_and_wait(task)
            raise Interrupted
        return task.result()

    async def start_children(self, group: list[Child]) -> None:
        for child in group:
            await child.spawn()
        timeout = self.recipe.supervision.startup_timeout_s
        reads = asyncio.gather(*(c.read_address(timeout) for c in group), return_exceptions=True)
        results = await self.until_stop(reads)
        self.write_run_json()
        for child, result in zip(group, results, strict=True):
            if child.role in ("dataflow", "weights") and not isinstance(result, BaseException):
                self.addresses.setdefault(child.role, child.address)  # the first start's
        for child, result in zip(group, results, strict=True):
            if isinstance(result, BaseException):
                raise ChildFailed(f"{result}\n{self.tail(child)}") from result
        for child in group:
            log.info("%s (pid %s) serving on %s", child.name, child.pid, child.address)

    def tail(self, child: Child) -> str:
        """The last lines of `child`'s log (supervision.log_tail_lines), headed by its path."""
        lines = self.recipe.supervision.log_tail_lines
        return f"--- last lines of {child.log_path} ---\n{child.tail(lines)}"

    def write_run_json(self) -> None:
        every = [c.describe() for group in self.children.values() for c in group]
        data = {
            "supervisor": {"pid": os.getpid(), "state": self.state},
            "children": every,
            "removed": self.removed,
            "elastic": self.elastic_events,
        }
        # readers see the old list or the new one; a --resume after a power cut finds it
        write_durably(self.rd.run_json, json.dumps(data, indent=2) + "\n")

    def _rotate_logs(self) -> asyncio.Task[None] | None:
        """Keeps the children's logs under supervision.max_log_bytes (astra.run.logrotate);
        the observer reads the trainers' step lines up to the end before each truncation."""
        spec = self.recipe.supervision
        if spec.max_log_bytes <= 0:
            return None

        def logs() -> list[Path]:
            mine = [c for g in self.children.values() for c in g if c.rotatable]
            # and what an engine server a RaaS started writes (vLLM logs every request)
            engines = [p for c in mine for p in (self.rd.state / c.name).glob("*-server.log")]
            return sorted({*(c.log_path for c in mine), *engines})

        def before_truncate(_path: Path) -> None:
            if self.observer is not None:
                self.observer.read_logs()

        return asyncio.create_task(
            keep_logs_small(
                logs,
                spec.max_log_bytes,
                spec.log_backups,
                before_truncate,
                every_s=spec.log_check_interval_s,
            )
        )

    async def _watch(self) -> tuple[str, int]:
        """Until every trainer finished, a fatal death, or a signal: (status, exit code).

        Children that started serving are watched, those added later too (`changed`); one
        stopped on purpose (a RaaS removed) ends no run."""
        waits: dict[asyncio.Future[int], Child] = {}
        stopped = asyncio.ensure_future(self.stop.wait())
        changed: asyncio.Future[Any] | None = None
        left = {c.name for c in self.children["trainer"]}
        # Each process's exit is handled once (a dead child stays listed; a restart is a new pid).
        watched: set[tuple[int, int | None]] = set()
        try:
            while left:
                for c in (c for group in self.children.values() for c in group):
                    if (id(c), c.pid) not in watched and c.proc is not None and c.address:
                        watched.add((id(c), c.pid))
                        waits[asyncio.ensure_future(c.wait())] = c
                changed = asyncio.ensure_future(self.changed.wait())
                done, _ = await asyncio.wait(
                    {*waits, stopped, changed}, return_when=asyncio.FIRST_COMPLETED
                )
                changed.cancel()
                self.changed.clear()
                if stopped in done:
                    return "interrupted", 128 + self.signals[0]
                if self.failure is not None:
                    return self.failure, EXIT_FAILED
                for task in done & waits.keys():
                    child, rc = waits.pop(task), task.result()
                    if child.stopping:
                        continue  # removed (astra.run.elastic logs it)
                    # Finished when its checkpoints say so (a trainer writes one at its last
                    # step): an exit 0 short of its steps is a SIGTERM from outside (servers
                    # exit 0 on one), a death to restart, not a finished trainer.
                    if child.role == "trainer" and await self._trained_out(child):
                        log.info("%s finished its steps", child.name)
                        left.discard(child.name)
                        continue
                    log.error(
                        "%s (pid %s) exited with %s\n%s",
                        child.name,
                        child.pid,
                        rc,
                        self.tail(child),
                    )
                    child.signal_group(signal.SIGKILL)  # what is left of its group goes now
                    # Damaged state (astra.damage) is found again by every restart.
                    restart = rc != EXIT_DAMAGED and child.restartable
                    if restart and self.restarts.allowed(child):
                        self.restarts.start(child, rc)
                        continue
                    if child.role != "raas" or self.recipe.on_raas_death == "stop":
                        return f"failed: {child.name} exited with {rc}", EXIT_FAILED
                    if not any(c.returncode is None for c in self.children["raas"]):
                        log.warning("no RaaS left: the run waits for one to join")
            return "completed", EXIT_OK
        finally:
            for task in (*waits, stopped, *([changed] if changed else [])):
                task.cancel()

    async def _trained_out(self, child: Child) -> bool:
        """A trainer that died after the checkpoint of its last step has nothing left to do.
        Off the event loop: the checkpoints are verified (their files hashed), which takes
        seconds for a large model."""
        policy = child.name.removeprefix("trainer-")
        left = await asyncio.to_thread(layout.remaining_steps, self.recipe, self.rd)
        return left.get(policy, 1) <= 0

    async def run(self) -> int:
        started = self.started_at = time.monotonic()
        loop = asyncio.get_running_loop()
        # SIGHUP (its terminal closed) and SIGQUIT stop the run like SIGTERM: never a
        # supervisor gone with its children left behind.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        dataset = self.dataset = layout.prepare(self.recipe, self.rd)
        steps = (
            await asyncio.to_thread(layout.remaining_steps, self.recipe, self.rd)
            if self.resume
            else {p.id: self.recipe.trainer.num_steps for p in self.recipe.policies}
        )
        if all(n <= 0 for n in steps.values()):
            ended = (layout.previous_run(self.rd).get("supervisor") or {}).get("state") == "ended"
            if ended and self.rd.summary.is_file():
                log.info("every trainer already ran its %d steps", self.recipe.trainer.num_steps)
                return EXIT_OK
            # The last supervisor died after the last step, before its summary: the services
            # start (no trainer) so that Dataflow's figures make summary.json.
            log.info("every trainer already ran its steps; the run's summary is taken now")
        observing: asyncio.Task[None] | None = None
        elastic: asyncio.Task[None] | None = None
        rotating: asyncio.Task[None] | None = None
        status, code = "failed: startup", EXIT_FAILED
        # Read before run.json is written again: on --resume the WeightService takes its port.
        previous = layout.previous_run(self.rd) if self.resume else {}
        self.weights_port = layout.previous_port(previous, "weights")
        # The change history goes on; RaaS added by hand come back below.
        self.elastic_events = previous.get("elastic") or []
        restore = list(self.elastic_events)
        control.clear(self.rd)
        self.write_run_json()  # state starting: `astra raas` says so
        try:
            await start_all(self, dataset, steps)
            trainers = {c.name.removeprefix("trainer-"): c for c in self.children["trainer"]}
            self.observer = Observer(
                self.children["core"][0].address,
                {p: c.address for p, c in trainers.items()},
                {p: (c.log_path, c.log_offset, c.log_copies) for p, c in trainers.items()},
                self.rd.metrics,
                num_steps=self.recipe.trainer.num_steps,
                poll_interval_s=self.recipe.observe.poll_interval_s,
                status_every_s=self.recipe.observe.status_every_s,
                name=self.recipe.name,
                tensorboard=self.rd.root / "tensorboard",
                plot=self.rd.root / "plot.png",
                max_dropped_in_a_row=self.recipe.supervision.max_dropped_in_a_row,
                max_refused_in_a_row=self.recipe.supervision.max_refused_in_a_row,
                max_load_failures_in_a_row=self.recipe.supervision.max_load_failures_in_a_row,
                resumed=self.resume,
                batch_groups={p.id: self.recipe.batch_groups(p) for p in self.recipe.policies},
                on_stall=self.fail,
                progress_warn_s=self.recipe.supervision.progress_warn_s,
                max_idle_s=self.recipe.supervision.max_idle_s,
                evals=EvalLog(
                    self.rd.evals,
                    every_steps=self.recipe.eval.every_steps,
                    streams={
                        name: self.recipe.stream_policies(spec)
                        for name, spec in self.recipe.eval_streams()
                    },
                )
                if self.recipe.evaluating
                else None,
            )
            observing = asyncio.create_task(self.observer.run())
            rotating = self._rotate_logs()
            self.elastic = Elastic(self)
            await self.elastic.restore(restore)
            self.state = "running"
            self.write_run_json()
            elastic = asyncio.create_task(self.elastic.run())
            status, code = await self._watch()
        except Interrupted:
            status, code = "interrupted", 128 + self.signals[0]
        except ChildFailed as exc:
            log.error("%s", exc)
        except Exception as exc:  # a bug of the supervisor's own: the run ends, cleanly
            log.exception("the supervisor failed")
            status, code = f"failed: supervisor error: {type(exc).__name__}: {exc}", EXIT_FAILED
        finally:
            self.state = "stopping"
            for task in (elastic, observing, rotating):
                if task is not None:
                    await cancel_and_wait(task)
            if elastic is not None and elastic.done() and not elastic.cancelled():
                with contextlib.suppress(Exception):
                    elastic.result()
            for request in control.take_requests(self.rd):
                control.answer(self.rd, request["id"], {"ok": False, "error": "the run is ending"})
            try:
                await shutdown(self, status, time.monotonic() - started, dataset)
            except Exception as exc:  # never a child left behind, never no summary
                log.exception("the orderly shutdown failed: stopping every child")
                await stop_all(list(self.children.values()), self.grace_s)
                status, code = f"{status}; shutdown error: {type(exc).__name__}: {exc}", 1
                write_failure_summary(self.rd.summary, status, time.monotonic() - started)
            finally:
                self.state = "ended"
                self.write_run_json()
        log.info(
            "run %s: %s (%s)%s", self.recipe.name, status, self.rd.root, learned(self.rd.summary)
        )
        return code
