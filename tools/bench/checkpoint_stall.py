"""How long a checkpoint holds the training loop: staged between steps vs written after a drain.

    python tools/bench/checkpoint_stall.py           # writes the "Trainer: checkpoint stall"
                                                      # section of BENCHMARKS.md (~3 min)
    python tools/bench/checkpoint_stall.py --quick   # fewer steps; prints the section only
    python tools/bench/checkpoint_stall.py --quick --tiny-only   # the tiny model only (~20 s)

A trainer's checkpoint must never be ahead of the versions Dataflow and the WeightService
have (a resume continues from a published version). Two ways to keep that, in one run, on the
same batches, against one real WeightService process (tools/bench/trainer.py's harness):

  staged   the product (astra.trainer.state): the checkpoint is written under a temporary
           name between two steps and renamed into place once its version is published and
           announced, while the next steps train;
  drained  the baseline (Astra before 2026-12-06): the loop waits until every queued version
           is published and announced (`publisher.drain()`), then writes the checkpoint.

Each mode has its own Trainer and policy, a checkpoint every `every` steps, and runs blocks of
steps in alternating order. A step's time is the wall time of `train_step_async` (the
checkpoint's share included; the baseline's drain and write counted in its checkpoint step).
Figures: median (min-max) over the measured steps; "checkpoint steps" are those that took one.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import replace_section
from trainer import (
    Service,
    Shape,
    bench_trainer,
    machine,
    med,
    model_for,
)

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Trainer: checkpoint stall"
MODES = ("staged", "drained")


@dataclass
class Mode:
    name: str
    trainer: Any
    root: Path
    every: int
    checkpoint_s: list[float] = field(default_factory=list)
    other_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0


async def make(
    name: str, shape: Shape, model: str, hf: dict, service: Service, tmp: Path, every: int
) -> Mode:
    policy = f"ckpt-{shape.name.strip('~')}-{name}"
    root = tmp / policy
    # staged: the trainer's own schedule; drained: `block` checkpoints after a drain
    ckpt = {"dir": str(root), "every_steps": every if name == "staged" else 0}
    trainer, _ = bench_trainer(policy, shape, model, hf, service, checkpoint=ckpt)
    await trainer.initialize()
    return Mode(name, trainer, root, every)


async def block(m: Mode, steps: int, measured: bool) -> None:
    t = m.trainer
    t0 = time.perf_counter()
    for _ in range(steps):
        s0 = time.perf_counter()
        r = await t.train_step_async()
        took = r.step % m.every == 0
        if m.name == "drained" and took:
            await t.publisher.drain()
            await t._checkpoint_now()
        if measured:
            (m.checkpoint_s if took else m.other_s).append(time.perf_counter() - s0)
    await t.publisher.drain()
    await t.committed()  # unmeasured: the next mode starts on a quiet service
    if measured:
        m.wall_s += time.perf_counter() - t0


async def bench(
    shape: Shape, tmp: Path, service: Service, rounds: int, steps: int, every: int, log
) -> dict[str, Mode]:
    model, hf = model_for(shape, tmp, log)
    shape.vocab = int(hf["vocab_size"])
    modes = {n: await make(n, shape, model, hf, service, tmp, every) for n in MODES}
    shape.params = sum(p.numel() for p in modes["staged"].trainer.model.parameters())
    for m in modes.values():
        await block(m, 1, measured=False)  # warm-up
    for rnd in range(rounds):
        for name in MODES if rnd % 2 == 0 else MODES[::-1]:
            await block(modes[name], steps, measured=True)
            log(f"{shape.name} {name} round {rnd}: done")
    for m in modes.values():
        await m.trainer.shutdown()
        if not any(m.root.glob("step-*")):
            raise RuntimeError(f"{m.name}: no checkpoint written under {m.root}")
    return modes


def section(
    results: list[tuple[Shape, dict[str, Mode]]],
    every: int,
    started: str,
    seconds: float,
    loads: tuple,
    quick: bool,
) -> str:
    lines = [SECTION, ""]
    lines += [
        "| model | mode | checkpoint step, s | other steps, s | wall per step, s | steps measured |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for shape, modes in results:
        for m in modes.values():
            n = len(m.checkpoint_s) + len(m.other_s)
            lines.append(
                f"| {shape.name} ({shape.params / 1e6:.1f}M) | {m.name} | {med(m.checkpoint_s, '{:.3f}')} "
                f"| {med(m.other_s, '{:.3f}')} | {m.wall_s / max(n, 1):.3f} | {n} |"
            )
    lines += [""]
    for shape, modes in results:
        s, d = modes["staged"], modes["drained"]
        cs, cd = statistics.median(s.checkpoint_s), statistics.median(d.checkpoint_s)
        ws = s.wall_s / (len(s.checkpoint_s) + len(s.other_s))
        wd = d.wall_s / (len(d.checkpoint_s) + len(d.other_s))
        os_, od = statistics.median(s.other_s), statistics.median(d.other_s)
        lines.append(
            f"- {shape.name}: the checkpoint step takes {cs:.3f} s staged against {cd:.3f} s "
            f"drained ({cd / cs:.2f}x), {cs - os_:.3f} s and {cd - od:.3f} s more than the "
            f"other steps of its mode; over the blocks, {ws:.3f} s per step against "
            f"{wd:.3f} s ({wd / ws:.2f}x)."
        )
    lines += [
        "",
        f"Measured {started} with `python tools/bench/checkpoint_stall.py{' --quick' if quick else ''}` "
        f"({seconds:.0f} s) on this machine: {machine()}; load average (1 min) {loads[0]:.1f} at "
        f"the start, {loads[1]:.1f} at the end (the machine is shared with other agents).",
        "",
        f"Method: one WeightService process; per model two Trainers (float32, AdamW, bf16 "
        f"publishing, `publish.max_pending` 2) on identical seeded batches, a checkpoint every "
        f"{every} steps (model, optimiser, RNG, digests, fsync); blocks of steps alternate "
        "between the modes, each block ending with its queue drained and its checkpoint "
        "committed, unmeasured.",
        "",
        "- Staged: the checkpoint step pays for writing the checkpoint under its temporary name; "
        "its rename waits, beside the next steps, for the version to be announced.",
        "- Drained: the checkpoint step also waits for the versions still queued for publishing "
        "(up to `publish.max_pending`), as the trainer did before.",
        "- Where writing the checkpoint itself dominates (the ~100M model's model and AdamW "
        "moments, fsynced), staging saves only the wait for the publish queue; it saves more "
        "where publishing a version takes longer than writing a checkpoint (a slow link to the "
        "WeightService).",
        "- No target: this section shows what staging removes from the loop; a resume still "
        "finds only checkpoints whose version was announced (tests/test_trainer_checkpoint_commit.py).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps; print only")
    ap.add_argument("--write", dest="write", action="store_true", default=None)
    ap.add_argument("--no-write", dest="write", action="store_false")
    ap.add_argument("--tiny-only", action="store_true", help="leave the ~100M model out")
    a = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load0 = os.getloadavg()[0]

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    every = 2
    plans = [
        (Shape("tiny", 8, 8, 64, 192, warm=0, steps=0, rounds=0), 4 if not a.quick else 1, 8),
        (Shape("~100M", 2, 4, 16, 48, warm=0, steps=0, rounds=0), 2 if not a.quick else 1, 4),
    ]
    if a.tiny_only:
        plans = plans[:1]
    tmp = Path(tempfile.mkdtemp(prefix="astra-bench-ckpt-"))
    service = None
    results = []
    try:
        service = Service(tmp / "store", tmp / "service.log")
        for shape, rounds, steps in plans:
            results.append(
                (shape, asyncio.run(bench(shape, tmp, service, rounds, steps, every, log)))
            )
            shutil.rmtree(tmp / "m100", ignore_errors=True)
    finally:
        if service is not None:
            service.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    text = section(
        results, every, started, time.perf_counter() - t_start, (load0, os.getloadavg()[0]), a.quick
    )
    print()
    print(text)
    if a.write if a.write is not None else not a.quick:
        replace_section(ROOT / "BENCHMARKS.md", SECTION, text)
        log(f"wrote the {SECTION[3:]} section of BENCHMARKS.md")


if __name__ == "__main__":
    main()
