"""The start of an `astra run`: which services start beside which, and what each waits for.

The supervised warm-up (`astra sft` per policy, when the recipe has one; kept on
--resume, and shared by policies whose warm-up would be the same command) runs
with Dataflow and the WeightService starting beside it: neither needs the
warmed-up model. Then every RaaS (--dataflow) and one trainer per policy with
steps left (--dataflow, --weights) start together, from the warmed-up models:
neither waits for the other (a trainer asks Dataflow for batches, which waits
for rollouts), so their start-ups (imports, model load) overlap. That stage
waits for the warm-up's end and for the address lines of the two before it. A
WeightService that cannot take its port back on --resume starts again alone on
any port. The run's end is astra.run.ending's; the supervisor
(astra.run.supervisor) owns the children and is handed here as a RunView.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from astra.run import layout
from astra.run.children import Child, ChildFailed
from astra.run.recipe import Recipe
from astra.run.run_view import RunView

log = logging.getLogger("astra.run")


async def start_all(sup: RunView, dataset: Any, steps: dict[str, int]) -> None:
    """The warm-up (Dataflow and the WeightService starting meanwhile), then every RaaS and
    every trainer, which start from the warmed-up models."""
    core = asyncio.ensure_future(start_core(sup, *core_children(sup, dataset)))
    try:
        sup.started_recipe = await warmup(sup, dataset)
    except BaseException:
        core.cancel()
        with contextlib.suppress(BaseException):
            await core
        raise
    df, weights = await core
    r, rd = sup.started_recipe, sup.rd
    raas = []
    for i, name in enumerate(r.raas_names):
        spec = sup.raas_specs[name] = r.raas[i]
        command = layout.raas_command(r, i, rd, df.address)
        raas.append(sup.add_child(name, "raas", command, r.raas_policies(spec), spec=spec))
        raas[-1].extra = {"capacity": spec.capacity, "labels": spec.labels, "joined": "recipe"}
    trainers = [
        sup.add_child(
            f"trainer-{p.id}",
            "trainer",
            layout.trainer_command(
                r, p, rd, dataflow=df.address, weights=weights.address, resume=sup.resume
            ),
            [p.id],
        )
        for p in r.policies
        if steps[p.id] > 0
    ]
    # Neither waits for the other (a trainer asks Dataflow for batches, which waits for
    # rollouts): their start-ups (imports, model load) overlap.
    await sup.start_children(raas + trainers)


async def warmup(sup: RunView, dataset: Any) -> Recipe:
    """Runs `astra sft` for each policy not warmed up yet; the recipe the services start from."""
    r, rd = sup.recipe, sup.rd
    if not r.warmup.steps:
        return r
    data = await asyncio.to_thread(layout.warmup_data, r, rd, dataset)
    # Policies whose warm-up would be the same command (model, records, settings) share
    # one: the later ones' model is a link to the first's, so they start on one base.
    first: dict[tuple[str, ...], str] = {}
    for p in r.policies:
        out = rd.warmup_model(p.id)
        done = out.parent / "result.json"
        mine = await asyncio.to_thread(layout.policy_warmup_data, r, rd, data, p.id)
        command = layout.sft_command(r, p, rd, mine)
        twin = first.setdefault(tuple(a for a in command if a != str(out)), p.id)
        if out.is_dir():  # astra sft renames it into place when complete
            sup.warmup[p.id] = json.loads(done.read_text()) if done.is_file() else {}
            log.info("warm-up of %s: kept from %s", p.id, out)
            continue
        if twin != p.id:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.symlink_to(rd.warmup_model(twin).resolve(), target_is_directory=True)
            sup.warmup[p.id] = sup.warmup.get(twin, {})
            done.write_text(json.dumps(sup.warmup[p.id], indent=2) + "\n")
            log.info("warm-up of %s: the same as %s's, shared (%s)", p.id, twin, out)
            continue
        name = f"warmup-{p.id}"
        child = sup.new_child(name, "warmup", command, rd.log(name), r.env)
        sup.children["warmup"].append(child)
        await child.spawn()
        log.info(
            "warm-up of %s: %d supervised steps on %s (pid %s)",
            p.id,
            r.warmup.steps,
            mine,
            child.pid,
        )
        try:
            result = await sup.until_stop(child.result())
        except ChildFailed as exc:
            raise ChildFailed(f"{exc}\n{sup.tail(child)}") from exc
        finally:
            if child.returncode is None:
                await child.stop(sup.grace_s)
            child.close()
            sup.children["warmup"].remove(child)
        done.write_text(json.dumps(result, indent=2) + "\n")
        sup.warmup[p.id] = result
        log.info(
            "warm-up of %s done in %.1fs: loss %.3f -> %.3f",
            p.id,
            result.get("seconds", 0.0),
            result.get("loss_first", float("nan")),
            result.get("loss_last", float("nan")),
        )
    return layout.after_warmup(r, rd)


def core_children(sup: RunView, dataset: Any) -> tuple[Child, Child]:
    """Dataflow and the WeightService, not started yet. Neither needs a warmed-up model
    (Dataflow's config takes the policies' vocabulary sizes, which a warm-up keeps), so
    they start while the warm-up runs; their commands are made before it starts (Dataflow's
    writes the held-out records, which the warm-up's records are then drawn apart from)."""
    r, rd = sup.started_recipe, sup.rd
    df = sup.add_child("dataflow", "dataflow", layout.dataflow_command(r, rd, dataset))
    weights = sup.add_child("weights", "weights", layout.weights_command(r, rd, sup.weights_port))
    return df, weights


async def start_core(sup: RunView, df: Child, weights: Child) -> tuple[Child, Child]:
    """Starts Dataflow and the WeightService; a WeightService that could not take its port
    again (--resume) starts again alone on any port."""
    port = sup.weights_port
    try:
        await sup.start_children([df, weights])
    except ChildFailed:
        if not port or weights.returncode is None:
            raise
        log.warning("WeightService could not take port %d again; any port instead", port)
        await weights.stop(0)
        sup.children["core"].remove(weights)
        command = layout.weights_command(sup.started_recipe, sup.rd)
        weights = sup.add_child("weights", "weights", command)
        await sup.start_children([weights])
    return df, weights
