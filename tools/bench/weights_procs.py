"""Child processes of tools/bench/weights.py: receivers, baseline servers, the shaped link.

    python tools/bench/weights_procs.py worker        # a receiver: JSON commands on stdin
    python tools/bench/weights_procs.py service --store DIR  # the WeightService (defaults)
    python tools/bench/weights_procs.py tcp-server FILE...   # raw TCP sender of the files
    python tools/bench/weights_procs.py grpc-server FILE...  # plain grpc.aio stream of the files
    python tools/bench/weights_procs.py relay --rate B/S --target HOST:PORT...

Each prints one JSON line when ready ({"port": ...}, {"ports": [...]}, {"address": ...}), then serves until
its stdin closes. A worker answers each command line with one JSON line:
  {"op": "fetch", "address", "policy", "dir", "target", "expect": {name: adler32}}
      Astra's Receiver fetches `target` into `dir` (verify, stage, swap); the result
      is checked against `expect` (the trainer's Adler-32 of every tensor).
  {"op": "fetch_mem", "address", "policy", "key", "target", "expect", "reset"}
      The same with an in-memory Receiver (kept across commands under `key`, holding
      one version; `reset` drops it first): verified and swapped in RAM.
  {"op": "tcp", "host", "port", "total"}   raw TCP: read the whole checkpoint into RAM.
  {"op": "grpc", "address", "total"}       plain gRPC: read every chunk into RAM.
  {"op": "fetch_null", "address", "policy", "target", "total"}
      Astra's FetchVersion stream read by a receiver that only acknowledges each tensor
      once its bytes arrived: nothing copied, checked or kept (the ceiling of any receiver
      of this service on Python gRPC).
Times are time.monotonic() (CLOCK_MONOTONIC, shared by all processes of the machine).
The relay forwards every connection to its target through one token bucket per
direction shared by all connections (one 1 Gbit/s uplink), and answers "stats" on
stdin with the bytes it forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import resource
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

MiB = 1 << 20
GRPC_METHOD = "/bench.Blob/Get"


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def sys_self() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def exit_on_stdin_eof(on_eof) -> None:
    def run() -> None:
        for _ in sys.stdin:
            pass
        on_eof()

    threading.Thread(target=run, daemon=True).start()


def load_event_loop_policy() -> None:
    try:
        from astra.servers.runtime import install_event_loop_policy
    except ImportError:  # pragma: no cover - the benchmark runs in the project's venv
        return
    install_event_loop_policy()


# ----- receiver worker --------------------------------------------------------------------------

TIMERS: dict[str, float] = {}


def _timed(cls, attr: str, key: str) -> None:
    """Wraps cls.attr to add its wall time to TIMERS[key] (measurement only)."""
    orig = getattr(cls, attr)

    def wrapper(*args, **kwargs):
        t = time.monotonic()
        try:
            return orig(*args, **kwargs)
        finally:
            TIMERS[key] = TIMERS.get(key, 0.0) + time.monotonic() - t

    setattr(cls, attr, wrapper)


def instrument() -> None:
    from astra.weights.local import LocalVersions
    from astra.weights.receive_stage import Incoming

    _timed(LocalVersions, "install", "install_s")  # assemble + write + verify + swap
    _timed(Incoming, "finish", "finish_s")  # decode (delta) / fsync, verify, record a tensor
    _timed(Incoming, "write", "chunk_write_s")  # chunk into the stage file (+ Adler-32 for raw)
    from astra.weights.memory import MemoryIncoming

    _timed(MemoryIncoming, "finish", "finish_s")  # decode (delta), verify, record a tensor


def _fetched(res, ok: bool, wall: tuple, cpu: tuple, sys_: tuple) -> dict:
    """A fetch's answer line: times, CPU, the plan and what came, the timers of its parts."""
    return {
        "t_start": wall[0],
        "t_end": wall[1],
        "seconds": wall[1] - wall[0],
        "cpu_s": cpu[1] - cpu[0],
        "sys_s": sys_[1] - sys_[0],
        "plan": res.plan,
        "base": res.base,
        "bytes_received": res.bytes_received,
        "tensors_received": res.tensors_received,
        "attempts": res.attempts,
        "verified": ok,
        **TIMERS,
    }


async def op_fetch(c: dict) -> dict:
    from astra.clients.weights_stream import Receiver
    from astra.weights.layout import Version

    TIMERS.clear()
    sys0, cpu0, t0 = sys_self(), cpu_self(), time.monotonic()
    receiver = Receiver(c["address"], c["policy"], c["dir"], durable=c.get("durable", True))
    try:
        res = await receiver.fetch(c["target"])
        current = receiver.current_path
    finally:
        await receiver.close()
    t1, cpu1, sys1 = time.monotonic(), cpu_self(), sys_self()
    with Version(res.path) as v:
        got = {n: e.checksum for n, e in v.entries.items()}
    ok = got == c["expect"] and current == res.path
    return _fetched(res, ok, (t0, t1), (cpu0, cpu1), (sys0, sys1))


MEMORY_RECEIVERS: dict = {}


async def op_fetch_mem(c: dict) -> dict:
    from astra.clients.weights_stream import Receiver

    TIMERS.clear()
    if c.get("reset"):
        old = MEMORY_RECEIVERS.pop(c["key"], None)
        if old is not None:
            await old.close()
        del old
        gc.collect()
    receiver = MEMORY_RECEIVERS.get(c["key"])
    if receiver is None or receiver.address != c["address"]:
        held = True  # a new receiver, or what the old one holds, fetching from another address
        if receiver is not None:
            await receiver.close()
            held = receiver.local
        receiver = MEMORY_RECEIVERS[c["key"]] = Receiver(
            c["address"], c["policy"], None, in_memory=held, keep_versions=1,
            receiver_id=f"bench-mem-{c['key']}",
        )  # fmt: skip
    if c.get("prefault"):  # spare buffers already touched, as raw TCP's receiver has its buffer
        pool = receiver.local.pool
        pool.max_bytes = sum(c["prefault"])
        for size in c["prefault"]:
            buf = np.empty(size, np.uint8)
            buf.fill(1)
            pool.put(buf)
        del buf
    sys0, cpu0, t0 = sys_self(), cpu_self(), time.monotonic()
    res = await receiver.fetch(c["target"])
    t1, cpu1, sys1 = time.monotonic(), cpu_self(), sys_self()
    current = receiver.current
    from astra.weights.checksum import adler32_hex

    ok = current is res.held and {n: t.adler32 for n, t in current.items()} == c["expect"]
    if c.get("recheck"):  # recompute every checksum from the held bytes (outside the clock)
        ok = ok and all(adler32_hex(t.data) == c["expect"][n] for n, t in current.items())
    return _fetched(res, ok, (t0, t1), (cpu0, cpu1), (sys0, sys1))


RAM_BUFFERS: dict = {}


def ram_buffer(n: int):
    """The receiver's in-RAM copy, its pages touched before the clock starts (AstraFlow keeps one).

    Made by the `prep` op, before the orchestrator's clock starts; kept for the next trial."""
    buf = RAM_BUFFERS.get(n)
    if buf is None:
        buf = RAM_BUFFERS[n] = np.empty(n, np.uint8)
        buf.fill(1)
    return buf


async def op_prep(c: dict) -> dict:
    ram_buffer(c["total"])
    return {"ready": True}


async def op_free(c: dict) -> dict:
    """Drops the RAM buffers and the in-memory receiver `key` (and what it holds)."""
    RAM_BUFFERS.clear()
    old = MEMORY_RECEIVERS.pop(c.get("key", ""), None)
    if old is not None:
        await old.close()
    del old
    gc.collect()
    return {"freed": True}


async def op_tcp(c: dict) -> dict:
    buf = ram_buffer(c["total"])
    view = memoryview(buf)
    cpu0, t0 = cpu_self(), time.monotonic()
    with socket.create_connection((c["host"], c["port"])) as s:
        head = b""
        while len(head) < 8:
            part = s.recv(8 - len(head))
            if not part:
                raise ConnectionError("closed before the length")
            head += part
        (total,) = struct.unpack("<Q", head)
        if total != len(buf):
            raise ValueError(f"server sends {total} bytes, expected {len(buf)}")
        pos = 0
        while pos < total:
            n = s.recv_into(view[pos:], min(4 * MiB, total - pos))
            if not n:
                raise ConnectionError(f"closed after {pos} of {total} bytes")
            pos += n
    t1 = time.monotonic()
    return {"t_start": t0, "t_end": t1, "seconds": t1 - t0, "cpu_s": cpu_self() - cpu0,
            "bytes_received": pos}  # fmt: skip


async def op_grpc(c: dict) -> dict:
    import grpc

    buf = ram_buffer(c["total"])
    view = memoryview(buf)
    opts = [("grpc.max_receive_message_length", 8 * MiB)]
    cpu0, t0 = cpu_self(), time.monotonic()
    async with grpc.aio.insecure_channel(c["address"], options=opts) as channel:
        call = channel.unary_stream(GRPC_METHOD)(b"")
        pos = 0
        async for chunk in call:
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
    t1 = time.monotonic()
    if pos != len(buf):
        raise ValueError(f"received {pos} bytes, expected {len(buf)}")
    return {"t_start": t0, "t_end": t1, "seconds": t1 - t0, "cpu_s": cpu_self() - cpu0,
            "bytes_received": pos}  # fmt: skip


async def op_fetch_null(c: dict) -> dict:
    import grpc

    from astra.weights.malloc import keep_freed_memory
    from astra.weights.v1 import weight_service_pb2 as pb
    from astra.weights.wire import deserializer

    keep_freed_memory()  # as the Receiver does
    cpu0, t0 = cpu_self(), time.monotonic()
    pos = 0
    async with grpc.aio.insecure_channel(c["address"]) as channel:
        call = channel.stream_stream(
            "/astra.weights.v1.WeightService/FetchVersion",
            request_serializer=pb.FetchVersionRequest.SerializeToString,
            response_deserializer=deserializer(pb.FetchVersionResponse.FromString),
        )()
        start = pb.FetchStart(policy_id=c["policy"], target_version_id=c["target"])
        await call.write(pb.FetchVersionRequest(start=start))
        name, left = "", 0
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                raise ConnectionError(f"stream ended after {pos} bytes, before FetchDone")
            part = msg.WhichOneof("part")
            if part == "tensor":
                name, left = msg.tensor.name, msg.tensor.encoded_size_bytes
            elif part == "chunk":
                left -= len(msg.chunk.data)
                pos += len(msg.chunk.data)
            elif part == "done":
                break
            if name and left == 0:
                await call.write(pb.FetchVersionRequest(ack=pb.TensorAck(name=name)))
                name = ""
        await call.done_writing()
    t1 = time.monotonic()
    if pos != c["total"]:
        raise ValueError(f"received {pos} bytes, expected {c['total']}")
    return {"t_start": t0, "t_end": t1, "seconds": t1 - t0, "cpu_s": cpu_self() - cpu0,
            "bytes_received": pos}  # fmt: skip


def worker() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    load_event_loop_policy()
    instrument()
    loop = asyncio.new_event_loop()
    ops = {"fetch": op_fetch, "fetch_mem": op_fetch_mem, "tcp": op_tcp, "grpc": op_grpc}
    ops["fetch_null"] = op_fetch_null
    ops["prep"], ops["free"] = op_prep, op_free
    emit({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            emit(loop.run_until_complete(ops[cmd["op"]](cmd)))
        except Exception as exc:  # reported to the orchestrator, which fails the run
            emit({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    loop.close()


# ----- the WeightService ----------------------------------------------------------------------


def service(store: str) -> None:
    """What `astra serve weights --store DIR` runs (start_weights, default StoreConfig)."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    load_event_loop_policy()
    from astra.servers.weights_serve import start_weights
    from astra.weights.store import StoreConfig

    async def main() -> None:
        server = await start_weights(store, config=StoreConfig())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        exit_on_stdin_eof(lambda: loop.call_soon_threadsafe(stop.set))
        emit({"address": server.address, "pid": os.getpid()})
        await stop.wait()
        await server.stop(5)

    asyncio.run(main())


# ----- baseline (a): raw TCP --------------------------------------------------------------------


def load_files(paths: list[str]) -> list[bytes]:
    return [Path(p).read_bytes() for p in paths]


def tcp_server(paths: list[str]) -> None:
    """Sends the whole checkpoint (8-byte length, then every shard) on each connection."""
    bufs = load_files(paths)
    total = sum(len(b) for b in bufs)
    lsock = socket.create_server(("127.0.0.1", 0), backlog=64)

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(struct.pack("<Q", total))
            for b in bufs:
                conn.sendall(b)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # wait for the receiver to close

    def accept() -> None:
        while True:
            conn, _ = lsock.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    done = threading.Event()
    exit_on_stdin_eof(done.set)
    emit({"port": lsock.getsockname()[1], "total": total, "pid": os.getpid()})
    done.wait()


# ----- baseline (c): plain gRPC stream ----------------------------------------------------------


def grpc_server(paths: list[str], chunk: int) -> None:
    import grpc

    load_event_loop_policy()
    bufs = load_files(paths)
    total = sum(len(b) for b in bufs)

    async def get(request: bytes, context):
        for b in bufs:
            view = memoryview(b)
            for pos in range(0, len(view), chunk):
                yield bytes(view[pos : pos + chunk])

    async def main() -> None:
        opts = [("grpc.max_send_message_length", 8 * MiB)]
        server = grpc.aio.server(options=opts)
        handler = grpc.method_handlers_generic_handler(
            "bench.Blob", {"Get": grpc.unary_stream_rpc_method_handler(get)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        exit_on_stdin_eof(lambda: loop.call_soon_threadsafe(stop.set))
        emit({"port": port, "total": total, "pid": os.getpid()})
        await stop.wait()
        await server.stop(0)

    asyncio.run(main())


# ----- the shaped link --------------------------------------------------------------------------


class Bucket:
    """Token bucket: `await take(n)` before forwarding n bytes; debt is slept off."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.last = burst, time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= n
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


def relay(targets: list[str], rate: float, read_bytes: int) -> None:
    stats = {"down": 0, "up": 0, "connections": 0}

    async def pump(reader, writer, bucket: Bucket, key: str) -> None:
        try:
            while True:
                data = await reader.read(read_bytes)
                if not data:
                    break
                await bucket.take(len(data))
                writer.write(data)
                stats[key] += len(data)
                await writer.drain()
            with contextlib.suppress(OSError, RuntimeError):
                if writer.can_write_eof():
                    writer.write_eof()
        except (ConnectionError, OSError):
            pass

    async def main() -> None:
        burst = max(2 * read_bytes, rate / 1000)  # ~1 ms of tokens
        down, up = Bucket(rate, burst), Bucket(rate, burst)  # a full-duplex link
        servers = []

        def handler(host: str, port: int):
            async def handle(c_reader, c_writer) -> None:
                stats["connections"] += 1
                try:
                    s_reader, s_writer = await asyncio.open_connection(host, port)
                except OSError:
                    c_writer.close()
                    return
                for w in (c_writer, s_writer):
                    sock = w.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await asyncio.gather(
                    pump(s_reader, c_writer, down, "down"), pump(c_reader, s_writer, up, "up")
                )
                for w in (c_writer, s_writer):
                    w.close()

            return handle

        for t in targets:
            host, port = t.rsplit(":", 1)
            servers.append(await asyncio.start_server(handler(host, int(port)), "127.0.0.1", 0))
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def control() -> None:
            for line in sys.stdin:
                if line.strip() == "stats":
                    emit(dict(stats))
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=control, daemon=True).start()
        emit({"ports": [s.sockets[0].getsockname()[1] for s in servers], "pid": os.getpid()})
        await stop.wait()
        for s in servers:
            s.close()

    load_event_loop_policy()
    asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("worker")
    sv = sub.add_parser("service")
    sv.add_argument("--store", required=True)
    t = sub.add_parser("tcp-server")
    t.add_argument("files", nargs="+")
    g = sub.add_parser("grpc-server")
    g.add_argument("files", nargs="+")
    g.add_argument("--chunk", type=int, default=MiB)
    r = sub.add_parser("relay")
    r.add_argument("--rate", type=float, required=True, help="bytes per second, each direction")
    r.add_argument("--read-bytes", type=int, default=64 * 1024)
    r.add_argument("--target", action="append", required=True)
    a = ap.parse_args()
    if a.cmd == "worker":
        worker()
    elif a.cmd == "service":
        service(a.store)
    elif a.cmd == "tcp-server":
        tcp_server(a.files)
    elif a.cmd == "grpc-server":
        grpc_server(a.files, a.chunk)
    else:
        relay(a.target, a.rate, a.read_bytes)


if __name__ == "__main__":
    main()
