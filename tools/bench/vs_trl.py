"""Astra against Hugging Face TRL's GRPOTrainer: held-out accuracy against wall-clock time.

    python tools/bench/vs_trl.py              # the full comparison (~15 min on the 2-core
                                              # machine); writes the "Astra vs TRL" section of
                                              # BENCHMARKS.md and docs/bench_vs_trl.png
    python tools/bench/vs_trl.py --quick --no-write --plot /tmp/x.png   # a few steps each
    python tools/bench/vs_trl.py --skip-missing   # exit 0, measuring nothing, without .venv-trl;
                                                  # without .venv-trl-vllm or .venv-vllm: the
                                                  # others only
    python tools/bench/vs_trl.py --no-vllm        # Astra and TRL, no vLLM in either

Every system runs in this one invocation, on this machine, one after the other:

  Astra  a real `astra run` of a recipe derived from configs/recipes/default.yaml (the built-in
         torch engine, every service its own process), with a shorter supervised warm-up
         (`--warmup-steps`) so that RL starts below the threshold, held-out evaluation every
         `--eval-every` versions and `--steps` RL steps at `--lr`;
  TRL    tools/bench/trl_grpo.py in the TRL environment (`make trl`: .venv-trl), started from
         the very directory that run's warm-up wrote (<run>/warmup/policy/model, an HF Qwen3
         directory with its tokenizer files), on that run's RL prompts (data/prompts.jsonl) and
         held-out records (data/eval.jsonl), with the same group size, prompts per step,
         learning rate, clip range, max new tokens and temperature;
  TRL + vLLM  the same script in .venv-trl-vllm (`make trl-vllm`: TRL over .venv-vllm's vLLM),
         generating with vLLM in its own process (`use_vllm=True, vllm_mode="colocate"`).
         TRL's server mode (`trl vllm-serve`) cannot run on a CPU: see "Not matched";
  Astra + vLLM  a real `astra run` of configs/recipes/vllm_cpu.yaml (one RaaS that launches
         .venv-vllm's vLLM server and reloads every version from the directory the
         WeightService delivers) with the same settings, no warm-up of its own: its policy's
         model is the Astra run's warm-up directory (`policies.0.model`); the bench checks
         that both runs' RL prompts and held-out records are the same bytes. It is stopped
         (SIGTERM: the run ends as on ^C) `vllm_max_s` after it started, as TRL + vLLM is.

Clocks. Astra's starts when the warm-up's model directory is written (the services then start:
their start-up counts; Astra + vLLM's when its run's data are written, the services starting
next); a held-out accuracy at version v is placed at the time the trainer logged step v (the
RaaS evaluate concurrently, so the evaluation's CPU is inside Astra's clock, its lag is not). TRL's starts at its script's first line (importing TRL and loading the
model count); a held-out accuracy after step n is placed at the end of step n, and the time its
own evaluations took (greedy generation, training paused) is left out of its clock.

Without .venv-trl (or with one where trl does not import) the bench says so and exits 2, or 0
with `--skip-missing`; without .venv-trl-vllm (TRL + vLLM) or .venv-vllm (Astra + vLLM) it exits 2,
or with `--skip-missing` measures the others and says in the section which was not run; it never writes a figure it did
not measure.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import replace_section

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Astra vs TRL (time to held-out accuracy)"
RECIPE = ROOT / "configs" / "recipes" / "default.yaml"
TRL_SCRIPT = Path(__file__).resolve().parent / "trl_grpo.py"
VLLM_RECIPE = ROOT / "configs" / "recipes" / "vllm_cpu.yaml"
TRL_VLLM = "TRL + vLLM"
ASTRA_VLLM = "Astra + vLLM"
STEP_LOG = re.compile(r"(\S+ \S+) INFO astra\.servers\.trainer: step (\d+) version ")
SERVING_LOG = re.compile(r"(\S+ \S+) INFO astra\.run: (\S+) \(pid \d+\) serving on ")
LOADED_LOG = re.compile(r"(\S+ \S+) INFO astra\.raas\.engine_backend: loaded \{'policy': (\d+)\}")
FIGURE = ROOT / "docs" / "bench_vs_trl.png"
TRL_VERSION = "1.16.0"
# The task's settings both systems share, as the default recipe has them.
GROUP_SIZE, PROMPTS_PER_STEP, MAX_NEW_TOKENS, TEMPERATURE = 4, 8, 8, 1.0
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


@dataclass
class Params:
    warmup_steps: int = 600
    steps: int = 300
    eval_every: int = 10
    lr: float = 3e-4
    threshold: float = 0.85
    second: float = 0.75
    trl_max_s: float = 600.0
    vllm_max_s: float = 300.0
    timeout_s: float = 900.0

    @classmethod
    def quick(cls) -> Params:
        return cls(steps=8, eval_every=4, trl_max_s=120.0, vllm_max_s=120.0, timeout_s=400.0)


@dataclass
class Side:
    name: str
    curve: list[tuple[float, float, int]] = field(default_factory=list)  # (s, accuracy, step)
    steps: int = 0
    train_s: float = 0.0  # clock at the last step
    tokens: float = 0.0  # completion tokens trained
    startup_s: float | None = None  # clock at the first step
    notes: list[str] = field(default_factory=list)
    reading: list[str] = field(default_factory=list)  # where an Astra run's time went

    def time_to(self, threshold: float) -> float | None:
        return next((t for t, acc, _ in self.curve if acc >= threshold), None)

    def tokens_per_s(self) -> float | None:
        return self.tokens / self.train_s if self.train_s > 0 else None


def trl_python(path: str | None, venv: str = ".venv-trl") -> Path:
    return Path(path) if path else ROOT / venv / "bin" / "python"


def check_trl(python: Path, with_vllm: bool = False) -> str:
    """TRL's version in `python`'s environment (and vLLM's, `with_vllm`); raises RuntimeError
    saying what is missing."""
    make = "make trl-vllm" if with_vllm else "make trl"
    what = "TRL + vLLM" if with_vllm else "TRL"
    modules = "trl, transformers" + (", vllm" if with_vllm else "")
    versions = "trl.__version__, transformers.__version__" + (
        ", vllm.__version__" if with_vllm else ""
    )
    return import_versions(python, modules, versions, what, make)


def import_versions(python: Path, modules: str, versions: str, what: str, make: str) -> str:
    """What `print(versions)` prints after `import modules` in `python`; RuntimeError naming
    the environment `what` and the command `make` that builds it when that fails."""
    if not python.is_file():
        raise RuntimeError(f"no {what} environment: {python} does not exist (run `{make}`)")
    proc = subprocess.run(
        [str(python), "-c", f"import {modules}; print({versions})"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"{python} cannot import {modules} ({why}); run `{make}`")
    return proc.stdout.strip()


def rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def astra_command(p: Params, run_dir: Path, vllm: tuple[Path, Path] | None) -> list[str]:
    """`astra run` of the default recipe, or (`vllm`: the vLLM Python and the warm-up model
    to start from) of configs/recipes/vllm_cpu.yaml without a warm-up of its own."""
    sets: dict[str, object] = {
        "eval.every_steps": p.eval_every,
        "trainer.num_steps": p.steps,
        "trainer.optim.lr": p.lr,
    }
    if vllm is None:
        sets["warmup.steps"] = p.warmup_steps
    else:
        python, model = vllm
        sets |= {"warmup.steps": 0, "policies.0.model": model, "raas.0.engine_python": python}
    recipe = RECIPE if vllm is None else VLLM_RECIPE
    cmd = [sys.executable, "-m", "astra.run", str(recipe), "--run-dir", str(run_dir)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def run_command(cmd: list[str], timeout_s: float, cap_s: float | None) -> tuple[int, str, bool]:
    """Runs `cmd`; after `cap_s` seconds it is sent SIGTERM (`astra run` then stops as on ^C,
    its steps and evaluations so far on disk). The exit code, stderr's tail, whether capped."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        capped = False
        try:
            proc.wait(timeout=cap_s if cap_s is not None else timeout_s)
        except subprocess.TimeoutExpired:
            if cap_s is None:
                proc.kill()
                proc.wait()
                raise
            capped = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=max(timeout_s - cap_s, 60.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
        err.seek(0)
        return proc.returncode, err.read().decode("utf-8", "replace")[-3000:], capped


def run_astra(p: Params, run_dir: Path, vllm: tuple[Path, Path] | None = None) -> Side:
    """`vllm`: (.venv-vllm's Python, the Astra run's warm-up model): Astra + vLLM, whose
    clock starts when its run's data are written (it has no warm-up: the services start
    next) and which is stopped at `p.vllm_max_s`."""
    cmd = astra_command(p, run_dir, vllm)
    cap = p.vllm_max_s if vllm is not None else None
    rc, err, capped = run_command(cmd, p.timeout_s, cap)
    if rc != 0 and not (capped and rc == 128 + signal.SIGTERM):
        raise RuntimeError(f"astra run exited {rc}\n{err}")
    if vllm is None:
        model = run_dir / "warmup" / "policy" / "model"
        t0 = max(f.stat().st_mtime for f in model.iterdir())  # the warm-up's end: RL starts
    else:
        t0 = max(f.stat().st_mtime for f in (run_dir / "data").glob("*.jsonl"))
    steps = [r for r in rows(run_dir / "metrics.jsonl") if not r.get("rerun")]
    side = Side("Astra" if vllm is None else ASTRA_VLLM)
    if not steps:
        raise RuntimeError(f"astra run wrote no trainer steps to {run_dir}/metrics.jsonl")
    logged = step_times(run_dir / "logs" / "trainer-policy.log")
    for r in steps:  # when the trainer logged the step, not when `astra run` polled it
        r["time"] = logged.get(r["step"], r["time"])
    side.steps = max(r["step"] for r in steps)
    side.train_s = max(r["time"] for r in steps) - t0
    side.startup_s = min(r["time"] for r in steps) - t0
    per_step = [r["trainer"]["num_tokens"] for r in steps if r.get("trainer")]
    side.tokens = sum(per_step) / len(per_step) * side.steps if per_step else 0.0
    for ev in sorted(rows(run_dir / "evals.jsonl"), key=lambda r: r["version"]):
        v = ev["version"]
        at = next(
            (r["time"] for r in sorted(steps, key=lambda r: r["step"]) if r["version"] >= v), None
        )
        t = 0.0 if v == 0 else (at - t0 if at is not None else ev["time"] - t0)
        side.curve.append((t, ev["mean_reward"], v))
    if capped:
        side.notes.append(f"{side.name} stopped at its {cap:.0f} s cap after {side.steps} steps")
    side.reading = breakdown(run_dir, t0, logged)
    return side


def log_time(stamp: str) -> float:
    """A log line's `%Y-%m-%d %H:%M:%S,%f` time (the machine's local time) as a Unix time."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def breakdown(run_dir: Path, t0: float, steps: dict[int, float]) -> list[str]:
    """Where an `astra run`'s start-up went (from its clock's start: when each service was
    serving, as the supervisor logged it, and the first step) and how long a version took
    from the trainer's step to a RaaS holding it (the RaaS's `loaded` lines)."""
    logs = run_dir / "logs"
    served: dict[str, float] = {}
    for line in (logs / "supervisor.log").read_text(errors="replace").splitlines():
        if m := SERVING_LOG.match(line):
            served.setdefault(m[2], log_time(m[1]) - t0)
    parts = [f"{name} {at:.1f} s" for name, at in sorted(served.items(), key=lambda kv: kv[1])]
    if steps:
        parts.append(f"first step {min(steps.values()) - t0:.1f} s")
    out = ["services serving (supervisor's log), from the clock's start: " + ", ".join(parts)]
    lags = []
    for log in sorted(logs.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if (m := LOADED_LOG.match(line)) and int(m[2]) in steps and int(m[2]) > 0:
                lags.append(log_time(m[1]) - steps[int(m[2])])
    if lags:
        lags.sort()
        out.append(
            f"trainer's step -> a RaaS holding that version: median {lags[len(lags) // 2]:.2f} s"
            f" over {len(lags)} loads (max {lags[-1]:.2f} s); median step interval "
            f"{interval(steps):.2f} s"
        )
    return out


def interval(steps: dict[int, float]) -> float:
    times = sorted(steps.values())
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return gaps[len(gaps) // 2] if gaps else 0.0


def step_times(log: Path) -> dict[int, float]:
    """Each step's time as the trainer logged it (its first line for that step: a restarted
    trainer's steps again are `rerun` rows, left out)."""
    out: dict[int, float] = {}
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if m := STEP_LOG.match(line):
            out.setdefault(int(m[2]), log_time(m[1]))
    return out


def same_data(a: Path, b: Path) -> None:
    """Both runs trained on the same prompts and were evaluated on the same problems."""
    for name in ("prompts.jsonl", "eval.jsonl"):
        if (a / "data" / name).read_bytes() != (b / "data" / name).read_bytes():
            raise RuntimeError(f"{a}/data/{name} and {b}/data/{name} differ")


def check_vllm(python: Path) -> str:
    """vLLM's version in .venv-vllm (the Astra + vLLM RaaS's engine Python); raises
    RuntimeError saying what is missing."""
    return import_versions(python, "vllm", "vllm.__version__", "vLLM", "make vllm")


def run_trl(p: Params, run_dir: Path, python: Path, out: Path, vllm: bool = False) -> Side:
    cmd = [
        str(python),
        str(TRL_SCRIPT),
        *("--model", str(run_dir / "warmup" / "policy" / "model")),
        *("--data", str(run_dir / "data" / "prompts.jsonl")),
        *("--eval", str(run_dir / "data" / "eval.jsonl")),
        *("--out", str(out)),
        *("--group-size", str(GROUP_SIZE), "--prompts-per-step", str(PROMPTS_PER_STEP)),
        *("--lr", str(p.lr), "--max-new-tokens", str(MAX_NEW_TOKENS)),
        *("--temperature", str(TEMPERATURE)),
        *("--clip-low", str(CLIP_LOW), "--clip-high", str(CLIP_HIGH)),
        *("--steps", str(p.steps), "--eval-every", str(p.eval_every)),
        *("--max-seconds", str(p.vllm_max_s if vllm else p.trl_max_s)),
        *(("--vllm", "colocate") if vllm else ()),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=p.timeout_s, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"trl_grpo.py exited {proc.returncode}\n{proc.stderr[-3000:]}")
    events = rows(out)
    start = next(r["time"] for r in events if r["event"] == "start")
    steps = [r for r in events if r["event"] == "step"]
    if not steps:
        raise RuntimeError(f"trl_grpo.py wrote no steps to {out}")
    side = Side(TRL_VLLM if vllm else "TRL")
    clock = {r["step"]: r["time"] - start - r["eval_s_total"] for r in steps}
    side.steps = steps[-1]["step"]
    side.train_s = clock[side.steps]
    side.startup_s = clock[steps[0]["step"]]
    side.tokens = float(steps[-1]["completion_tokens"])
    for ev in (r for r in events if r["event"] == "eval"):
        side.curve.append(
            (0.0 if ev["step"] == 0 else clock[ev["step"]], ev["accuracy"], ev["step"])
        )
    end = next((r for r in events if r["event"] == "end"), None)
    if end and end["reason"] == "max_seconds":
        cap = p.vllm_max_s if vllm else p.trl_max_s
        side.notes.append(f"{side.name} stopped at its {cap:.0f} s cap after {side.steps} steps")
    return side


def plot(sides: list[Side], p: Params, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for side in sides:
        ts, accs = [t for t, _, _ in side.curve], [a for _, a, _ in side.curve]
        ax.plot(ts, accs, marker="o", markersize=3, label=side.name)
    for level in (p.threshold, p.second):
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


def fmt(x: float | None, digits: int = 1, unit: str = "") -> str:
    return "not reached" if x is None else f"{x:,.{digits}f}{unit}"


def verdict(astra: Side, trl: Side, p: Params) -> str:
    a, t = astra.time_to(p.threshold), trl.time_to(p.threshold)
    if a is None:
        return (
            f"missed: {astra.name} did not reach {p.threshold} held-out in its {astra.steps} "
            f"steps ({astra.train_s:.0f} s)"
        )
    if t is None:
        bound = trl.train_s / a
        return (
            f"met: {astra.name} reached {p.threshold} in {a:.0f} s; {trl.name} had not after "
            f"{trl.train_s:.0f} s ({bound:.1f}x and more)"
            if bound >= 3
            else f"undecided: {trl.name} had not reached {p.threshold} after {trl.train_s:.0f} s, "
            f"only {bound:.1f}x {astra.name}'s {a:.0f} s"
        )
    ratio = t / a if a > 0 else float("inf")
    met = "met" if ratio >= 3 else "missed"
    return f"{met}: {astra.name} {a:.0f} s, {trl.name} {t:.0f} s ({ratio:.2f}x)"


def section(
    sides: list[Side],
    p: Params,
    versions: str,
    load: list[tuple[str, str]],
    total_s: float,
    quick: bool,
    missing: dict[str, str] | None = None,
) -> str:
    """`sides`: Astra first, then TRL and those of TRL + vLLM and Astra + vLLM that ran;
    `missing`: why each of those two that did not run did not."""
    astra, trl = sides[0], sides[1]
    by_name = {s.name: s for s in sides}
    trl_vllm, astra_vllm = by_name.get(TRL_VLLM), by_name.get(ASTRA_VLLM)
    against = [(astra, trl_vllm), (astra_vllm, trl), (astra_vllm, trl_vllm)]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    label = " (QUICK form: a few steps each, not the comparison)" if quick else ""
    lines = [
        SECTION,
        "",
        f"| system | held-out at start | best held-out | time to {p.threshold} | time to "
        f"{p.second} | RL steps | seconds to first step | trained tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in sides:
        start = s.curve[0][1] if s.curve else None
        best = max((a for _, a, _ in s.curve), default=None)
        lines.append(
            f"| {s.name} | {fmt(start, 2)} | {fmt(best, 2)} | {fmt(s.time_to(p.threshold), 0, ' s')} "
            f"| {fmt(s.time_to(p.second), 0, ' s')} | {s.steps} | {fmt(s.startup_s, 0, ' s')} "
            f"| {fmt(s.tokens_per_s(), 0)} |"
        )
    lines += ["", "Held-out accuracy against the clock (s since RL started):", ""]
    lines += ["| system | " + " | ".join(["(s, accuracy, step)"]) + " |", "|---|---|"]
    for s in sides:
        points = ", ".join(f"{t:.0f}: {a:.2f} ({n})" for t, a, n in s.curve)
        lines.append(f"| {s.name} | {points} |")
    lines += [
        "",
        f"**Target (Astra reaches {p.threshold} held-out at least 3x sooner than TRL){label}: "
        f"{verdict(astra, trl, p)}.**",
        "",
        *(
            f"{a.name} against {t.name} (the same target): {verdict(a, t, p)}."
            for a, t in against
            if a is not None and t is not None
        ),
        *(f"{name} was not measured: {why}." for name, why in (missing or {}).items()),
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
        + " (the machine is shared with other agents, five at the time of "
        "writing: every system ran under that load, one after the other).",
        "",
        "![held-out accuracy against wall-clock time](docs/bench_vs_trl.png)",
        "",
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
        "one trainer), asynchronous with at most 2 versions of lag. TRL "
        f"{TRL_VERSION}: GRPOTrainer on CPU in fp32 (bf16 and gradient checkpointing off), "
        "loss_type dapo, scale_rewards group, beta 0, num_iterations 1, one generation per "
        "step (generation_batch_size = per_device_train_batch_size = 32), generating with "
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
        "TRL and loading the model; its evaluations pause training and their time is left out. "
        "Trained tokens/s: completion tokens (EOS included) of the trained samples over the "
        "clock at the last step (start-up included).",
        "",
        "Not matched: Astra's loss is its decoupled PPO objective with a behaviour-policy cap "
        "(samples may be up to 2 versions old), TRL's is on-policy (one optimiser step per "
        "generation, so its ratio is 1 and its clip never binds); Astra's evaluation shares the "
        "CPU with training while TRL's is excluded from its clock; TRL uses torch's default "
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
        "the server; the code path, not a run, is the evidence.",
    ]
    lines += [
        "",
        "Reading: Dataflow and the WeightService start beside the warm-up (they need no "
        "warmed-up model), so they serve before Astra's clock starts (a negative time below); "
        "the RaaS and the trainer start together once the warm-up's result line is read; what "
        "is left before the first step is those processes importing torch and loading the "
        "model on the shared cores (vLLM's server start for Astra + vLLM). After the first "
        "step, the time to the threshold is set by the step at which the held-out curve, "
        "which moves by a few points between evaluations, first crosses it, as much as by the "
        "step rate.",
        "",
    ]
    lines += [f"- {n}." for s in sides for n in s.notes]
    for s in sides:
        reached = s.time_to(p.threshold)
        step = next((n for _, acc, n in s.curve if acc >= p.threshold), 0)
        if reached is not None and s.startup_s is not None and step > 0:
            lines.append(
                f"- {s.name}'s time to {p.threshold}: {reached:.0f} s = {s.startup_s:.1f} s to "
                f"its first RL step + {reached - s.startup_s:.1f} s for its steps 1-{step} "
                f"(the first evaluation at or above {p.threshold} was at step {step})."
            )
        lines += [f"- {s.name}, {n}." for n in s.reading]
    return "\n".join(lines) + "\n"


def optional(sides: list[Side], missing: dict[str, str], name: str, run: Any) -> None:
    """Runs one of the vLLM systems: its side, or (its run failed) why, for the section; the
    failure's tail goes to stderr. The others' figures stand either way."""
    try:
        sides.append(run())
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"vs_trl: {name} failed: {str(exc)[-3000:]}", file=sys.stderr, flush=True)
        last = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        missing[name] = f"its run failed ({last[0][:120]}: {last[-1][:300]})" if last else "failed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few steps each (a smoke test)")
    ap.add_argument(
        "--skip-missing",
        action="store_true",
        help="exit 0 without .venv-trl; without .venv-trl-vllm or .venv-vllm measure the others",
    )
    ap.add_argument("--trl-python", default=None, help="default: .venv-trl/bin/python")
    ap.add_argument("--trl-vllm-python", default=None, help="default: .venv-trl-vllm/bin/python")
    ap.add_argument("--vllm-python", default=None, help="default: .venv-vllm/bin/python")
    ap.add_argument("--no-vllm", action="store_true", help=f"leave {TRL_VLLM} and {ASTRA_VLLM} out")
    ap.add_argument("--warmup-steps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--plot", default=None, help=f"default: {FIGURE.relative_to(ROOT)}")
    ap.add_argument("--json", default=None, help="also write every curve here")
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    args = ap.parse_args(argv)
    p = Params.quick() if args.quick else Params()
    for name in ("warmup_steps", "steps", "lr"):
        if getattr(args, name) is not None:
            setattr(p, name, getattr(args, name))
    python = trl_python(args.trl_python)
    vllm_python = None if args.no_vllm else trl_python(args.trl_vllm_python, ".venv-trl-vllm")
    engine_python = None if args.no_vllm else trl_python(args.vllm_python, ".venv-vllm")
    missing = (
        {TRL_VLLM: "left out (--no-vllm)", ASTRA_VLLM: "left out (--no-vllm)"}
        if args.no_vllm
        else {}
    )
    try:
        versions = check_trl(python)
        if vllm_python is not None:
            try:
                vllm_v = check_trl(vllm_python, with_vllm=True).split()
            except RuntimeError as exc:
                if not args.skip_missing:
                    raise
                print(f"vs_trl: {exc}; measuring the others (--skip-missing)", file=sys.stderr)
                vllm_python, missing[TRL_VLLM] = None, str(exc)
        if engine_python is not None:
            try:
                engine_v = check_vllm(engine_python)
            except RuntimeError as exc:
                if not args.skip_missing:
                    raise
                print(f"vs_trl: {exc}; measuring the others (--skip-missing)", file=sys.stderr)
                engine_python, missing[ASTRA_VLLM] = None, str(exc)
    except RuntimeError as exc:
        print(f"vs_trl: {exc}", file=sys.stderr)
        if args.skip_missing:
            print(
                "vs_trl: skipped (--skip-missing): nothing measured, nothing written",
                file=sys.stderr,
            )
            return 0
        return 2
    trl_v, tf_v = versions.split()
    versions = f"TRL {trl_v}, transformers {tf_v}"
    if vllm_python is not None:
        versions += f" (with vLLM: vllm-cpu {vllm_v[2]}, transformers {vllm_v[1]})"
    if engine_python is not None:
        versions += f"; Astra + vLLM: vllm-cpu {engine_v} (.venv-vllm)"
    root = Path(tempfile.mkdtemp(prefix="astra-bench-vs-trl-"))
    started = time.monotonic()
    load: list[tuple[str, str]] = []  # (what ran next, the load average then)

    def mark(what: str) -> None:
        load.append((what, " / ".join(f"{x:.1f}" for x in os.getloadavg())))

    try:
        mark("before Astra")
        print(f"astra run: {p.steps} steps ...", file=sys.stderr, flush=True)
        sides = [run_astra(p, root / "astra")]
        mark("before TRL")
        print(f"TRL: {p.steps} steps at most ...", file=sys.stderr, flush=True)
        sides.append(run_trl(p, root / "astra", python, root / "trl.jsonl"))
        if vllm_python is not None:
            mark(f"before {TRL_VLLM}")
            print(f"{TRL_VLLM}: {p.steps} steps at most ...", file=sys.stderr, flush=True)
            out = root / "trl_vllm.jsonl"
            optional(
                sides,
                missing,
                TRL_VLLM,
                lambda: run_trl(p, root / "astra", vllm_python, out, vllm=True),
            )
        if engine_python is not None:
            mark(f"before {ASTRA_VLLM}")
            print(f"{ASTRA_VLLM}: {p.steps} steps at most ...", file=sys.stderr, flush=True)
            model = root / "astra" / "warmup" / "policy" / "model"

            def astra_vllm() -> Side:
                side = run_astra(p, root / "astra-vllm", (engine_python, model))
                same_data(root / "astra", root / "astra-vllm")
                return side

            optional(sides, missing, ASTRA_VLLM, astra_vllm)
        mark("after")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total_s = time.monotonic() - started
    text = section(sides, p, versions, load, total_s, args.quick, missing)
    print(text)
    if args.json:
        Path(args.json).write_text(
            json.dumps({s.name: s.__dict__ for s in sides} | {"params": p.__dict__}, indent=1)
        )
    figure = Path(args.plot) if args.plot else (None if args.no_write else FIGURE)
    if figure is not None:
        plot(sides, p, figure)
    if not args.no_write:
        replace_section(Path(args.output), SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
