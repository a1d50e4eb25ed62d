"""A runnable RaaS backed by the ScriptedGenerator (no model), for tests and benchmarks.

    python -m astra.testing.scripted_raas --dataflow HOST:PORT --port 0 --capacity 64 \
        --policy policy --workflow single_turn --delay 0.05 --tokens 0 --instance-id ID \
        [--latency lognormal:MU,SIGMA --latency-seed 0]

It serves the real astra.raas.v1.RolloutService over gRPC, registers with
Dataflow (retrying until it answers), prints one JSON line with its address
on stdout, and runs until SIGTERM/SIGINT, then deregisters and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from astra.raas.scripted import LatencyModel, ScriptedGenerator
from astra.servers.raas_serve import start_raas
from astra.servers.runtime import install_event_loop_policy, serve_until_signal
from astra.stop_deadline import STOP_DEADLINE_S


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="astra.testing.scripted_raas",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dataflow", default="", help="Dataflow host:port; empty: do not register")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on and advertise")
    p.add_argument("--port", type=int, default=0, help="port, 0 = any free port")
    p.add_argument("--capacity", type=int, default=64, help="samples run at once, >= 1")
    p.add_argument("--policy", action="append", dest="policies", help="policy id (repeatable)")
    p.add_argument("--workflow", action="append", dest="workflows", help="workflow (repeatable)")
    p.add_argument("--delay", type=float, default=0.05, help="seconds slept per group")
    p.add_argument(
        "--latency",
        default="",
        metavar="lognormal:MU,SIGMA",
        help="long-tailed time per sample, exp(N(MU, SIGMA)) s; a group waits for its slowest"
        " sample (added to --delay); empty: none",
    )
    p.add_argument("--latency-seed", type=int, default=0, help="seed of the --latency draws")
    p.add_argument("--tokens", type=int, default=0, help="fixed generated length; 0: hashed")
    p.add_argument("--fail-every", type=int, default=0, help="fail ~1 group in N; 0: never")
    p.add_argument("--instance-id", default="", help="instance id; default from address+time")
    p.add_argument(
        "--labels",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help="labels sent at registration (repeatable)",
    )
    p.add_argument("--grace", type=float, default=2.0, help="drain time on SIGTERM, seconds")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.capacity < 1:
        p.error("--capacity must be >= 1")
    labels = {}
    for item in ",".join(args.labels).split(","):
        if item:
            key, sep, value = item.partition("=")
            if not sep or not key:
                p.error(f"--labels: expected K=V, got {item!r}")
            labels[key] = value
    args.labels = labels
    try:
        args.latency = LatencyModel.parse(args.latency, args.latency_seed) if args.latency else None
    except ValueError as exc:
        p.error(f"--latency: {exc}")
    args.policies = args.policies or ["policy"]
    args.workflows = args.workflows or ["single_turn"]
    return args


async def amain(args: argparse.Namespace) -> None:
    backend = ScriptedGenerator(
        args.policies,
        args.workflows,
        delay_s=args.delay,
        tokens_override=args.tokens,
        fail_every=args.fail_every,
        latency=args.latency,
    )
    server, servicer, registrar = await start_raas(
        backend,
        capacity=args.capacity,
        dataflow_address=args.dataflow or None,
        host=args.host,
        port=args.port,
        instance_id=args.instance_id or None,
        labels=args.labels,
        grace_s=args.grace,
    )
    info = {"service": "raas", "address": server.address, "instance_id": servicer.instance_id}
    print(json.dumps(info), flush=True)

    async def on_stop() -> None:
        if registrar is not None:
            await registrar.stop()
        await servicer.close()

    await serve_until_signal(server, on_stop=on_stop, deadline_s=STOP_DEADLINE_S)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from astra.logs import configure

    configure(args.log_level)
    install_event_loop_policy()
    asyncio.run(amain(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
