"""Many scripted RaaS gRPC servers in one process, for control-plane benchmarks.

    python tools/bench/raas_host.py --dataflow HOST:PORT --count 16 --capacity 64 --tokens 1024

Each server is a real astra.raas.v1.RolloutService (`astra.servers.raas_serve.start_raas`) over a
`ScriptedGenerator(tokens_override=N, delay_s=0)`, registered with Dataflow by its own
Registrar; all share one event loop. Prints one JSON line when every server is up
(`{"service": "raas_host", "addresses": [...], "instance_ids": [...]}`) and runs until
SIGTERM/SIGINT, then deregisters every instance and exits 0.

`ASTRA_BENCH_PROFILE=/path/prefix` writes a cProfile of this process to `<prefix>.<pid>.prof`
on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from astra.raas.scripted import ScriptedGenerator
from astra.servers.raas_serve import start_raas
from astra.servers.runtime import install_event_loop_policy
from astra.waits import within


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataflow", default="", help="Dataflow host:port; empty: do not register")
    p.add_argument("--count", type=int, default=16, help="RaaS servers in this process")
    p.add_argument("--capacity", type=int, default=64, help="samples per server at once")
    p.add_argument("--tokens", type=int, default=1024, help="generated tokens per sequence")
    p.add_argument("--delay", type=float, default=0.0, help="seconds slept per group")
    p.add_argument("--policy", default="policy")
    p.add_argument("--workflow", default="single_turn")
    p.add_argument("--name", default="host", help="prefix of the instance ids")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> None:
    started = []
    for i in range(args.count):
        backend = ScriptedGenerator(
            [args.policy], [args.workflow], delay_s=args.delay, tokens_override=args.tokens
        )
        started.append(
            await start_raas(
                backend,
                capacity=args.capacity,
                dataflow_address=args.dataflow or None,
                instance_id=f"{args.name}-{i}",
                grace_s=0.5,
            )
        )
    registrars = [r for _, _, r in started if r is not None]
    if registrars:
        await within(asyncio.gather(*(r.registered.wait() for r in registrars)), 60)
    print(
        json.dumps(
            {
                "service": "raas_host",
                "address": started[0][0].address,
                "addresses": [s.address for s, _, _ in started],
                "instance_ids": [v.instance_id for _, v, _ in started],
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await asyncio.gather(*(r.stop() for r in registrars), return_exceptions=True)
    await asyncio.gather(*(s.stop(0.2) for s, _, _ in started), return_exceptions=True)
    await asyncio.gather(*(v.close() for _, v, _ in started), return_exceptions=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    install_event_loop_policy()
    prefix = os.environ.get("ASTRA_BENCH_PROFILE")
    if not prefix:
        asyncio.run(amain(args))
        return 0
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        asyncio.run(amain(args))
    finally:
        prof.disable()
        prof.dump_stats(f"{prefix}.{os.getpid()}.prof")
    return 0


if __name__ == "__main__":
    sys.exit(main())
