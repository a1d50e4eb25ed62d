"""A long `astra run`: does any process or any part of the run directory keep growing?

    python tools/bench/soak.py                  # 3,000 RL steps of the embedded default
                                                # (~20 min on the 2-core machine); writes the
                                                # "Soak" section of BENCHMARKS.md
    python tools/bench/soak.py --steps 300 --no-write   # a short one, section printed

One real `astra run` of the embedded default (every service its own process) for many more
steps than `make run`, with held-out evaluations every 500 versions. Every few seconds the
script samples, for the supervisor and each child listed in run.json: resident memory (VmRSS),
threads and open file descriptors from /proc; and the bytes of the run directory's parts
(Dataflow's state, the weight store, each RaaS's state, checkpoints, logs). It reports each at
the first sample past 10% of the steps (the start of the steady state: caches, allocator
pools and the first evaluation are in by then) and at the end, and the slope of a
least-squares line over the samples after that start, per 1,000 steps. A process whose
memory grows without bound over weeks shows here as a slope that does not fade with more
steps; the verdict column calls one out when the end is over 10% and 20 MB above the start.
"""

from __future__ import annotations

import argparse
import contextlib
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
SECTION = "## Soak (a long `astra run`)"
SAMPLE_EVERY_S = 3.0
STEADY_FROM = 0.10  # of the steps: where the steady state starts


def proc_figures(pid: int) -> dict[str, float] | None:
    """RSS (MB), threads and open descriptors of a live process, None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "threads": int(fields["Threads"]),
        "fds": fds,
    }


def dir_mb(path: Path) -> float:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total / 1e6


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def sample(run_dir: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((run_dir / "run.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    if (info.get("supervisor") or {}).get("state") != "running":
        return None  # starting (warm-up) or ending (final evaluation, plot): not steady
    procs = {}
    sup = (info.get("supervisor") or {}).get("pid")
    if sup:
        procs["supervisor"] = proc_figures(int(sup))
    for c in info.get("children") or []:
        if c.get("pid"):
            procs[c["name"]] = proc_figures(int(c["pid"]))
    parts = {
        "dataflow state": run_dir / "state" / "dataflow",
        "weight store": run_dir / "state" / "weights",
        "checkpoints": run_dir / "checkpoints",
        "logs": run_dir / "logs",
    }
    for d in sorted((run_dir / "state").glob("raas-*")):
        parts[f"{d.name} state"] = d
    return {
        "t": time.monotonic(),
        "step": last_step(run_dir),
        "procs": {k: v for k, v in procs.items() if v is not None},
        "disk_mb": {k: dir_mb(p) for k, p in parts.items() if p.exists()},
    }


def slope_per_1000(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (step, value), per 1,000 steps."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return None
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / var


def analyse(samples: list[dict[str, Any]], steps: int) -> dict[str, list[dict[str, Any]]]:
    # From the steady state's start to the last sample before the trainer's last step (after
    # it, services begin to stop: their threads and descriptors go).
    steady = [s for s in samples if STEADY_FROM * steps <= s["step"] < steps]
    out: dict[str, list[dict[str, Any]]] = {"procs": [], "disk": []}
    if len(steady) < 2:
        return out
    names = sorted({n for s in steady for n in s["procs"]})
    for name in names:
        seen = [s for s in steady if name in s["procs"]]
        if len(seen) < 2:
            continue
        first, last = seen[0]["procs"][name], seen[-1]["procs"][name]
        row = {"name": name, "first_step": seen[0]["step"], "last_step": seen[-1]["step"]}
        for key in ("rss_mb", "threads", "fds"):
            row[key] = (first[key], last[key])
            row[key + "_slope"] = slope_per_1000([(s["step"], s["procs"][name][key]) for s in seen])
        grew = last["rss_mb"] - first["rss_mb"]
        row["grows"] = grew > 20 and grew > 0.1 * first["rss_mb"]
        out["procs"].append(row)
    for part in sorted({p for s in steady for p in s["disk_mb"]}):
        seen = [s for s in steady if part in s["disk_mb"]]
        out["disk"].append(
            {
                "name": part,
                "mb": (seen[0]["disk_mb"][part], seen[-1]["disk_mb"][part]),
                "slope": slope_per_1000([(s["step"], s["disk_mb"][part]) for s in seen]),
            }
        )
    return out


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:+.{digits}f}" if digits >= 0 else str(x)


def section(result: dict[str, Any], steps: int, total_s: float, load: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    s, a = result["summary"], result["analysis"]
    lines = [
        SECTION,
        "",
        f"Measured {now} with `python tools/bench/soak.py --steps {steps}` ({total_s:.0f} s) on "
        f"this machine: {os.cpu_count()} cores, no GPU, Python {platform.python_version()}; "
        f"load average before the run {load}.",
        "",
        f"One `astra run` of the embedded default for {s.get('steps')} RL steps "
        f"({s.get('groups_trained')} groups trained, {s.get('versions_published')} versions "
        f"published, held-out evaluations every 500 versions; status {s.get('status')}, "
        f"{s.get('groups_lost')} groups lost, {s.get('groups_duplicated')} duplicated), "
        f"sampled every {SAMPLE_EVERY_S:.0f} s ({result['samples']} samples). 'start' is the "
        f"first sample past {STEADY_FROM:.0%} of the steps, 'end' the last one before the last "
        "step; 'per 1,000 steps' is the slope of a least-squares line over the samples in "
        "between. Dataflow's state grows by 256 MB blob segments, each deleted once nothing "
        "points into it, so its slope is a saw's.",
        "",
        "| process | RSS MB start → end | RSS MB per 1,000 steps | threads | open fds "
        "| fds per 1,000 steps | grows? |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in a["procs"]:
        (r0, r1), (t0, t1), (f0, f1) = r["rss_mb"], r["threads"], r["fds"]
        lines.append(
            f"| {r['name']} | {r0:.0f} → {r1:.0f} | {fmt(r['rss_mb_slope'])} | {t0} → {t1} "
            f"| {f0} → {f1} | {fmt(r['fds_slope'])} | {'**yes**' if r['grows'] else 'no'} |"
        )
    lines += [
        "",
        "| part of the run directory | MB start → end | MB per 1,000 steps |",
        "|---|---:|---:|",
    ]
    for d in a["disk"]:
        (m0, m1) = d["mb"]
        lines.append(f"| {d['name']} | {m0:.1f} → {m1:.1f} | {fmt(d['slope'], 2)} |")
    growing = [r["name"] for r in a["procs"] if r["grows"]]
    lines += [
        "",
        "**Processes whose memory grew past 10% and 20 MB from the start: "
        + (", ".join(growing) if growing else "none")
        + ".** No target: this section is evidence for runs of weeks, not a pass mark.",
        "",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds")
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args(argv)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    root = Path(tempfile.mkdtemp(prefix="astra-bench-soak-"))
    run_dir = root / "run"
    cmd = [sys.executable, "-m", "astra.run", "--run-dir", str(run_dir)]
    cmd += ["--set", f"trainer.num_steps={args.steps}", "--set", "eval.every_steps=500"]
    started = time.monotonic()
    samples: list[dict[str, Any]] = []
    try:
        with (root / "run.out").open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                while proc.poll() is None:
                    if time.monotonic() - started > args.timeout:
                        proc.terminate()
                        proc.wait(60)
                        raise RuntimeError(f"astra run still running after {args.timeout:.0f} s")
                    got = sample(run_dir)
                    if got is not None and got["procs"]:
                        samples.append(got)
                        if len(samples) % 100 == 0:
                            print(f"step {got['step']} ...", file=sys.stderr, flush=True)
                    time.sleep(SAMPLE_EVERY_S)
            finally:
                if proc.poll() is None:
                    proc.kill()
        if proc.returncode != 0:
            tail = (root / "run.out").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"astra run exited {proc.returncode}\n{tail}")
        summary = json.loads((run_dir / "summary.json").read_text())
        result = {
            "summary": summary,
            "samples": len(samples),
            "analysis": analyse(samples, args.steps),
        }
        (root / "samples.json").write_text(json.dumps(samples))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}", file=sys.stderr)
    text = section(result, args.steps, time.monotonic() - started, load)
    print(text)
    if not args.no_write:
        replace_section(Path(args.output), SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
