"""Astra against Hugging Face TRL's GRPOTrainer: held-out accuracy against wall-clock time.

    python tools/bench/vs_trl.py              # the full comparison (~15 min on the 2-core
                                              # machine); writes the "Astra vs TRL" section of
                                              # BENCHMARKS.md and docs/bench_vs_trl.png
    python tools/bench/vs_trl.py --quick --no-write --plot /tmp/x.png   # a few steps each
    python tools/bench/vs_trl.py --skip-missing   # exit 0, measuring nothing, without .venv-trl;
                                                  # without .venv-trl-vllm or .venv-vllm: the
                                                  # others only
    python tools/bench/vs_trl.py --no-vllm        # Astra and TRL, no vLLM in either

Every system runs in this one invocation, on this machine, one after the other, Astra and TRL
`--repeats` times each (3; seeds 0, 1, 2: the time to the threshold is the first evaluation
that crosses it, a noisy figure) and each vLLM system `--vllm-repeats` times (1); the section
(tools/bench/vs_trl_report.py) reports each system's median run and every run's time:

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
from vs_trl_report import (
    ASTRA_VLLM,
    CLIP_HIGH,
    CLIP_LOW,
    GROUP_SIZE,
    MAX_NEW_TOKENS,
    PROMPTS_PER_STEP,
    SECTION,
    TEMPERATURE,
    TRL_VLLM,
    median_run,
    plot,
    section,
    texts,
)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "recipes" / "default.yaml"
TRL_SCRIPT = Path(__file__).resolve().parent / "trl_grpo.py"
VLLM_RECIPE = ROOT / "configs" / "recipes" / "vllm_cpu.yaml"
STEP_LOG = re.compile(r"(\S+ \S+) INFO astra\.servers\.trainer: step (\d+) version ")
SERVING_LOG = re.compile(r"(\S+ \S+) INFO astra\.run: (\S+) \(pid \d+\) serving on ")
LOADED_LOG = re.compile(r"(\S+ \S+) INFO astra\.raas\.engine_backend: loaded \{'policy': (\d+)\}")
FIGURE = ROOT / "docs" / "bench_vs_trl.png"


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
    repeats: int = 3  # runs of Astra and of TRL, seeds 0 and up
    vllm_repeats: int = 1  # runs of each vLLM system (each takes minutes)
    eta: int = field(default_factory=lambda: recipe_eta(RECIPE))

    @classmethod
    def quick(cls) -> Params:
        return cls(
            steps=8, eval_every=4, trl_max_s=120.0, vllm_max_s=120.0, timeout_s=400.0, repeats=1
        )


def recipe_eta(path: Path) -> int:
    """The recipe's gate.max_version_lag (eta), which both Astra runs keep."""
    import yaml

    return int(yaml.safe_load(path.read_text())["dataflow"]["gate"]["max_version_lag"])


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
    seed: int = 0
    lag_s: float | None = None  # Astra: median trainer's step -> a RaaS holding that version
    interval_s: float | None = None  # Astra: median step interval
    # TRL: the seconds its evaluations took before the end of step n (its clock leaves them
    # out; Astra's evaluations run beside training, on its clock)
    eval_before: dict[int, float] = field(default_factory=dict)

    def time_to(self, threshold: float) -> float | None:
        return next((t for t, acc, _ in self.curve if acc >= threshold), None)

    def time_to_with_evals(self, threshold: float) -> float | None:
        """`time_to` with the evaluations before that point on the clock."""
        hit = next(((t, n) for t, acc, n in self.curve if acc >= threshold), None)
        return None if hit is None else hit[0] + self.eval_before.get(hit[1], 0.0)

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


def astra_command(
    p: Params, run_dir: Path, vllm: tuple[Path, Path] | None, seed: int = 0
) -> list[str]:
    """`astra run` of the default recipe, or (`vllm`: the vLLM Python and the warm-up model
    to start from) of configs/recipes/vllm_cpu.yaml without a warm-up of its own; `seed`: the
    trainer's and the stream's sampling seed."""
    sets: dict[str, object] = {
        "eval.every_steps": p.eval_every,
        "trainer.num_steps": p.steps,
        "trainer.optim.lr": p.lr,
        "trainer.seed": seed,
        "streams.0.sampling.seed": seed,
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


def run_astra(
    p: Params, run_dir: Path, vllm: tuple[Path, Path] | None = None, seed: int = 0
) -> Side:
    """`vllm`: (.venv-vllm's Python, the Astra run's warm-up model): Astra + vLLM, whose
    clock starts when its run's data are written (it has no warm-up: the services start
    next) and which is stopped at `p.vllm_max_s`."""
    cmd = astra_command(p, run_dir, vllm, seed)
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
    side = Side("Astra" if vllm is None else ASTRA_VLLM, seed=seed)
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
    side.reading, side.lag_s = breakdown(run_dir, t0, logged)
    side.interval_s = interval(logged) or None
    return side


def log_time(stamp: str) -> float:
    """A log line's `%Y-%m-%d %H:%M:%S,%f` time (the machine's local time) as a Unix time."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def breakdown(run_dir: Path, t0: float, steps: dict[int, float]) -> tuple[list[str], float | None]:
    """Where an `astra run`'s start-up went (from its clock's start: when each service was
    serving, as the supervisor logged it, and the first step) and how long a version took
    from the trainer's step to a RaaS holding it (the RaaS's `loaded` lines): the lines, and
    that time's median (None without loads)."""
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
    return out, lags[len(lags) // 2] if lags else None


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


def run_trl(
    p: Params, run_dir: Path, python: Path, out: Path, vllm: bool = False, seed: int = 0
) -> Side:
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
        *("--seed", str(seed)),
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
    side = Side(TRL_VLLM if vllm else "TRL", seed=seed)
    clock = {r["step"]: r["time"] - start - r["eval_s_total"] for r in steps}
    side.steps = steps[-1]["step"]
    side.train_s = clock[side.steps]
    side.startup_s = clock[steps[0]["step"]]
    side.tokens = float(steps[-1]["completion_tokens"])
    side.eval_before = {r["step"]: r["eval_s_total"] for r in steps}
    for ev in (r for r in events if r["event"] == "eval"):
        side.curve.append(
            (0.0 if ev["step"] == 0 else clock[ev["step"]], ev["accuracy"], ev["step"])
        )
    end = next((r for r in events if r["event"] == "end"), None)
    if end and end["reason"] == "max_seconds":
        cap = p.vllm_max_s if vllm else p.trl_max_s
        side.notes.append(f"{side.name} stopped at its {cap:.0f} s cap after {side.steps} steps")
    return side


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
    ap.add_argument(
        "--repeats", type=int, default=None, help="runs of Astra and of TRL (default 3; quick 1)"
    )
    ap.add_argument("--vllm-repeats", type=int, default=None, help="runs of each vLLM system")
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--plot", default=None, help=f"default: {FIGURE.relative_to(ROOT)}")
    ap.add_argument("--json", default=None, help="also write every curve here")
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    args = ap.parse_args(argv)
    p = Params.quick() if args.quick else Params()
    for name in ("warmup_steps", "steps", "lr", "repeats", "vllm_repeats"):
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
        systems = [[], []]  # Astra's runs, TRL's runs
        for i in range(p.repeats):
            mark(f"before Astra (seed {i})")
            print(f"astra run (seed {i}): {p.steps} steps ...", file=sys.stderr, flush=True)
            systems[0].append(run_astra(p, root / f"astra-{i}", seed=i))
            mark(f"before TRL (seed {i})")
            print(f"TRL (seed {i}): {p.steps} steps at most ...", file=sys.stderr, flush=True)
            out = root / f"trl-{i}.jsonl"
            systems[1].append(run_trl(p, root / f"astra-{i}", python, out, seed=i))
        first = root / "astra-0"
        if vllm_python is not None:
            runs: list[Side] = []
            for i in range(p.vllm_repeats):
                mark(f"before {TRL_VLLM} (seed {i})")
                print(f"{TRL_VLLM} (seed {i}) ...", file=sys.stderr, flush=True)
                out = root / f"trl-vllm-{i}.jsonl"
                optional(
                    runs,
                    missing,
                    TRL_VLLM,
                    lambda out=out, i=i: run_trl(p, first, vllm_python, out, vllm=True, seed=i),
                )
            if runs:
                systems.append(runs)
        if engine_python is not None:
            runs = []
            model = first / "warmup" / "policy" / "model"
            for i in range(p.vllm_repeats):
                mark(f"before {ASTRA_VLLM} (seed {i})")
                print(f"{ASTRA_VLLM} (seed {i}) ...", file=sys.stderr, flush=True)

                def astra_vllm(i: int = i) -> Side:
                    run_dir = root / f"astra-vllm-{i}"
                    side = run_astra(p, run_dir, (engine_python, model), seed=i)
                    same_data(first, run_dir)
                    return side

                optional(runs, missing, ASTRA_VLLM, astra_vllm)
            if runs:
                systems.append(runs)
        mark("after")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total_s = time.monotonic() - started
    text = section(SECTION, systems, p, texts(p), versions, load, total_s, args.quick, missing)
    print(text)
    if args.json:
        curves = {
            runs[0].name: median_run(runs, p.threshold).__dict__
            | {"runs": [s.__dict__ for s in runs]}
            for runs in systems
        }
        Path(args.json).write_text(json.dumps(curves | {"params": p.__dict__}, indent=1))
    figure = Path(args.plot) if args.plot else (None if args.no_write else FIGURE)
    if figure is not None:
        plot(systems, p.threshold, p.second, figure)
    if not args.no_write:
        replace_section(Path(args.output), SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
