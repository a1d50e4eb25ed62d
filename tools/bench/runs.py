"""What the benchmarks built on `astra run` share: one run in a directory of its own, its
figures read back, and the line that says where and when they were measured.

    summary, rows, wall = astra_run(["configs/recipes/lora.yaml"], run_dir, timeout_s)

`rows` are metrics.jsonl's step rows; a run that does not end with exit 0 raises with the end of
its stderr, so a benchmark never writes figures of a failed run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def astra_run(
    args: list[str], run_dir: Path, timeout_s: float, sets: list[str] = ()
) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    """`astra run ARGS --run-dir RUN_DIR --set S...`: (summary.json, metrics rows, wall s)."""
    cmd = [sys.executable, "-m", "astra.run", *args, "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(
            f"{run_dir.name}: astra run exited {proc.returncode}\n{proc.stderr[-3000:]}"
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    text = (run_dir / "metrics.jsonl").read_text()
    return summary, [json.loads(x) for x in text.splitlines() if x], wall


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def measured(tool: str, total_s: float, load_before: str) -> str:
    """The "Measured ..." line of a section."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Measured {now} with `python tools/bench/{tool}` ({total_s:.0f} s) on this machine: "
        f"{os.cpu_count()} cores, no GPU, Python {platform.python_version()}; load average "
        f"before the runs {load_before}."
    )


def variants_main(
    argv: list[str] | None,
    doc: str,
    variants: dict[str, Any],
    run_variant: Any,
    section: Any,
    heading: str,
) -> int:
    """The command line of a bench that runs each variant once (`--steps`, `--timeout`,
    `--no-write`), prints each row as JSON, then its section, and writes the section."""
    import argparse
    import tempfile

    from report import replace_section

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    args = ap.parse_args(argv)
    before = load()
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="astra-bench-") as tmp:
        for name, spec in variants.items():
            rows.append(run_variant(name, spec, args.steps, Path(tmp), args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    text = section(rows, before, time.monotonic() - started)
    print(text)
    if not args.no_write:
        replace_section(ROOT / "BENCHMARKS.md", heading, text)
    return 0
