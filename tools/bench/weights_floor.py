"""The weight stream against its floors: issue 29's restated targets, measured in one invocation.

    python tools/bench/weights_floor.py            # ~3 min; writes "Weights against the floor"
                                                   # in BENCHMARKS.md
    python tools/bench/weights_floor.py --quick --no-write   # a small model, 2 rounds, 2 deltas

The 60%-of-raw-TCP target of tools/bench/weights.py was retired: a Python gRPC receiver that does
nothing with what it gets moves 35-69% of raw TCP here. What replaces it, with the model, the
processes and the relay of tools/bench/weights.py (its `Bench`):

1. The stream. `--rounds` rounds (default 7) of one receiver fetching a stored full version,
   each round running raw TCP, plain gRPC, Astra's in-memory receiver (`Receiver(in_memory=True)`,
   spare buffers faulted in before the clock: every Adler-32 checked, the version swapped) and a
   receiver that only reads the same stream and acknowledges (nothing copied, checked or kept),
   these two back to back in alternating order.
   Figure: Astra / the acknowledging receiver in the same round. Target: median >= 90%.
2. The link. One full version to 4 in-memory receivers through the 1 Gbit/s relay, two deltas on
   loopback (so that, as in training, each later delta decodes into buffers already used), then
   `--deltas` consecutive deltas through the relay. Figure: the full version's end-to-end time
   over each delta's (publish until the last receiver swapped). Target: >= 10x for at least 4 of
   every 5 consecutive deltas.

Every figure comes from this run; the section says the machine's load before and after.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import replace_section  # noqa: E402
from weights import (  # noqa: E402
    GB,
    ROOT,
    TIMES,
    Bench,
    adlers,
    as_tensors,
    ask_all,
    make_model,
    model_bytes,
    model_shapes,
    say,
    update_model,
)

SECTION = "## Weights against the floor"
T_VS_ACK_ONLY = 0.90  # Astra in memory / the acknowledging receiver, median of rounds
T_LINK_SPEEDUP = 10.0
T_LINK_SHARE = 4 / 5  # of consecutive deltas at or above T_LINK_SPEEDUP


def measure(p: argparse.Namespace, tmp: Path) -> dict:
    """Runs both parts; the figures as plain data (see `section`)."""
    from astra.weights.checkpoint import write_full

    model = make_model(model_shapes(p.layers, p.vocab), seed=1)
    size = model_bytes(model)
    base_dir = tmp / "ckpt-v1"
    write_full(base_dir, as_tensors(model), {"model_type": "llama"}, version="v1", durable=False)
    shards = sorted(base_dir.glob("*.safetensors"))
    res: dict = {"model_bytes": size, "loadavg_start": os.getloadavg()}
    rounds: dict[str, list[float]] = {"tcp": [], "grpc": [], "astra_mem": [], "ack_only": []}
    b = Bench(p, tmp)
    try:
        b.start(shards, sum(f.stat().st_size for f in shards))
        b.astra_trial(model, "full", n=1)
        expect, sizes = adlers(model), [a.nbytes for a in model.values()]
        identity = f"v{b.version}"
        for i in range(p.rounds):
            say(f"stream round {i + 1} of {p.rounds}")
            rounds["tcp"].append(size / b.raw_tcp(1, False)["seconds"] / GB)
            rounds["grpc"].append(size / b.plain_grpc(1)["seconds"] / GB)
            # The pair compared runs back to back, in alternating order: a drift in the load
            # from other jobs falls on each side first as often as second.
            pair = ("astra_mem", "ack_only") if i % 2 == 0 else ("ack_only", "astra_mem")
            for kind in pair:
                if kind == "astra_mem":
                    seconds = b.astra_single_full_mem(identity, expect, sizes)["seconds"]
                else:
                    seconds = b.null_receiver(identity, size)["seconds"]
                rounds[kind].append(size / seconds / GB)
        ask_all(b.workers[:1], [{"op": "free", "key": "single"}])
        res["stream"] = rounds
        seed = 10
        full = b.astra_trial(model, "full", link=True, memory=True)
        for _ in range(2):  # warm-up deltas on loopback, not timed for the figure
            seed += 1
            update_model(model, seed, p.fraction)
            b.astra_trial(model, "delta", memory=True)
        deltas = []
        for _ in range(p.deltas):
            seed += 1
            update_model(model, seed, p.fraction)
            deltas.append(b.astra_trial(model, "delta", link=True, memory=True))
    finally:
        b.stop()
    res["link_full_s"] = full["e2e_s"]
    res["link_deltas"] = [
        {k: d[k] for k in ("e2e_s", "publish_s", "fetch_s", "bytes_per_receiver")} for d in deltas
    ]
    res["loadavg_end"] = os.getloadavg()
    return res


def _range(values: list[float], fmt: str) -> str:
    return (
        f"{fmt.format(statistics.median(values))} "
        f"({fmt.format(min(values))}\u2013{fmt.format(max(values))})"
    )


def verdicts(res: dict) -> dict:
    """The two targets: ratios, counts and whether each is met."""
    s = res["stream"]
    ratios = [a / n for a, n in zip(s["astra_mem"], s["ack_only"], strict=True)]
    speedups = [res["link_full_s"] / d["e2e_s"] for d in res["link_deltas"]]
    fast = sum(x >= T_LINK_SPEEDUP for x in speedups)
    return {
        "ratios": ratios,
        "ratio": statistics.median(ratios),
        "stream_met": statistics.median(ratios) >= T_VS_ACK_ONLY,
        "speedups": speedups,
        "fast": fast,
        "link_met": bool(speedups) and fast >= T_LINK_SHARE * len(speedups),
    }


def section(res: dict, p: argparse.Namespace, started: str, took: float) -> str:
    v = verdicts(res)
    s = res["stream"]
    met = {True: "met", False: "**missed**"}
    pct = ", ".join(f"{r:.0%}" for r in v["ratios"])
    spd = ", ".join(f"{x:.1f}{TIMES}" for x in v["speedups"])
    deltas = ", ".join(f"{d['e2e_s']:.2f}" for d in res["link_deltas"])
    load = ["/".join(f"{x:.1f}" for x in res[k]) for k in ("loadavg_start", "loadavg_end")]
    missed = [
        *(
            [f"stream {v['ratio']:.0%} of the acknowledging receiver"]
            if not v["stream_met"]
            else []
        ),
        *(
            [f"{v['fast']} of {len(v['speedups'])} deltas at 10{TIMES}"]
            if not v["link_met"]
            else []
        ),
    ]
    lines = [
        SECTION,
        "",
        "| figure | each round or delta | median (min\u2013max) | target | met? |",
        "|---|---|---:|---|---|",
        f"| full version to 1 receiver, loopback: Astra in memory / a receiver that only "
        f"acknowledges, same round | {pct} | {_range(v['ratios'], '{:.0%}')} | \u2265 90% "
        f"(median) | {met[v['stream_met']]} |",
        f"| 1 Gbit/s link, 4 in-memory receivers: full end-to-end / delta end-to-end, consecutive "
        f"deltas | {spd} | {_range(v['speedups'], '{:.1f}')}{TIMES} | \u2265 10{TIMES} in at "
        f"least 4 of 5 | {met[v['link_met']]} ({v['fast']} of {len(v['speedups'])}) |",
        "",
        "| one receiver, GB/s | raw TCP | plain gRPC | only acknowledges | Astra in memory |",
        "|---|---:|---:|---:|---:|",
        f"| median (min\u2013max) over {len(s['tcp'])} rounds | {_range(s['tcp'], '{:.2f}')} | "
        f"{_range(s['grpc'], '{:.2f}')} | {_range(s['ack_only'], '{:.2f}')} | "
        f"{_range(s['astra_mem'], '{:.2f}')} |",
        "",
        f"Measured {started} with `python tools/bench/weights_floor.py"
        f"{' --quick' if p.quick else ''}` ({took:.0f} s) on this machine: {os.cpu_count()} "
        f"cores, no GPU, Python {platform.python_version()}; load average (1/5/15 min) before "
        f"{load[0]}, after {load[1]} (other jobs share the cores).",
        "",
        "**Targets: "
        + ("met." if not missed else "missed: " + "; ".join(missed) + ".")
        + f"** The link's full version took {res['link_full_s']:.1f} s; the deltas {deltas} s.",
        "",
        "Method:",
        "",
        f"- The model and processes of tools/bench/weights.py: a bf16 model with TinyLlama-1.1B "
        f"shapes ({p.layers} layers, vocabulary {p.vocab:,}; {res['model_bytes'] / GB:.2f} GB), "
        f"each update flipping low mantissa bits of {p.fraction:.0%} of every matrix and every "
        "norm element; a WeightService process as `astra serve weights` runs it; receivers in "
        "processes of their own; the 1 Gbit/s link is an asyncio relay at 125 MB/s per direction.",
        "- The stream rounds run the four receivers one after another in each round, so load "
        "from other jobs falls on all of them; the ratio pairs Astra with the acknowledging "
        "receiver of its own round, the two back to back in alternating order.",
        "- The acknowledging receiver reads the same FetchVersion stream from the same service "
        "and acknowledges each tensor once its bytes have arrived: the most any receiver over "
        "Python gRPC could do with this stream.",
        "- The link part: one full version, two warm-up deltas on loopback, then the consecutive "
        "deltas, each from the trainer's `publish_version` call until the last of 4 receivers "
        "has verified every Adler-32 and swapped the version.",
        "",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers, 2 rounds, 2 deltas")
    ap.add_argument("--rounds", type=int, default=None, help="stream rounds (default 7)")
    ap.add_argument("--deltas", type=int, default=None, help="deltas through the link (default 5)")
    ap.add_argument("--fraction", type=float, default=0.01, help="changed share of each matrix")
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--tmp", default="/tmp", help="where the temporary directory goes")
    p = ap.parse_args(argv)
    small = {"layers": 2, "vocab": 8192, "rounds": 2, "deltas": 2}
    full = {"layers": 10, "vocab": 32000, "rounds": 7, "deltas": 5}
    for k, value in (small if p.quick else full).items():
        if getattr(p, k, None) is None:
            setattr(p, k, value)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parse_args(argv)
    from astra.servers.runtime import install_event_loop_policy

    install_event_loop_policy()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="astra-bench-wfloor-", dir=p.tmp) as d:
        tmp = Path(d)
        try:
            res = measure(p, tmp)
        except Exception:
            logs = sorted((tmp / "logs").glob("*.log")) if (tmp / "logs").is_dir() else []
            for log in logs:
                sys.stderr.write(f"--- {log.name}\n{log.read_text()[-2000:]}\n")
            raise
    text = section(res, p, started, time.monotonic() - t0)
    print(text)
    if not p.no_write:
        replace_section(Path(p.output), SECTION, text)
        print(f"updated {p.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
