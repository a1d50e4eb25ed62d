"""What mutual TLS costs: the same runs with and without it, alternating, in one invocation.

    python tools/bench/tls.py            # ~8 min, writes the "Mutual TLS" section of BENCHMARKS.md
    python tools/bench/tls.py --quick    # smaller model, short control-plane windows

1. Weights: a WeightService process (as `astra serve weights`) holds one version of the
   weights bench's synthetic bf16 model (TinyLlama-1.1B shapes, 10 layers, ~1.14 GB); this
   process fetches it in full into RAM with Astra's `Receiver(in_memory=True)` (every
   Adler-32 checked, swapped in), `--reps` times per mode, plaintext and TLS alternating, each
   mode with its own service process (the service reads its TLS settings at start).
2. Control plane: `tools/bench/control_plane.py --only astra --no-variant` (64 RaaS in
   4 processes, Dataflow, a trainer), once per mode per pair, alternating.
TLS: a CA and a loopback credential made by `astra.tls_certs` in a temporary directory, named
by ASTRA_TLS_DIR for every process of the TLS runs. Nothing else differs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import weights as W  # noqa: E402  (the weights bench: its model, processes and helpers)
from report import replace_section  # noqa: E402

HEADING = "## Mutual TLS"
DASH = W.DASH


def _env(mode: str, credential: Path) -> None:
    if mode == "tls":
        os.environ["ASTRA_TLS_DIR"] = str(credential)
    else:
        os.environ.pop("ASTRA_TLS_DIR", None)


def bench_fetch(p, tmp: Path, credential: Path) -> dict:
    from astra.clients.weights_publish import publish_version
    from astra.clients.weights_stream import Receiver

    model = W.make_model(W.model_shapes(p.layers, p.vocab), 1)
    total = W.model_bytes(model)
    out: dict = {"model_bytes": total}
    services = {}
    loop = asyncio.new_event_loop()
    try:
        for mode in ("plain", "tls"):
            _env(mode, credential)
            logs = tmp / f"logs-{mode}"
            logs.mkdir()
            cmd = [sys.executable, str(W.PROCS), "service", "--store", str(tmp / f"store-{mode}")]
            svc = services[mode] = W.Proc(cmd, logs / "service.log")
            loop.run_until_complete(
                publish_version(svc.info["address"], W.POLICY, "v1", 1, W.as_tensors(model))
            )
        del model
        gc.collect()
        for rep in range(p.reps):
            for mode in ("plain", "tls"):
                _env(mode, credential)
                svc = services[mode]

                async def one(svc=svc, mode=mode, rep=rep) -> tuple[float, float, float]:
                    r = Receiver(
                        svc.info["address"], W.POLICY, None, in_memory=True, keep_versions=1,
                        receiver_id=f"tls-bench-{mode}-{rep}",
                    )  # fmt: skip
                    cpu0, svc0, t0 = time.process_time(), W.cpu_seconds(svc.pid), time.monotonic()
                    await r.fetch("v1")
                    took = time.monotonic() - t0
                    cpu, svc_cpu = time.process_time() - cpu0, W.cpu_seconds(svc.pid) - svc0
                    await r.close()
                    return took, cpu, svc_cpu

                W.settle()
                took, cpu, svc_cpu = loop.run_until_complete(one())
                gc.collect()
                row = out.setdefault(mode, {"seconds": [], "receiver_cpu": [], "service_cpu": []})
                row["seconds"].append(took)
                row["receiver_cpu"].append(cpu)
                row["service_cpu"].append(svc_cpu)
                W.say(f"fetch {mode} {total / took / 1e9:.2f} GB/s")
    finally:
        for svc in services.values():
            svc.stop()
        loop.close()
        os.environ.pop("ASTRA_TLS_DIR", None)
    return out


def bench_control_plane(p, tmp: Path, credential: Path) -> dict:
    out: dict = {}
    args = ["--only", "astra", "--no-variant", "--no-write"]
    if p.quick:
        args += ["--warmup", "4", "--window", "10", "--lat-warmup", "2", "--lat-window", "6"]
    for pair in range(p.pairs):
        for mode in ("plain", "tls") if pair % 2 == 0 else ("tls", "plain"):
            figures = tmp / f"cp-{mode}-{pair}.json"
            env = {k: v for k, v in os.environ.items() if k != "ASTRA_TLS_DIR"}
            if mode == "tls":
                env["ASTRA_TLS_DIR"] = str(credential)
            cmd = [sys.executable, str(HERE / "control_plane.py"), *args, "--json", str(figures)]
            subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
            raw = json.loads(figures.read_text())
            a = raw["astra"]
            row = {
                "ingested": a["ingest_traj_per_s"],
                "sustained": a["sustained_traj_per_s"],
                "p50": a["fetch_p50_ms"],
                "p99": a["fetch_p99_ms"],
                "coordinator_cpu": a["coordinator_cpu_per_1k"],
                "total_cpu": a["total_cpu_per_1k"],
                "generation_cpu": raw["generation_cpu_ms"],
            }
            out.setdefault(mode, []).append(row)
            W.say(f"control plane {mode}: {row['sustained']:,.0f} trajectories/s")
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def markdown(p, res: dict, started: str, took: float) -> str:
    f = res["fetch"]
    gb = f["model_bytes"] / 1e9
    lines = [
        HEADING,
        "",
        f"Measured {started} with `python tools/bench/tls.py{' --quick' if p.quick else ''}` "
        f"({took:.0f} s) on this machine: {os.cpu_count()} cores, no GPU, Python "
        f"{sys.version.split()[0]}. Every row compares the same runs with and without mutual "
        "TLS (ECDSA P-256 credentials from `astra.tls_certs`), alternating in one invocation.",
        "",
        "| | plaintext | mutual TLS | TLS / plaintext |",
        "|---|---:|---:|---:|",
    ]
    rates = {m: [gb / s for s in f[m]["seconds"]] for m in ("plain", "tls")}

    def cell(xs: list[float], fmt: str) -> str:
        return f"{fmt.format(_med(xs))} ({fmt.format(min(xs))}{DASH}{fmt.format(max(xs))})"

    lines.append(
        f"| full version ({gb:.2f} GB) fetched into RAM, loopback, GB/s, median (min{DASH}max) of "
        f"{p.reps} | {cell(rates['plain'], '{:.2f}')} | {cell(rates['tls'], '{:.2f}')} | "
        f"{_med(rates['tls']) / _med(rates['plain']):.2f} |"
    )
    for key, label in (("receiver_cpu", "receiver"), ("service_cpu", "WeightService")):
        a, b = _med(f["plain"][key]), _med(f["tls"][key])
        lines.append(f"| {label} CPU s per fetch, median | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    cp = res["control_plane"]
    rows = (
        ("sustained", "control plane: sustained trajectories/s, median", "{:,.0f}"),
        ("total_cpu", "control plane: CPU-ms per trajectory, all processes", "{:.3f}"),
        ("coordinator_cpu", "control plane: CPU-ms per trajectory, Dataflow", "{:.3f}"),
        ("p99", "control plane: paced batch fetch p99, ms", "{:.1f}"),
    )
    for key, label, fmt in rows:
        a = _med([r[key] for r in cp["plain"]])
        b = _med([r[key] for r in cp["tls"]])
        each = "; ".join(
            f"{fmt.format(x[key])} / {fmt.format(y[key])}"
            for x, y in zip(cp["plain"], cp["tls"], strict=True)
        )
        lines.append(
            f"| {label} (pairs, plaintext / TLS: {each}) | {fmt.format(a)} | {fmt.format(b)} "
            f"| {b / a:.2f} |"
        )
    gen = [r["generation_cpu"] for m in ("plain", "tls") for r in cp[m]]
    cpu = {m: _med([r["total_cpu"] for r in cp[m]]) for m in ("plain", "tls")}
    fetch_cpu = {
        m: _med([a + b for a, b in zip(f[m]["receiver_cpu"], f[m]["service_cpu"], strict=True)])
        for m in ("plain", "tls")
    }
    link = 0.125  # GB/s: 1 Gbit/s
    lines += [
        "",
        f"Generation alone (timed by each control-plane run) cost {min(gen):.3f}{DASH}"
        f"{max(gen):.3f} CPU-ms per trajectory over these runs: where it moves, the machine "
        "moved, not the code. What TLS costs is CPU: "
        f"{(cpu['tls'] / cpu['plain'] - 1) * 100:+.0f}% per trajectory in the control plane "
        "(every byte Dataflow receives and serves is encrypted and decrypted once more) and "
        f"{(fetch_cpu['tls'] / fetch_cpu['plain'] - 1) * 100:+.0f}% per weight fetch "
        "(receiver and service together). The control plane here is CPU-bound in both modes "
        "(all its processes share 2 cores), so its rate falls by about that much. A full "
        f"version over a 1 Gbit/s link ({link * 1000:.0f} MB/s) arrives "
        f"{_med(rates['tls']) / link:.1f}x slower than TLS moves it here, so on such a link "
        "the weights see no difference.",
        "",
        "Method: fetch rows from one WeightService process per mode (the model published "
        "once to each), this process fetching with `Receiver(in_memory=True)`, receiver CPU "
        "from this process, service CPU from /proc/PID/stat; control-plane rows from "
        "`tools/bench/control_plane.py --only astra --no-variant --json` run once per mode "
        "per pair (pair order alternates), with every process under ASTRA_TLS_DIR in the TLS "
        "runs.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None, help="fetches per mode (default 5)")
    ap.add_argument("--pairs", type=int, default=None, help="control-plane pairs (default 2)")
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--from-json", default="", help="render the report of a recorded --json run")
    p = ap.parse_args(argv)
    p.layers, p.vocab = (2, 8192) if p.quick else (10, 32000)
    p.reps = p.reps or (2 if p.quick else 5)
    p.pairs = p.pairs or (1 if p.quick else 2)
    from astra.tls_certs import init_ca, issue

    if p.from_json:
        res = json.loads(Path(p.from_json).read_text())
        section = markdown(p, res, res["started"], res["seconds"])
        print(section)
        if not p.no_write:
            replace_section(Path(p.output), HEADING, section)
        return 0
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="astra-tls-bench-"))
    try:
        credential = tmp / "tls"
        init_ca(credential)
        issue(credential, credential, ["127.0.0.1", "localhost"])
        res = {
            "fetch": bench_fetch(p, tmp, credential),
            "control_plane": bench_control_plane(p, tmp, credential),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res.update(started=started, seconds=time.monotonic() - t0)
    section = markdown(p, res, started, res["seconds"])
    print(section)
    if p.json:
        Path(p.json).write_text(json.dumps(res, indent=2))
    if not p.no_write:
        replace_section(Path(p.output), HEADING, section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
