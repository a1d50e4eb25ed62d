"""An AstraFlow-like control plane on the standard library only: the benchmark's baseline.

AstraFlow's Dataflow is Flask + a thread pool that calls `pull` on every rollout service and
gets finished rollouts back as pickled Python objects over JSON/HTTP; the trainer gets a
pickled batch over HTTP. This module rebuilds that design with `http.server` and
`http.client`, moving the same data as Astra's benchmark (trajectories made by the same
`ScriptedGenerator`: int32 token ids, float32 log-probs, uint8 loss mask, int64 versions,
reward), so the two control planes can be compared in one run.

Two roles, each its own process:

    python tools/bench/baseline_http.py endpoints --count 16 --capacity 64 --tokens 1024
        16 rollout endpoints (one ThreadingHTTPServer each, HTTP/1.1 keep-alive) in this
        process. POST /submit {"groups": [...]} queues prompt groups; a worker thread per
        endpoint generates them; POST /pull drains every finished group (destructively, as
        AstraFlow's pull does) and answers {"results": base64(pickle(list of groups))}.
        Prints {"service": "baseline_endpoints", "addresses": [...]} when up.

    python tools/bench/baseline_http.py coordinator --endpoints A,B,... --dataset X.jsonl
        The coordinator. A background thread runs rounds: a ThreadPoolExecutor pulls all
        endpoints in parallel (persistent connections), decodes base64, unpickles, checks
        each trajectory (shapes, finite log-probs, oldest token version), stamps the group's
        reward mean/std, appends to a bounded buffer, and tops each endpoint up to its
        capacity with POST /submit (no new work while the buffer is above 90% of its bound,
        as Astra's gate). A round that brought nothing is followed by `--poll-interval-s`
        (default 5 ms) of sleep; a busy round is followed immediately by the next.
        POST /get_batch {"num_groups": 32, "max_wait_s": 10} blocks until that many groups
        are buffered and answers the pickled batch (list of 256 trajectory dicts with
        advantages) as application/octet-stream; GET /status answers JSON counters.
        Prints {"service": "baseline_coordinator", "address": ...} when up.

Differences from AstraFlow kept on purpose, all in the baseline's favour: stdlib
ThreadingHTTPServer instead of Flask, persistent HTTP connections, pickle protocol 5 instead of
cloudpickle, a raw pickled body for /get_batch, nothing written to disk, no acknowledgement
round trip for results or batches.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from astra.raas.backend import GroupSpec
from astra.raas.scripted import ScriptedGenerator

PROTOCOL = pickle.HIGHEST_PROTOCOL


def _run_sync(coro):
    """Drives a coroutine that never suspends (ScriptedGenerator with delay_s=0)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("coroutine suspended; use delay_s=0")


def group_spec(g: dict) -> GroupSpec:
    """The generator's spec of a prompt group as the coordinators send it (a JSON record)."""
    return GroupSpec(
        group_id=g["group_id"],
        workflow="single_turn",
        policy_ids=("policy",),
        num_samples=g["num_samples"],
        max_new_tokens=g["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        stop_strings=(),
        stop_token_ids=(),
        seed=g["seed"],
        prompt_text=g["prompt"],
        prompt_token_ids=None,
        data=g.get("data", {}),
        reward="",
        epoch=g.get("epoch", 0),
    )


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):
        pass

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length", "0"))
        return self.rfile.read(n) if n else b""

    def _send(self, body: bytes, ctype: str = "application/json", code: int = 200) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# ----- rollout endpoints ----------------------------------------------------------------------


class Endpoint:
    """One rollout service: a queue of prompt groups, a generator thread, finished results."""

    def __init__(self, name: str, tokens: int, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.generator = ScriptedGenerator(["policy"], ["single_turn"], tokens_override=tokens)
        self.todo: deque[dict] = deque()
        self.finished: list[dict] = []
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopped = False

    def work(self) -> None:
        while not self.stopped:
            self.wake.wait(0.5)
            while True:
                with self.lock:
                    if not self.todo:
                        self.wake.clear()
                        break
                    g = self.todo.popleft()
                result = self.generate(g)
                with self.lock:
                    self.finished.append(result)

    def generate(self, g: dict) -> dict:
        spec = group_spec(g)
        trajectories = _run_sync(self.generator.generate(spec, {"policy": 0}))
        out = []
        for t in trajectories:
            s = t.sequences[0]
            out.append(
                {
                    "trajectory_id": f"{g['group_id']}/{t.sample_index}",
                    "group_id": g["group_id"],
                    "sample_index": t.sample_index,
                    "policy_id": s.policy_id,
                    "prompt_length": s.prompt_length,
                    "token_ids": s.token_ids,
                    "logprobs": s.logprobs,
                    "loss_mask": s.loss_mask,
                    "weight_versions": s.weight_versions,
                    "finish_reason": s.finish_reason,
                    "reward": t.reward,
                    "metadata": t.metadata,
                }
            )
        return {"group_id": g["group_id"], "instance_id": self.name, "trajectories": out}

    def handler(self):
        ep = self

        class H(_Handler):
            def do_POST(self):
                body = self._body()
                if self.path == "/submit":
                    groups = json.loads(body)["groups"]
                    with ep.lock:
                        ep.todo.extend(groups)
                    ep.wake.set()
                    self._send(json.dumps({"accepted": [g["group_id"] for g in groups]}).encode())
                elif self.path == "/pull":
                    with ep.lock:
                        done, ep.finished = ep.finished, []
                    payload = base64.b64encode(pickle.dumps(done, protocol=PROTOCOL)).decode()
                    self._send(json.dumps({"results": payload, "count": len(done)}).encode())
                else:
                    self._send(b"{}", code=404)

            def do_GET(self):
                with ep.lock:
                    st = {"queued": len(ep.todo), "finished": len(ep.finished)}
                self._send(json.dumps(st).encode())

        return H


def run_endpoints(args) -> int:
    servers, endpoints = [], []
    for i in range(args.count):
        ep = Endpoint(f"{args.name}-{i}", args.tokens, args.capacity)
        srv = _Server(("127.0.0.1", 0), ep.handler())
        threading.Thread(
            target=srv.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True
        ).start()
        threading.Thread(target=ep.work, daemon=True).start()
        servers.append(srv)
        endpoints.append(ep)
    addresses = [f"127.0.0.1:{s.server_address[1]}" for s in servers]
    print(
        json.dumps(
            {
                "service": "baseline_endpoints",
                "address": addresses[0],
                "addresses": addresses,
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    _wait_for_signal()
    for ep in endpoints:
        ep.stopped = True
    return 0  # serving threads are daemons: they end with the process


# ----- coordinator ----------------------------------------------------------------------------


class _Conn:
    """A persistent HTTP/1.1 connection to one endpoint (one caller at a time)."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        host, port = address.rsplit(":", 1)
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes) -> bytes:
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                self.conn.request(
                    "POST", path, body=body, headers={"Content-Type": "application/json"}
                )
                resp = self.conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{path}: HTTP {resp.status}")
                return data
            except (ConnectionError, http.client.HTTPException, OSError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


class Coordinator:
    """The Dataflow-like coordinator, independent of the HTTP stack: `connect` makes a
    connection with a `post(path, body) -> bytes` method, `dumps` pickles a batch."""

    connect = _Conn

    @staticmethod
    def dumps(obj) -> bytes:
        return pickle.dumps(obj, protocol=PROTOCOL)

    def __init__(self, args) -> None:
        self.endpoints = [a for a in args.endpoints.split(",") if a]
        self.conns = {a: self.connect(a) for a in self.endpoints}
        self.inflight = dict.fromkeys(self.endpoints, 0)
        self.capacity_groups = max(1, args.capacity // args.group_size)
        self.group_size = args.group_size
        self.max_new_tokens = args.max_new_tokens
        self.buffer_capacity = args.buffer_capacity
        self.high_watermark = 0.9
        self.poll_interval_s = args.poll_interval_s
        with open(args.dataset, encoding="utf-8") as f:
            self.records = [json.loads(line) for line in f if line.strip()]
        self.next_index = 0
        self.buffer: deque[dict] = deque()
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.pool = ThreadPoolExecutor(max_workers=args.threads)
        self.counters = {
            "dispatched_groups": 0,
            "completed_groups": 0,
            "malformed_groups": 0,
            "evicted_groups": 0,
            "consumed_groups": 0,
            "consumed_trajectories": 0,
            "batches_served": 0,
            "poll_rounds": 0,
            "idle_rounds": 0,
        }
        self.stopped = False

    # -- collection and dispatch (background) --
    def run(self) -> None:
        while not self.stopped:
            got = sum(self.pool.map(self._poll_one, self.endpoints))
            self.counters["poll_rounds"] += 1
            if got == 0:
                self.counters["idle_rounds"] += 1
                time.sleep(self.poll_interval_s)

    def _next_prompts(self, n: int) -> list[dict]:
        out = []
        with self.lock:
            for _ in range(n):
                i = self.next_index
                self.next_index += 1
                epoch, index = divmod(i, len(self.records))
                record = self.records[index]
                out.append(
                    {
                        "group_id": f"s/{epoch}/{index}",
                        "prompt": str(record.get("prompt", "")),
                        "data": record,
                        "num_samples": self.group_size,
                        "max_new_tokens": self.max_new_tokens,
                        "seed": epoch * 65_537 + index,
                        "epoch": epoch,
                    }
                )
            self.counters["dispatched_groups"] += len(out)
        return out

    def _poll_one(self, address: str) -> int:
        conn = self.conns[address]
        try:
            reply = json.loads(conn.post("/pull", b"{}"))
            results = pickle.loads(base64.b64decode(reply["results"]))
        except Exception as exc:  # a failed endpoint: skip this round
            print(f"pull {address} failed: {exc}", file=sys.stderr)
            return 0
        accepted = [g for g in (self._check(r) for r in results) if g is not None]
        with self.lock:
            self.inflight[address] -= len(results)
            self.counters["completed_groups"] += len(accepted)
            self.counters["malformed_groups"] += len(results) - len(accepted)
            self.buffer.extend(accepted)
            while len(self.buffer) > self.buffer_capacity:
                self.buffer.popleft()
                self.counters["evicted_groups"] += 1
            if accepted:
                self.ready.notify_all()
            room = len(self.buffer) < self.high_watermark * self.buffer_capacity
            free = self.capacity_groups - self.inflight[address] if room else 0
            if free > 0:
                self.inflight[address] += free
        if free > 0:
            try:
                conn.post("/submit", json.dumps({"groups": self._next_prompts(free)}).encode())
            except Exception as exc:
                print(f"submit {address} failed: {exc}", file=sys.stderr)
                with self.lock:
                    self.inflight[address] -= free
        return len(results)

    @staticmethod
    def _check(group: dict) -> dict | None:
        """The checks Astra's ingest does: shapes, finite log-probs, oldest token version."""
        rewards = []
        min_version = -1
        for t in group["trajectories"]:
            tokens, logprobs = t["token_ids"], t["logprobs"]
            mask, versions = t["loss_mask"], t["weight_versions"]
            n = len(tokens)
            if len(logprobs) != n or len(mask) != n or len(versions) != n:
                return None
            if not np.isfinite(logprobs).all() or not math.isfinite(t["reward"]):
                return None
            generated = versions[versions >= 0]
            if generated.size:
                v = int(generated.min())
                min_version = v if min_version < 0 else min(min_version, v)
            rewards.append(t["reward"])
        if not rewards:
            return None
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        group["reward_mean"], group["reward_std"], group["min_version"] = mean, std, min_version
        return group

    # -- trainer side --
    def get_batch(self, num_groups: int, max_wait_s: float) -> bytes | None:
        deadline = time.monotonic() + max_wait_s
        with self.ready:
            while len(self.buffer) < num_groups:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.ready.wait(left)
            groups = [self.buffer.popleft() for _ in range(num_groups)]
            self.counters["consumed_groups"] += num_groups
            self.counters["batches_served"] += 1
        batch = []
        for g in groups:
            mean, std = g["reward_mean"], g["reward_std"]
            for t in g["trajectories"]:
                t["advantage"] = (t["reward"] - mean) / (std + 1e-6)
                t["reward_mean"], t["reward_std"] = mean, std
                batch.append(t)
        with self.lock:
            self.counters["consumed_trajectories"] += len(batch)
        return self.dumps(batch)

    def status(self) -> dict:
        with self.lock:
            return {**self.counters, "buffered_groups": len(self.buffer)}

    def handler(self):
        co = self

        class H(_Handler):
            def do_POST(self):
                body = self._body()
                if self.path == "/get_batch":
                    req = json.loads(body or b"{}")
                    data = co.get_batch(
                        int(req.get("num_groups", 32)), float(req.get("max_wait_s", 10))
                    )
                    if data is None:
                        self._send(b'{"error": "BATCH_NOT_READY"}', code=503)
                    else:
                        self._send(data, "application/octet-stream")
                else:
                    self._send(b"{}", code=404)

            def do_GET(self):
                self._send(json.dumps(co.status()).encode())

        return H


def run_coordinator(args) -> int:
    co = Coordinator(args)
    srv = _Server(("127.0.0.1", args.port), co.handler())
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True).start()
    threading.Thread(target=co.run, daemon=True).start()
    print(
        json.dumps(
            {
                "service": "baseline_coordinator",
                "address": f"127.0.0.1:{srv.server_address[1]}",
                "pid": os.getpid(),
            }
        ),
        flush=True,
    )
    _wait_for_signal()
    co.stopped = True
    return 0  # serving threads are daemons: they end with the process


# ----- trainer client (used by the benchmark) -------------------------------------------------


class BatchClient:
    """The trainer's side: POST /get_batch on a persistent connection, unpickle."""

    def __init__(self, address: str) -> None:
        self.conn = _Conn(address, timeout_s=60.0)

    def fetch(self, num_groups: int, max_wait_s: float = 10.0) -> list[dict] | None:
        try:
            data = self.conn.post(
                "/get_batch",
                json.dumps({"num_groups": num_groups, "max_wait_s": max_wait_s}).encode(),
            )
        except RuntimeError:
            return None  # 503: not ready within max_wait_s
        return pickle.loads(data)

    def status(self) -> dict:
        c = http.client.HTTPConnection(self.conn.host, self.conn.port, timeout=10)
        try:
            c.request("GET", "/status")
            return json.loads(c.getresponse().read())
        finally:
            c.close()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        stop.wait(0.1)


def main(argv=None, roles=None) -> int:
    """`roles` maps a role to the function that runs it (baseline_astraflow passes its own)."""
    roles = roles or {"endpoints": run_endpoints, "coordinator": run_coordinator}
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    e = sub.add_parser("endpoints", help="host N rollout endpoints")
    e.add_argument("--count", type=int, default=16)
    e.add_argument("--capacity", type=int, default=64, help="samples per endpoint (unused here)")
    e.add_argument("--tokens", type=int, default=1024)
    e.add_argument("--name", default="ep")
    c = sub.add_parser("coordinator", help="the Dataflow-like coordinator")
    c.add_argument("--endpoints", required=True, help="comma-separated host:port")
    c.add_argument("--dataset", required=True)
    c.add_argument("--port", type=int, default=0)
    c.add_argument("--capacity", type=int, default=64, help="samples in flight per endpoint")
    c.add_argument("--group-size", type=int, default=8)
    c.add_argument("--max-new-tokens", type=int, default=1024)
    c.add_argument("--buffer-capacity", type=int, default=1024, help="groups")
    c.add_argument("--threads", type=int, default=16, help="pull thread pool size")
    c.add_argument("--poll-interval-s", type=float, default=0.005)
    args = p.parse_args(argv)
    prefix = os.environ.get("ASTRA_BENCH_PROFILE")
    fn = roles[args.role]
    if not prefix:
        return fn(args)
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        return fn(args)
    finally:
        prof.disable()
        prof.dump_stats(f"{prefix}.{args.role}.{os.getpid()}.prof")


if __name__ == "__main__":
    sys.exit(main())
