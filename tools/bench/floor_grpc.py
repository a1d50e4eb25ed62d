"""The floor of the control-plane benchmark: the same messages over Python gRPC, and no logic.

What a coordinator built like Astra's reaches on these cores when it does nothing with what
it moves: no checks, no advantages, no disk, no acknowledgements, no leases, no pool. It bounds
from below what any control plane over Python gRPC costs here, Astra's included, so the
benchmark can say how much of Astra's cost is its own work and how much is the transport.

Two roles, each its own process (the command line of tools/bench/baseline_http.py):

    python tools/bench/floor_grpc.py endpoints --count 16 --tokens 1024
        16 grpc.aio servers on one event loop. /floor.Rollout/Submit (unary, JSON list of
        prompt groups) generates each group with `ScriptedGenerator` and serializes it as
        Astra's RaaS does (`result_wire.group_result_bytes`, protobuf GroupResult bytes);
        /floor.Rollout/Pull (unary) waits up to 0.5 s for a finished group and answers every
        finished one, length-prefixed, drained destructively.

    python tools/bench/floor_grpc.py coordinator --endpoints A,B,... --dataset X.jsonl
        One task per endpoint: fill it to capacity, then Pull, buffer the bytes as they came,
        and Submit as many new groups as came back (none while the buffer is above 90% of its
        bound). /floor.Data/FetchBatch (unary-stream, JSON {num_groups, max_wait_s}) waits for
        that many groups and streams each group's bytes as one message; /floor.Data/Status
        answers JSON counters.

The trainer side (`BatchClient`) parses each message as a GroupResult, as Astra's trainer
parses its batch messages.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import deque
from pathlib import Path

import grpc

from astra.waits import within

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_http import group_spec
from baseline_http import main as baseline_main

from astra.common.v1 import rollout_pb2
from astra.protowire import read_varint, varint
from astra.raas.scripted import ScriptedGenerator
from astra.servers.result_wire import group_result_bytes

OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]
PULL_WAIT_S = 0.5


def _identity(b: bytes) -> bytes:
    return b


class Endpoint:
    """One rollout server: generates what it is given, holds the serialized results."""

    def __init__(self, name: str, tokens: int) -> None:
        self.name = name
        self.generator = ScriptedGenerator(["policy"], ["single_turn"], tokens_override=tokens)
        self.finished: list[bytes] = []
        self.ready = asyncio.Event()
        self.tasks: set[asyncio.Future] = set()

    async def _generate(self, g: dict) -> None:
        spec = group_spec(g)
        trajectories = await self.generator.generate(spec, {"policy": 0})
        self.finished.append(group_result_bytes(g["group_id"], self.name, trajectories))
        self.ready.set()

    async def submit(self, request: bytes, context) -> bytes:
        for g in json.loads(request):
            task = asyncio.ensure_future(self._generate(g))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return b""

    async def pull(self, request: bytes, context) -> bytes:
        if not self.finished:
            self.ready.clear()
            try:
                await within(self.ready.wait(), PULL_WAIT_S)
            except TimeoutError:
                return b""
        done, self.finished = self.finished, []
        return b"".join(varint(len(d)) + d for d in done)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "floor.Rollout",
            {
                "Submit": grpc.unary_unary_rpc_method_handler(self.submit, _identity, _identity),
                "Pull": grpc.unary_unary_rpc_method_handler(self.pull, _identity, _identity),
            },
        )


def _split(payload: bytes) -> list[bytes]:
    out, pos, view = [], 0, memoryview(payload)
    while pos < len(payload):
        size, pos = read_varint(payload, pos)
        out.append(view[pos : pos + size])
        pos += size
    return out


async def _serve_endpoints(args) -> None:
    servers, addresses = [], []
    for i in range(args.count):
        ep = Endpoint(f"{args.name}-{i}", args.tokens)
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((ep.handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    print(json.dumps({"service": "floor_endpoints", "addresses": addresses, "pid": os.getpid()}),
          flush=True)  # fmt: skip
    await _until_signal()


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


class Coordinator:
    def __init__(self, args) -> None:
        self.endpoints = [a for a in args.endpoints.split(",") if a]
        self.capacity_groups = max(1, args.capacity // args.group_size)
        self.group_size, self.max_new_tokens = args.group_size, args.max_new_tokens
        self.buffer_capacity = args.buffer_capacity
        with open(args.dataset, encoding="utf-8") as f:
            self.records = [json.loads(line) for line in f if line.strip()]
        self.next_index = 0
        self.buffer: deque[memoryview] = deque()
        self.ready = asyncio.Condition()
        self.counters = dict.fromkeys(
            ("dispatched_groups", "completed_groups", "evicted_groups", "consumed_groups",
             "batches_served"), 0)  # fmt: skip

    def _prompts(self, n: int) -> bytes:
        out = []
        for _ in range(n):
            i, self.next_index = self.next_index, self.next_index + 1
            epoch, index = divmod(i, len(self.records))
            out.append({"group_id": f"s/{epoch}/{index}", "prompt": str(self.records[index].get("prompt", "")),
                        "data": self.records[index], "num_samples": self.group_size,
                        "max_new_tokens": self.max_new_tokens, "seed": epoch * 65_537 + index,
                        "epoch": epoch})  # fmt: skip
        self.counters["dispatched_groups"] += n
        return json.dumps(out).encode()

    async def drive(self, address: str) -> None:
        channel = grpc.aio.insecure_channel(address, options=OPTIONS)
        submit = channel.unary_unary("/floor.Rollout/Submit", _identity, _identity)
        pull = channel.unary_unary("/floor.Rollout/Pull", _identity, _identity)
        inflight = self.capacity_groups
        await submit(self._prompts(inflight))
        while True:
            groups = _split(await pull(b""))
            if groups:
                inflight -= len(groups)
                async with self.ready:
                    self.buffer.extend(groups)
                    self.counters["completed_groups"] += len(groups)
                    while len(self.buffer) > self.buffer_capacity:
                        self.buffer.popleft()
                        self.counters["evicted_groups"] += 1
                    self.ready.notify_all()
            room = self.capacity_groups - inflight
            if room and len(self.buffer) <= 0.9 * self.buffer_capacity:
                await submit(self._prompts(room))
                inflight += room

    async def fetch_batch(self, request: bytes, context):
        ask = json.loads(request)
        n = int(ask["num_groups"])
        async with self.ready:
            try:
                await within(self.ready.wait_for(lambda: len(self.buffer) >= n), ask["max_wait_s"])
            except TimeoutError:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no batch")
            batch = [self.buffer.popleft() for _ in range(n)]
            self.counters["consumed_groups"] += n
            self.counters["batches_served"] += 1
        for group in batch:
            yield bytes(group)

    async def status(self, request: bytes, context) -> bytes:
        return json.dumps({**self.counters, "buffered_groups": len(self.buffer)}).encode()


async def _serve_coordinator(args) -> None:
    co = Coordinator(args)
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Data", {
        "FetchBatch": grpc.unary_stream_rpc_method_handler(co.fetch_batch, _identity, _identity),
        "Status": grpc.unary_unary_rpc_method_handler(co.status, _identity, _identity),
    }),))  # fmt: skip
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    tasks = [asyncio.ensure_future(co.drive(a)) for a in co.endpoints]
    print(json.dumps({"service": "floor_coordinator", "address": f"127.0.0.1:{port}",
                      "pid": os.getpid()}), flush=True)  # fmt: skip
    await _until_signal()
    for t in tasks:
        t.cancel()


def run_endpoints(args) -> int:
    asyncio.run(_serve_endpoints(args))
    return 0


def run_coordinator(args) -> int:
    asyncio.run(_serve_coordinator(args))
    return 0


class BatchClient:
    """The trainer's side: FetchBatch on one channel, each message parsed as a GroupResult."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=OPTIONS)
        self._fetch = self.channel.unary_stream("/floor.Data/FetchBatch", _identity, _identity)
        self._status = self.channel.unary_unary("/floor.Data/Status", _identity, _identity)

    def fetch(self, num_groups: int, max_wait_s: float = 10.0) -> list | None:
        ask = json.dumps({"num_groups": num_groups, "max_wait_s": max_wait_s}).encode()
        try:
            groups = [rollout_pb2.GroupResult.FromString(m) for m in self._fetch(ask)]
        except grpc.RpcError:
            return None
        return [t for g in groups for t in g.trajectories]

    def status(self) -> dict:
        return json.loads(self._status(b"", timeout=10))


if __name__ == "__main__":
    sys.exit(baseline_main(roles={"endpoints": run_endpoints, "coordinator": run_coordinator}))
