"""Staleness that pays: a larger off-policy bound (eta) with M2PO or IcePop masking, real runs.

    python tools/bench/staleness.py                 # four runs of 300 steps (~9 min on 2 cores),
                                                    # writes the "Staleness" section
    python tools/bench/staleness.py --steps 20 --no-write   # a quick look

Each variant is one real `astra run` of the embedded task (configs/recipes/default.yaml: the
built-in engine, warm-up then GRPO), in the same invocation, differing only in Dataflow's
off-policy bound `dataflow.gate.max_version_lag` (eta: how many versions a rollout may lag the
trainer) and the trainer's loss masks (astra/trainer/losses.py):
  eta 2            the default;
  eta 2, whole gap the default with the gate's barrier scored on the whole version gap
                   (gate.barrier_gap_allowance = 0, as before 2026-12-07) instead of the gap
                   beyond eta;
  eta 8            four times the lag, no correction beyond the default's decoupled PPO;
  eta 8 + M2PO     trainer.loss.m2po_tau = 0.04 (the M2PO paper's value);
  eta 8 + IcePop   trainer.loss.ratio_band = [0.5, 2.0].
Reported: held-out accuracy at the last version (256 problems, greedy), per-step accuracy of
the last 10 steps, the trainer's idle share (time in FetchBatch over step time, from the
trainer's running sums in metrics.jsonl), the share of the gate's time in SYNC_BARRIER
(Dataflow's `gate_ms.<MODE>` counters), the mean version gap of trained tokens, and the share
of tokens each mask dropped. The claim to test (issue 29): eta 8 with the best correction
reaches eta 2's held-out accuracy within 0.02 while the trainer idles less.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runs
from runs import astra_run, measured

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Staleness: eta with off-policy masks (real runs)"
VARIANTS: dict[str, list[str]] = {
    "eta 2": ["dataflow.gate.max_version_lag=2"],
    "eta 2, whole gap": [
        "dataflow.gate.max_version_lag=2",
        "dataflow.gate.barrier_gap_allowance=0",
    ],
    "eta 8": ["dataflow.gate.max_version_lag=8"],
    "eta 8 + M2PO": ["dataflow.gate.max_version_lag=8", "trainer.loss.m2po_tau=0.04"],
    "eta 8 + IcePop": ["dataflow.gate.max_version_lag=8", "trainer.loss.ratio_band=[0.5, 2.0]"],
}


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def idle_share(seen: list[dict[str, Any]]) -> float | None:
    """The trainer's time in FetchBatch over its step time: between the first and the last
    observed step, from the trainer's running sums (every step between them counts), or,
    with fewer than two such rows, over the observed steps alone."""
    sums = [(m["fetch_s_sum"], m["total_s_sum"]) for m in seen if "total_s_sum" in m]
    if len(sums) >= 2 and sums[-1][1] > sums[0][1]:
        return (sums[-1][0] - sums[0][0]) / (sums[-1][1] - sums[0][1])
    fetch = sum(m.get("fetch_ms", 0.0) for m in seen)
    total = sum(m.get("total_ms", 0.0) for m in seen)
    return fetch / total if total else None


def barrier_share(rows: list[dict[str, Any]]) -> float | None:
    """The share of the gate's time in SYNC_BARRIER between the first and last rows with
    Dataflow's counters (`gate_ms.<MODE>`: time in each mode, counted by Dataflow)."""
    counts = [r["dataflow"]["counters"] for r in rows if (r.get("dataflow") or {}).get("counters")]
    if len(counts) < 2:
        return None

    def ms(c: dict[str, int], mode: str | None = None) -> int:
        keys = [k for k in c if k.startswith("gate_ms.") and (mode is None or k.endswith(mode))]
        return sum(c[k] for k in keys)

    total = ms(counts[-1]) - ms(counts[0])
    return (
        (ms(counts[-1], "SYNC_BARRIER") - ms(counts[0], "SYNC_BARRIER")) / total if total else None
    )


def run_variant(name: str, sets: list[str], steps: int, root: Path, timeout_s: float) -> dict:
    run_dir = root / name.replace(" ", "").replace("+", "-")
    s, rows, wall = astra_run([], run_dir, timeout_s, [f"trainer.num_steps={steps}", *sets])
    seen = [r["trainer"] for r in rows if r.get("trainer")]
    evals = s.get("eval", {}).get("results", [])
    return {
        "variant": name,
        "wall_s": wall,
        "steps": s.get("steps"),
        "held_out_last": evals[-1].get("mean_reward") if evals else None,
        "last10": s.get("accuracy_last10"),
        "idle": idle_share(seen),
        "barrier": barrier_share(rows),
        "gap": mean([m["version_gap_mean"] for m in seen if "version_gap_mean" in m]),
        "m2po": mean([m.get("m2po_masked_fraction", 0.0) for m in seen]),
        "band": mean([m.get("ratio_band_masked_fraction", 0.0) for m in seen]),
        "lost": s.get("groups_lost"),
        "observed": len(seen),
    }


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def section(rows: list[dict[str, Any]], load: str, total: float) -> str:
    lines = [
        SECTION,
        "",
        "| variant | steps | wall s | held-out, last | last 10 steps | trainer idle | time in "
        "barrier | mean version gap | M2PO masked | IcePop masked | groups lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['steps']} | {r['wall_s']:.0f} | **{fmt(r['held_out_last'])}** "
            f"| {fmt(r['last10'])} | {fmt(r['idle'], '.1%')} | {fmt(r.get('barrier'), '.0%')} "
            f"| {fmt(r['gap'])} "
            f"| {fmt(r['m2po'], '.2%')} | {fmt(r['band'], '.2%')} | {r['lost']} |"
        )
    by = {r["variant"]: r for r in rows}
    base = by.get("eta 2")
    best = max(
        (r for r in rows if r["variant"].startswith("eta 8 +")),
        key=lambda r: r["held_out_last"] or 0.0,
        default=None,
    )
    verdict = "not measured"
    if base and best and None not in (base["held_out_last"], best["held_out_last"]):
        close = base["held_out_last"] - best["held_out_last"] <= 0.02
        idles_less = (best["idle"] or 0.0) < (base["idle"] or 0.0)
        verdict = (
            f"{'met' if close and idles_less else 'missed'} ({best['variant']}: held-out "
            f"{best['held_out_last']:.2f} vs {base['held_out_last']:.2f}, trainer idle "
            f"{fmt(best['idle'], '.1%')} vs {fmt(base['idle'], '.1%')})"
        )
    lines += [
        "",
        measured("staleness.py", total, load),
        "",
        "**Target (eta 8 with the best mask: held-out within 0.02 of eta 2 while the trainer "
        f"idles less): {verdict}.**",
        "",
        "Reading:",
        "",
        "- Each variant is one `astra run` of the embedded task: 2 RaaS with the built-in "
        "engine, one trainer, warm-up then GRPO; only eta, the loss masks and (in 'whole "
        "gap') the barrier's score differ.",
        "- Time in barrier: the share of the gate's time in SYNC_BARRIER from the first to "
        "the last step, from Dataflow's own counters (`gate_ms.<MODE>`). The barrier's score "
        "counts the version gap beyond eta by default; 'eta 2, whole gap' counts all of it, as before "
        "2026-12-07, which makes the default threshold (a mean gap of 1.5) fire inside eta.",
        "- With the built-in engine generation is fast, so a group's gap at acceptance is "
        "small (its lag is gained waiting in the buffer): counting the whole gap, the score "
        "stayed below 0.13 in a 150-step run, and the barrier never engages here either way. "
        "With vLLM on the CPU it did (docs/dataflow.md).",
        "- Trainer idle is the time its steps spent in FetchBatch over their whole time, "
        "between the first and the last step the observer saw with the trainer's figures (the "
        "trainer's running sums, so every step between them counts).",
        "- The masks act on r = trainer probability at the start of the step over the "
        "probability the engine sampled with: M2PO drops the tokens with the largest "
        "(log r)^2 until their mean is <= 0.04, IcePop every token with r outside [0.5, 2].",
        "- On this task the trainer is fast and the rollouts short: how much eta buys depends "
        "on how long generation takes against a step, which a real model changes.",
        "- The masks drop few tokens here (the 'masked' columns): eta 8 without a mask lands "
        "close to eta 2 as well, so this run shows that eta 8 pays (the trainer stops waiting), "
        "not yet that a mask is what makes it safe; a task where stale tokens hurt would.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return runs.variants_main(argv, __doc__, VARIANTS, run_variant, section, SECTION)


if __name__ == "__main__":
    sys.exit(main())
