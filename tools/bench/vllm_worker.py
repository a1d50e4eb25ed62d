"""vLLM on a CPU core: its worker in a process of its own against inside the engine-core process.

    python tools/bench/vllm_worker.py                 # ~10 min on 2 cores; writes its section
    python tools/bench/vllm_worker.py --runs 0 --seconds 4 --no-write   # the engine part only

On the CPU, vLLM runs its model in a worker process beside the engine-core process (its
multiprocessing executor) unless `VLLM_ENABLE_V1_MULTIPROCESSING=0`, when the worker runs inside
the engine core (the uniprocess executor). Between steps the worker process spins on
`sched_yield` waiting for the next message; `astra run` gives a vLLM RaaS whose share is one core
the in-process worker (astra.run.threads). Two measurements, the two modes alternated:

- engine: one server on the tiny model (`VLLMEngine.launch`, as a RaaS launches it, on one core's
  share: `OMP_NUM_THREADS=1` and `VLLM_CPU_OMP_THREADS_BIND` = one core), `--concurrency` clients
  each sending the adapter's requests one after another (8 new tokens, temperature 1, seeded) for
  `--seconds`: sequences per second and CPU seconds of the server's processes per sequence.
- run: `astra run configs/recipes/vllm_cpu.yaml` with `--steps` RL steps, the in-process worker
  (the default) and the worker process (`env.VLLM_ENABLE_V1_MULTIPROCESSING='1'`): seconds per
  RL step (the span from step 10 to the last over the steps between) and wall time of the run.

A missing vLLM environment ends it non-zero; figures are only written for what ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import replace_section
from runs import astra_run, load, measured
from swap_pause import STARTUP_S, vllm_python

from astra.engine.api import Sampling

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## vLLM on a CPU core: the worker in the engine-core process"
MP_VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"
MODES = {"worker process": "1", "in engine core": "0"}  # the mode -> VLLM_ENABLE_V1_MULTIPROCESSING


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its descendants now alive."""
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def engine_mode(
    python: str, model: Path, mode: str, concurrency: list[int], seconds: float, log: Path
) -> dict[str, dict[str, float]]:
    """One server in `mode`: per concurrency, sequences/s and server CPU-ms per sequence."""
    from astra.engine.http import VLLMEngine
    from astra.engine.tokenizer import CharTokenizer

    tok = CharTokenizer()
    one_core = {MP_VAR: MODES[mode], "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    with mock.patch.dict(os.environ, one_core):  # what the server inherits, and only it
        engine = VLLMEngine.launch(
            model, "p", tok, extra_args=["--enforce-eager"], log_path=log, python=python
        )
    out: dict[str, dict[str, float]] = {}
    seed = 0
    try:
        await engine.wait_ready(STARTUP_S)
        pid = engine.process.proc.pid  # type: ignore[union-attr]

        async def client(until: float, done: list[int]) -> None:
            nonlocal seed
            while time.perf_counter() < until:
                seed += 1
                a, b = seed % 90 + 10, (seed * 7) % 90 + 10
                sampling = Sampling(max_new_tokens=8, temperature=1.0, seed=seed)
                await engine.generate("p", tok.encode(f"{a}+{b}="), sampling)
                done[0] += 1

        for c in concurrency:
            await asyncio.gather(*(client(time.perf_counter() + 2.0, [0]) for _ in range(c)))
            done = [0]
            cpu0, t0 = tree_cpu_s(pid), time.perf_counter()
            await asyncio.gather(*(client(t0 + seconds, done) for _ in range(c)))
            wall, cpu = time.perf_counter() - t0, tree_cpu_s(pid) - cpu0
            out[str(c)] = {"seqs_per_s": done[0] / wall, "cpu_ms_per_seq": cpu / done[0] * 1e3}
    finally:
        await engine.close()
    return out


def run_mode(mode: str, steps: int, root: Path, k: int, timeout_s: float) -> dict[str, Any]:
    sets = [f"trainer.num_steps={steps}", f"supervision.startup_timeout_s={STARTUP_S}"]
    sets += ["eval.every_steps=0", f"raas.0.engine_python={vllm_python()}"]
    if MODES[mode] == "1":
        sets.append(f"env.{MP_VAR}='1'")
    summary, rows, wall = astra_run(
        ["configs/recipes/vllm_cpu.yaml"], root / f"run{k}", timeout_s, sets
    )
    times = [r["time"] for r in rows if r.get("step", 0) >= 10]
    if summary.get("steps") != steps or len(times) < 2:
        raise RuntimeError(f"{mode}: {summary.get('steps')} of {steps} steps")
    return {
        "mode": mode,
        "s_per_step": (times[-1] - times[0]) / (len(times) - 1),
        "wall_s": wall,
        "lost": summary["groups_lost"],
        "duplicated": summary["groups_duplicated"],
    }


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"


def section(engine: list[dict], runs_: list[dict], conc: list[int], args, total_s, before) -> str:
    lines = [SECTION, ""]
    if engine:
        lines += [
            "| concurrent requests | worker process: seqs/s | in engine core: seqs/s "
            "| worker process: server CPU-ms/seq | in engine core: server CPU-ms/seq "
            "| CPU per sequence, in engine core / worker process |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for c in map(str, conc):
            get = {
                m: [e["by_c"][c] for e in engine if e["mode"] == m] for m in MODES
            }  # fmt: skip
            wp, ec = get["worker process"], get["in engine core"]
            ratios = [
                b["cpu_ms_per_seq"] / a["cpu_ms_per_seq"] for a, b in zip(wp, ec, strict=True)
            ]
            lines.append(
                f"| {c} | {med([x['seqs_per_s'] for x in wp])} | {med([x['seqs_per_s'] for x in ec])} "
                f"| {med([x['cpu_ms_per_seq'] for x in wp])} | {med([x['cpu_ms_per_seq'] for x in ec])} "
                f"| {med(ratios)} |"
            )
        lines.append("")
    if runs_:
        lines += [
            "| `astra run` vllm_cpu | runs | s per RL step, median (min-max) | run wall s | "
            "lost / duplicated |",
            "|---|---:|---:|---:|---|",
        ]
        for m in MODES:
            rs = [r for r in runs_ if r["mode"] == m]
            lost = f"{sum(r['lost'] for r in rs)} / {sum(r['duplicated'] for r in rs)}"
            lines.append(
                f"| {m} | {len(rs)} | {med([r['s_per_step'] for r in rs])} "
                f"| {med([r['wall_s'] for r in rs])} | {lost} |"
            )
        lines.append("")
    lines += [
        "- Why: the worker process waits for the engine core's next step by spinning on "
        "`sched_yield` and sends each step's output back through shared memory; inside the "
        "engine-core process both are gone, and on a one-core share the spinning took CPU from "
        "the trainer, the RaaS and vLLM's API server.",
        f"- Engine part: {args.repeats} server(s) per mode, alternated, {args.seconds:.0f} s per "
        "concurrency after 2 s of warm-up; server CPU is every process of the server (API "
        "server, engine core, worker); the clients run in the benchmark's process.",
        f"- Run part: {args.runs} run(s) per mode, alternated, {args.steps} RL steps each, "
        "evaluation off; the figures are medians (min-max).",
        "- " + measured("vllm_worker.py", total_s, before),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="servers per mode (engine part)")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=2, help="astra runs per mode (0: none)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    python = vllm_python()
    if python is None:
        print("vLLM is not installed (make vllm, or set ASTRA_VLLM_PYTHON)", file=sys.stderr)
        return 2
    conc = [int(x) for x in args.concurrency.split(",")]
    before, started = load(), time.monotonic()
    engine, runs_ = [], []
    with tempfile.TemporaryDirectory(prefix="astra-bench-") as tmp:
        root = Path(tmp)
        from astra.engine.tiny import save_tiny

        model = save_tiny(root / "model")
        for i in range(args.repeats):
            for mode in MODES if i % 2 == 0 else reversed(MODES):
                log = root / f"vllm-{i}-{MODES[mode]}.log"
                by_c = asyncio.run(engine_mode(str(python), model, mode, conc, args.seconds, log))
                engine.append({"mode": mode, "by_c": by_c})
                print(json.dumps(engine[-1]), flush=True)
        for i in range(args.runs):
            for mode in MODES if i % 2 == 0 else reversed(MODES):
                runs_.append(run_mode(mode, args.steps, root, len(runs_), args.timeout))
                print(json.dumps(runs_[-1]), flush=True)
    text = section(engine, runs_, conc, args, time.monotonic() - started, before)
    print(text)
    if not args.no_write:
        replace_section(ROOT / "BENCHMARKS.md", SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
