"""The embedded default of `astra run`: wall time and accuracy curve, with its ablations.

    python tools/bench/default_run.py             # default + the two ablations (~8 min on the
                                                  # 2-core machine); writes the "Embedded
                                                  # default" section of BENCHMARKS.md
    python tools/bench/default_run.py --only default --no-write   # one run, section printed

Each variant is a real `astra run` (every service its own process, as `make run` starts them)
in a temporary run directory:

  default        the embedded recipe: supervised warm-up (`astra sft`) on problems disjoint from
                 the RL prompts, then RL;
  no RL          the same warm-up, then the RL loop with learning rate 0: the warmed-up policy
                 sampled the same way for the same number of steps (what RL adds is the
                 difference to `default`);
  no warm-up     RL from the random `tiny` model (what the warm-up is for).

Accuracy is what the trainer reports per step: the fraction of the step's rollouts (sampled at
temperature 1, scored by exact match) that are right; the curve is its mean over blocks of
steps, as observed by the run's observer (it sees most steps, not all).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import replace_section

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Embedded default (`astra run`)"
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "no RL": ["--set", "trainer.optim.lr=1e-12"],  # AdamW needs lr > 0: a no-op update
    "no warm-up": ["--set", "warmup.steps=0"],
}
BLOCK = 30


def run_variant(name: str, extra: list[str], root: Path, timeout_s: float) -> dict[str, Any]:
    run_dir = root / name.replace(" ", "-")
    cmd = [sys.executable, "-m", "astra.run", "--run-dir", str(run_dir), *extra]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: astra run exited {proc.returncode}\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    curve: dict[int, list[float]] = {}
    for row in rows:
        if row.get("accuracy") is not None:
            curve.setdefault((row["step"] - 1) // BLOCK, []).append(row["accuracy"])
    warm = summary.get("warmup") or {}
    warm_seconds = sum(p.get("seconds", 0.0) for p in (warm.get("policies") or {}).values())
    return {
        "name": name,
        "wall_s": wall,
        "summary": summary,
        "warmup_s": warm_seconds,
        "curve": {b: sum(v) / len(v) for b, v in sorted(curve.items())},
        "observed": sum(len(v) for v in curve.values()),
    }


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def section(results: list[dict[str, Any]], load: str, total_s: float) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cores = os.cpu_count()
    steps = results[0]["summary"]["steps"]
    lines = [
        SECTION,
        "",
        f"Measured {now} with `python tools/bench/default_run.py` ({total_s:.0f} s) on this "
        f"machine: {cores} cores, no GPU, Python {platform.python_version()}; load average "
        f"before the runs {load}.",
        "",
        "The task: two-digit additions (`37+45=` -> `82`), scored by exact match of the text "
        "before end-of-sequence. Each variant is one `astra run` (Dataflow, WeightService, two "
        f"RaaS with the torch engine, one trainer: {steps} RL steps of 8 groups x 4 samples).",
        "",
        "| variant | wall s | warm-up s | random model | after warm-up | RL steps 1-10 "
        "| last 10 steps | held-out, version 0 | held-out, last version "
        "| groups lost / duplicated |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["summary"]
        warm = s.get("warmup") or {}
        ev = s.get("eval") or {}
        last_v = f" (v{ev['last_version']})" if ev.get("last_version") is not None else ""
        lines.append(
            f"| {r['name']} | {r['wall_s']:.0f} | {r['warmup_s']:.1f} "
            f"| {fmt(s.get('random_baseline_accuracy'))} | {fmt(warm.get('accuracy_after'))} "
            f"| {fmt(s.get('accuracy_first10'))} | **{fmt(s.get('accuracy_last10'))}** "
            f"| {fmt(ev.get('first'))} | **{fmt(ev.get('last'))}**{last_v} "
            f"| {s.get('groups_lost')} / {s.get('groups_duplicated')} |"
        )
    blocks = sorted({b for r in results for b in r["curve"]})
    lines += [
        "",
        f"Accuracy curve: mean per-step accuracy over blocks of {BLOCK} steps.",
        "",
        "| steps | " + " | ".join(r["name"] for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for b in blocks:
        cells = [fmt(r["curve"].get(b)) for r in results]
        lines.append(f"| {b * BLOCK + 1}-{(b + 1) * BLOCK} | " + " | ".join(cells) + " |")
    by = {r["name"]: r["summary"] for r in results}
    last = (by.get("default") or {}).get("accuracy_last10")
    wall = next((r["wall_s"] for r in results if r["name"] == "default"), None)
    verdict = []
    if last is not None and wall is not None:
        met = last >= 0.8 and wall <= 600
        verdict.append(
            f"**Target (>= 0.8 exact-match accuracy over the last 10 steps within 10 minutes): "
            f"{'met' if met else 'missed'}: {last:.2f} in {wall:.0f} s.**"
        )
    lines += [
        "",
        *verdict,
        "",
        "Reading: 'random model' is the untrained `tiny` model sampled once on 256 prompts "
        "(summary.json `random_baseline_accuracy`); 'after warm-up' the same measurement on the "
        "warmed-up model, where RL starts. 'held-out' is the recipe's evaluation: 256 "
        "problems in neither the RL nor the warm-up data, greedy, run by the RaaS at versions "
        "0, 50, ... (summary.json `eval`); unlike the per-step accuracy it is measured on "
        "prompts the policy never trained on. 'no RL' runs the whole system with learning rate "
        "1e-12, so its curve is the warmed-up policy's own level under the same sampling: the "
        "gap to 'default' is what RL adds. 'no warm-up' shows why the recipe has the stage: "
        "from random weights almost no rollout is right, so group-relative advantages are "
        "almost always zero and RL has nothing to learn from in this budget.",
        "",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", choices=[*VARIANTS, "all"], default="all")
    ap.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    args = ap.parse_args(argv)
    names = list(VARIANTS) if args.only == "all" else [args.only]
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    root = Path(tempfile.mkdtemp(prefix="astra-bench-default-"))
    started = time.monotonic()
    try:
        results = []
        for name in names:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            results.append(run_variant(name, VARIANTS[name], root, args.timeout))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = section(results, load, time.monotonic() - started)
    print(text)
    if not args.no_write and args.only == "all":
        replace_section(Path(args.output), SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
