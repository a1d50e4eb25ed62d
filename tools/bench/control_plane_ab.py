"""Control plane, two checkouts of Astra A/B in one invocation: did a change cost anything?

    python tools/bench/control_plane_ab.py --old /work/wt-old --label-old cbfa490
    python tools/bench/control_plane_ab.py --old DIR --rounds 2 --no-write

`--old` is a checkout of another commit with its own `.venv` (`make .venv/.installed` there);
this checkout is the new side. Each side runs `tools/bench/control_plane.py --only astra
--no-variant` from its own checkout with its own interpreter, in the order A B B A (repeated
`--rounds` times), so load from other jobs on the machine falls on both sides alike. The figure
least moved by such load is the CPU each trajectory costs (coordinator, all processes); rates and
latency tails move with whatever the other jobs leave free and are shown for completeness.
Writes the section "Control plane: A/B of two commits" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import replace_section
from runs import ROOT, load, measured

SECTION = "## Control plane: A/B of two commits"
FIGS = (  # (label, key in control_plane.py's --json "astra" figures, format)
    ("coordinator CPU-ms per trajectory", "coordinator_cpu_per_1k", "{:.3f}"),
    ("all processes CPU-ms per trajectory", "total_cpu_per_1k", "{:.3f}"),
    ("ingested trajectories/s", "ingest_traj_per_s", "{:,.0f}"),
    ("batch fetch p99, ms (paced)", "fetch_p99_ms", "{:.1f}"),
    ("cores busy, all processes", "cpu_util_cores", "{:.2f}"),
)


def run_side(checkout: Path, out: Path, timeout_s: float) -> dict:
    cmd = [
        str(checkout / ".venv" / "bin" / "python"),
        "tools/bench/control_plane.py",
        "--only", "astra", "--no-variant", "--no-write", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{checkout}: control_plane.py exited {proc.returncode}\n"
                           f"{proc.stderr[-2000:]}")  # fmt: skip
    data = json.loads(out.read_text())
    return {"load": data["load_average"], **data["astra"]}


def render(runs: dict[str, list[dict]], labels: dict[str, str], total_s: float, lb: str) -> str:
    head = f"| metric | old ({labels['old']}) | new ({labels['new']}) | new / old |"
    rows = [head, "|---|---:|---:|---:|"]
    for name, key, fmt in FIGS:
        old = statistics.median(r[key] for r in runs["old"])
        new = statistics.median(r[key] for r in runs["new"])
        each = {s: ", ".join(fmt.format(r[key]) for r in runs[s]) for s in runs}
        rows.append(f"| {name}, median (each run) | {fmt.format(old)} ({each['old']}) | "
                    f"{fmt.format(new)} ({each['new']}) | {new / old:.2f} |")  # fmt: skip
    n = len(runs["old"])
    return "\n".join([
        SECTION, "", *rows, "", measured("control_plane_ab.py", total_s, lb), "",
        "Method:", "",
        f"- {n} runs per side of `tools/bench/control_plane.py --only astra --no-variant` (the "
        "Control plane section's parameters: 64 rollout servers in 4 processes, 30 s window), "
        "each from its own checkout and interpreter, in the order A B B A.",
        "- CPU per trajectory is the figure to compare: other jobs on the machine change how much "
        "CPU Astra gets (so its rate and tails) far more than what each trajectory costs it.",
        "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--old", required=True, help="checkout of the other commit, with .venv")
    ap.add_argument("--label-old", default="")
    ap.add_argument("--label-new", default="")
    ap.add_argument("--rounds", type=int, default=1, help="A B B A blocks")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    args = ap.parse_args(argv)
    old = Path(args.old).resolve()
    if not (old / ".venv" / "bin" / "python").exists():
        sys.exit(f"--old {old}: no .venv there; run `make .venv/.installed` in it first")

    def rev(d: Path) -> str:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=d, capture_output=True)
        return out.stdout.decode().strip() or d.name

    labels = {"old": args.label_old or rev(old), "new": args.label_new or rev(ROOT)}
    sides = {"old": old, "new": ROOT}
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    lb, t0 = load(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, side in enumerate(("old", "new", "new", "old")):
                fig = run_side(sides[side], Path(tmp) / f"{r}-{i}-{side}.json", args.timeout)
                runs[side].append(fig)
                print(f"round {r} {side}: coordinator {fig['coordinator_cpu_per_1k']:.3f} CPU-ms"
                      f"/traj, {fig['ingest_traj_per_s']:,.0f} traj/s", file=sys.stderr)  # fmt: skip
    section = render(runs, labels, time.perf_counter() - t0, lb)
    print(section)
    if not args.no_write:
        replace_section(Path(args.output), SECTION, section)


if __name__ == "__main__":
    main()
