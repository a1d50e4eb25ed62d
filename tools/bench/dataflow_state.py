"""Dataflow's state over a long run: the work table with and without folding complete epochs.

    python tools/bench/dataflow_state.py                # 8 epochs of 40,000 groups (~1 min);
                                                        # writes the "Dataflow state" section
    python tools/bench/dataflow_state.py --epochs 4 --groups 5000 --no-write

Two StateStores (the real SQLite state of astra.dataflow.store) live through the same run in
the same invocation: each epoch's groups are pulled (written pending, with the dataset
position, 64 to a transaction as a dispatch round does) and then finished (written done with
an outcome, 64 to a transaction as an ingest round does). The baseline keeps every row
(`storage.keep_done_epochs: null`, the behaviour before folding); Astra's default folds the
complete epochs past the newest 2 with astra.dataflow.folding's EpochFolder, one chunk per
call as Dataflow's upkeep makes them, while the next epoch runs. Reported: the state's bytes on
disk after each epoch (the database file, its WAL checkpointed into it), the work table's rows, each fold chunk's time (what it
holds the event loop for), and a done lookup of an id in the table and of one in a folded
epoch (`StateStore.is_done`, what a late duplicate result costs).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import replace_section

from astra.dataflow.folding import EpochFolder
from astra.dataflow.store import StateStore

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Dataflow state (a long run's work table)"
ROUND = 64  # groups per transaction, as a dispatch or ingest round writes them
STREAM = "main"


def state_bytes(store: StateStore) -> int:
    """The database file's bytes once the WAL is checkpointed into it (and emptied)."""
    store.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return store.path.stat().st_size


def run(directory: Path, epochs: int, groups: int, keep: int | None) -> dict[str, Any]:
    store = StateStore(directory)
    folder = EpochFolder(store, [STREAM], keep, in_flight=lambda s, e: False, every_s=0.0)
    chunks: list[float] = []
    sizes: list[int] = []
    started = time.perf_counter()
    for epoch in range(epochs):
        for lo in range(0, groups, ROUND):
            ids = [f"{STREAM}/{epoch}/{i}" for i in range(lo, min(lo + ROUND, groups))]
            with store.tx() as tx:
                for gid in ids:
                    tx.set_work(gid, STREAM, "pending")
                position = lo + len(ids)
                tx.put(f"dataset/{STREAM}", {"epoch": epoch, "position": position, "size": groups})
            with store.tx() as tx:
                for gid in ids:
                    tx.set_work(gid, STREAM, "done", attempts=1, outcome="accepted")
            t = time.perf_counter()  # one upkeep tick: at most one chunk
            if folder.maybe_fold(now=t):
                chunks.append(time.perf_counter() - t)
        sizes.append(state_bytes(store))
    while True:  # the last complete epochs: what the next upkeep ticks fold
        t = time.perf_counter()
        if not folder.maybe_fold(now=t):
            break
        chunks.append(time.perf_counter() - t)
    wall = time.perf_counter() - started
    sizes.append(state_bytes(store))
    rows = len(store.work_rows())
    in_table = f"{STREAM}/{epochs - 1}/{groups // 2}"
    folded = f"{STREAM}/0/{groups // 2}"
    lookups = {}
    for name, gid in (("in the table", in_table), ("in a folded epoch", folded)):
        t = time.perf_counter()
        for _ in range(10_000):
            assert store.is_done(gid)
        lookups[name] = (time.perf_counter() - t) / 10_000 * 1e6
    result = {
        "sizes": sizes,
        "rows": rows,
        "done": store.done_count(),
        "chunks": chunks,
        "wall_s": wall,
        "lookup_us": lookups,
        "folded_groups": folder.folded_groups,
    }
    store.close()
    return result


def ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.1f}"


def section(base: dict, astra: dict, epochs: int, groups: int, load: str) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    mb = [f"{s / 1e6:.1f}" for s in base["sizes"][:-1]]
    mb_astra = [f"{s / 1e6:.1f}" for s in astra["sizes"][:-1]]
    lines = [
        SECTION,
        "",
        f"Measured {when} with `python tools/bench/dataflow_state.py` on this machine: "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, load average at the start "
        f"{load}. {epochs} epochs of {groups:,} groups of one stream, pulled and finished "
        f"{ROUND} to a transaction; the baseline keeps every work row (`keep_done_epochs: "
        "null`), Astra's default folds complete epochs past the newest 2, a chunk per upkeep "
        "tick while the next epoch runs.",
        "",
        "| | baseline: every row kept | Astra: complete epochs folded (default) |",
        "|---|---:|---:|",
        f"| state on disk after each epoch, MB | {' / '.join(mb)} | {' / '.join(mb_astra)} |",
        f"| state on disk at the end, MB | {base['sizes'][-1] / 1e6:.1f} | "
        f"{astra['sizes'][-1] / 1e6:.1f} |",
        f"| work table rows at the end | {base['rows']:,} | {astra['rows']:,} |",
        f"| groups done (`done_count`) | {base['done']:,} | {astra['done']:,} |",
        f"| fold chunks: count; ms p50 / p99 / max (the event loop held) | - | "
        f"{len(astra['chunks'])}; {ms(astra['chunks'], 0.5)} / {ms(astra['chunks'], 0.99)} / "
        f"{ms(astra['chunks'], 1.0)} |",
        f"| whole run, s (writes and folds) | {base['wall_s']:.1f} | {astra['wall_s']:.1f} |",
        f"| done lookup, µs: an id in the table / one in a folded epoch | "
        f"{base['lookup_us']['in the table']:.1f} / {base['lookup_us']['in a folded epoch']:.1f} "
        f"| {astra['lookup_us']['in the table']:.1f} / "
        f"{astra['lookup_us']['in a folded epoch']:.1f} |",
        "",
        "The baseline's state grows by the same amount every epoch; Astra's stops growing "
        "once the folded epochs' pages are free for the next ones to reuse (SQLite does not "
        "shrink the file). Both count every group done.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--groups", type=int, default=40_000, help="groups per epoch")
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    args = ap.parse_args(argv)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    root = Path(tempfile.mkdtemp(prefix="astra-bench-state-"))
    try:
        base = run(root / "baseline", args.epochs, args.groups, None)
        astra = run(root / "astra", args.epochs, args.groups, 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if base["done"] != astra["done"] or astra["done"] != args.epochs * args.groups:
        raise RuntimeError(f"groups done differ: {base['done']} vs {astra['done']}")
    print(
        f"chunk ms median {statistics.median(astra['chunks']) * 1000:.1f}"
        if astra["chunks"]
        else "",
        file=sys.stderr,
    )
    text = section(base, astra, args.epochs, args.groups, load)
    print(text)
    if not args.no_write:
        replace_section(Path(args.output), SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
