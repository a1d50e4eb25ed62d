#!/usr/bin/env python
"""Where a trainer step's time goes on one device: phases, and the ops torch.profiler sees.

    python tools/gpu/profile_trainer.py --model /tmp/astra-m100 --dtype bfloat16
    python tools/gpu/profile_trainer.py --device cpu --steps 2        # CPU dry run

One plain `Trainer` (no process group) on synthetic GRPO batches (SyntheticSource, fixed
seeds), three ways in turn: publishing every version into memory (MemorySink, as
run_trainer.py), with no sink (training alone), and no sink with the last step under
torch.profiler (on the trainer's compute thread, where the step runs). Prints the
median of each phase the trainer times (fetch, compute, publish blocked, total: the
`*_ms` metrics every step reports) and the profiler's top ops by self CPU time and by device
time. Installs nothing; results go to BENCHMARKS.md by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from astra.trainer.loop import Trainer  # noqa: E402
from astra.trainer.synthetic import MemorySink  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_trainer import source, trainer_config, vocab_size  # noqa: E402

PHASES = ("fetch_ms", "compute_ms", "publish_blocked_ms", "host_copy_ms", "total_ms")


def make(args: argparse.Namespace, sink: Any) -> Trainer:
    """The plain trainer of run_trainer.py (same config, same synthetic batches)."""
    return Trainer(trainer_config(args), source=source(args, vocab_size(args.model)), sink=sink)


async def steps(trainer: Trainer, n: int) -> list[dict[str, float]]:
    out = []
    async for result in trainer.run_training_async(n):
        out.append({k: result.metrics.get(k, 0.0) for k in PHASES} | {"tokens": 0.0})
        if result.training_result is not None:
            out[-1]["tokens"] = result.training_result.num_tokens
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


async def measure(args: argparse.Namespace, sink: Any, profile: bool) -> tuple[list, Any]:
    trainer = make(args, sink)
    try:
        await steps(trainer, args.warm)
        sync(args.device)
        if not profile:
            return await steps(trainer, args.steps), None
        # The step runs on the trainer's compute thread: the profiler starts and stops there,
        # around the last measured step's `_train` (forward, backward, optimiser, host copy).
        acts = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        train, calls, profiles = trainer._train, [0], []

        def profiled(*a: Any) -> Any:
            calls[0] += 1
            if calls[0] < args.steps:
                return train(*a)
            with torch.profiler.profile(activities=acts) as p:
                out = train(*a)
                sync(args.device)
            profiles.append(p)
            return out

        trainer._train = profiled
        rows = await steps(trainer, args.steps)
        return rows, profiles[-1]
    finally:
        await trainer.shutdown()


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--groups", type=int, default=8, help="groups of 4 samples per step")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for a dry run)")
        return 1
    runs = {}
    for name, sink, profile in (
        ("memory sink", MemorySink(), False),
        ("no sink", None, False),
        ("no sink, profiled", None, True),
    ):
        rows, prof = asyncio.run(measure(args, sink, profile))
        runs[name] = rows
    print(f"device {args.device}, model {args.model}, dtype {args.dtype}, {args.steps} steps")
    print(f"{'run':<20}" + "".join(f"{k:>20}" for k in (*PHASES, "tokens/step")))
    for name, rows in runs.items():
        cells = [f"{med(rows, k):>20.1f}" for k in PHASES] + [f"{med(rows, 'tokens'):>20.0f}"]
        print(f"{name:<20}" + "".join(cells))
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    if args.device == "cuda":
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.top // 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
