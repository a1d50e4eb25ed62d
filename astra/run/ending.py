"""The end of an `astra run`: children stopped in order, the last figures taken, summary.json.

Trainers stop first; with held-out evaluation on and the run completed, the
RaaS keep serving until the evaluation of the last multiple of
eval.every_steps the trainers reached has finished (eval.final_wait_s at
most); the RaaS are asked for their work counters and stopped; the observer
takes its last rows and Dataflow view; Dataflow and the WeightService stop;
then the random and after-warm-up baselines are measured (a completed run
only) and summary.json is written (astra.run.summary, plus the warm-up, RaaS,
elastic, restart and evaluation blocks). A start whose Dataflow never answered
writes no figures: the summary of the run so far is kept (astra.run.ending.keep_summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astra.run import layout
from astra.run.children import stop_all
from astra.run.elastic import raas_work
from astra.run.evals import EvalLog, final_target
from astra.run.observe import Observer
from astra.run.run_view import RunView
from astra.run.summary import build_summary, read_state, trainer_final_step, write_summary

log = logging.getLogger("astra.run")


async def final_eval(sup: RunView, obs: Observer, evals: EvalLog) -> None:
    """Waits (eval.final_wait_s at most) for each evaluation of the last multiple of
    eval.every_steps that its stream's first policy reached, while the RaaS still run."""
    recipe = sup.recipe
    e = recipe.eval
    follows = {name: recipe.stream_policies(spec)[0] for name, spec in recipe.eval_streams()}
    deadline = time.monotonic() + e.final_wait_s
    missing: dict[str, int | None] = dict.fromkeys(follows)
    while time.monotonic() < deadline:
        if await obs.poll_dataflow() is not None:
            obs.record_evals()
            versions = obs.last_dataflow["versions"]
            missing = {}
            for name, policy in follows.items():
                target = final_target(versions, policy, e.every_steps)
                newest = evals.newest(name)
                if target is None or newest is None or newest < target:
                    missing[name] = target
            if not missing:
                return
        await asyncio.sleep(0.5)
    for name, target in missing.items():
        log.warning(
            "the evaluation %s of version %s did not finish within %.0fs",
            name,
            target,
            e.final_wait_s,
        )


def final_steps(sup: RunView) -> dict[str, int | None]:
    """Each policy's last step: what its trainer logged when it stopped, or its newest
    checkpoint's step (a trainer writes one at its last step), whichever is later. A run
    resumed only to take its summary has no trainer running."""
    out: dict[str, int | None] = {}
    for p in sup.recipe.policies:
        logged = trainer_final_step(sup.rd.log(f"trainer-{p.id}"))
        saved = layout.checkpoint_step(sup.rd.checkpoints(p.id))
        known = [s for s in (logged, saved) if s is not None]
        out[p.id] = max(known) if known else None
    return out


@contextlib.contextmanager
def _observing(what: str) -> Iterator[None]:
    """The observer's part of the ending: its failure is logged and the ending goes on (every
    child still stopped, summary.json still written from Dataflow's records)."""
    try:
        yield
    except Exception:
        log.exception("%s failed; the run ends without it", what)


def keep_summary(path: Path, status: str) -> None:
    """A start that never reached Dataflow: the summary of the run so far stays as it is;
    with none yet, one that says the start failed, without figures."""
    if path.is_file():
        log.warning("%s kept: this start (%s) never got an answer from Dataflow", path, status)
        return
    write_summary(
        path,
        {
            "status": status,
            "started": False,
            "notes": ["this start never got an answer from Dataflow: no figures to report"],
        },
    )


async def shutdown(sup: RunView, status: str, wall: float, dataset: Any) -> None:
    """Stops everything in order (see astra.run.supervisor) and writes summary.json."""
    obs = sup.observer
    await sup.restarts.close()  # none starts while everything stops
    await stop_all([sup.children["trainer"]], sup.grace_s)
    if status == "completed" and obs is not None and obs.evals is not None:
        await final_eval(sup, obs, obs.evals)
    raas = sup.children["raas"]
    work = await asyncio.gather(*(raas_work(c) for c in raas))  # before they stop
    await stop_all([raas], sup.grace_s)
    sup.write_run_json()
    dataflow = sup.children["core"][0] if sup.children["core"] else None
    if obs is not None:
        with _observing("reading the trainers' last steps"):
            obs.read_logs()  # the steps logged since the last tick
            obs.flush()
    if obs is not None and dataflow is not None and dataflow.returncode is None:
        with _observing("taking Dataflow's last view"):
            await obs.poll_dataflow()  # the last view: no trainer, no RaaS
            obs.print_status(force=True)
            obs.end_line()
    await stop_all([sup.children["core"]], sup.grace_s)
    if obs is not None:
        with _observing("closing the observer's outputs"):
            await obs.close()
            await obs.finish()  # event files closed, plot.png drawn from metrics.jsonl
    if dataflow is None:
        return
    if obs is None or not obs.last_dataflow:
        # Dataflow never answered in this start: its counters are unknown, and figures
        # built without them would invent losses (every group dispatched, none accounted).
        keep_summary(sup.rd.summary, status)
        return
    baseline: dict[str, Any] = {"accuracy": None, "method": "not measured: run not completed"}
    warmup_accuracy = None
    if status == "completed":
        from astra.run.baseline import random_baseline

        samples = sup.recipe.observe.baseline_samples
        baseline = await asyncio.to_thread(random_baseline, sup.recipe, dataset, samples)
        if sup.warmup:  # the same measurement on the warmed-up model: where RL started
            after = await asyncio.to_thread(random_baseline, sup.started_recipe, dataset, samples)
            warmup_accuracy = after["accuracy"]
    previous = None
    if sup.resume:
        with contextlib.suppress(OSError, ValueError):
            previous = json.loads(sup.rd.summary.read_text())
        previous = previous if isinstance(previous, dict) else None
    summary = build_summary(
        status=status,
        wall_seconds=wall,
        previous=previous,
        dataflow=obs.last_dataflow if obs is not None else {},
        state=read_state(sup.rd.dataflow_state),
        history=obs.history if obs is not None else {},
        final_steps=final_steps(sup),
        baseline=baseline,
    )
    if sup.recipe.warmup.steps:
        summary["warmup"] = {
            "steps": sup.recipe.warmup.steps,
            "accuracy_after": warmup_accuracy,
            "policies": sup.warmup,
            "method": "supervised steps on prompt/answer records disjoint from the RL "
            "prompts; accuracy_after measured like random_baseline_accuracy, on the "
            "warmed-up model",
        }
    summary["raas"] = {
        **{
            str(r["name"]): {
                **{k: r.get(k) for k in ("capacity", "labels", "joined", "removed")},
                "work": r.get("work", {}),
            }
            for r in sup.removed
        },
        **{
            c.name: {
                **{k: c.extra.get(k) for k in ("capacity", "labels", "joined")},
                "removed": None,
                "work": w,
            }
            for c, w in zip(raas, work, strict=True)
        },
    }
    summary["elastic"] = sup.elastic_events
    summary["restarts"] = sup.restarts.events
    if obs is not None and obs.evals is not None:
        obs.record_evals()
        summary["eval"] = obs.evals.summary()
    write_summary(sup.rd.summary, summary)
    keys: tuple[str, ...] = (
        "steps",
        "groups_trained",
        "groups_lost",
        "groups_duplicated",
        "versions_published",
    )
    keys += ("accuracy_first10", "accuracy_last10")  # what the run learned, in its last line
    shown = {k: summary.get(k) for k in keys}
    if summary.get("eval", {}).get("results"):
        shown["held_out_first"] = summary["eval"]["results"][0].get("mean_reward")
        shown["held_out_last"] = summary["eval"].get("last")
    log.info("summary %s: %s", sup.rd.summary, shown)
