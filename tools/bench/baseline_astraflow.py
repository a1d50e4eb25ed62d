"""The control-plane baseline on AstraFlow's own stack: Flask, FastAPI, cloudpickle, requests.

tools/bench/baseline_http.py rebuilds AstraFlow's design on the standard library, stronger than
AstraFlow is (its own differences, all in the baseline's favour, are listed there). This module
runs the same design and the same coordinator logic (`baseline_http.Coordinator`) on the stack
AstraFlow names for it (../shared/reference/astraflow-architecture.zh.txt): the Dataflow-like
coordinator is a Flask app on Werkzeug's threaded server (what `app.run(threaded=True)` runs)
with a ThreadPoolExecutor pulling every endpoint through `requests` sessions (persistent
connections); each rollout endpoint is a FastAPI app on uvicorn (uvloop and httptools, the
fastest stock setting), generating on its asyncio loop; payloads are cloudpickled, as AstraFlow
sends them. Same roles and flags as baseline_http:

    python tools/bench/baseline_astraflow.py endpoints --count 16 --tokens 1024
    python tools/bench/baseline_astraflow.py coordinator --endpoints A,B,... --dataset X.jsonl

Still in the baseline's favour: persistent connections, nothing written to disk, no
acknowledgement round trip for results or batches. Needs `pip install -e ".[bench]"`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import sys
import threading

import cloudpickle
import requests
import uvicorn
from baseline_http import Coordinator, Endpoint, _wait_for_signal
from baseline_http import main as stdlib_main
from fastapi import FastAPI, Request, Response
from flask import Flask
from flask import Response as FlaskResponse
from flask import request as flask_request
from werkzeug.serving import make_server


def dumps(obj) -> bytes:
    return cloudpickle.dumps(obj)


# ----- rollout endpoints: FastAPI on uvicorn --------------------------------------------------


def endpoint_app(ep: Endpoint) -> FastAPI:
    app = FastAPI()
    tasks: set[asyncio.Task] = set()

    async def run(group: dict) -> None:
        # ScriptedGenerator with no delay never suspends: this is the engine call AstraFlow's
        # RaaS awaits, on its event loop.
        result = ep.generate(group)
        ep.finished.append(result)

    @app.post("/submit")
    async def submit(request: Request) -> dict:
        groups = (await request.json())["groups"]
        for g in groups:
            task = asyncio.create_task(run(g))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return {"accepted": [g["group_id"] for g in groups]}

    @app.post("/pull")
    async def pull() -> Response:
        done, ep.finished = ep.finished, []
        payload = base64.b64encode(dumps(done)).decode()
        body = json.dumps({"results": payload, "count": len(done)}).encode()
        return Response(body, media_type="application/json")

    @app.get("/status")
    async def status() -> dict:
        return {"finished": len(ep.finished)}

    return app


async def serve_endpoints(args) -> None:
    servers, sockets, tasks = [], [], []
    for i in range(args.count):
        ep = Endpoint(f"{args.name}-{i}", args.tokens, args.capacity)
        sock = socket.create_server(("127.0.0.1", 0), backlog=256)
        config = uvicorn.Config(
            endpoint_app(ep), log_level="warning", access_log=False, lifespan="off"
        )
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # this process handles SIGTERM below
        servers.append(server)
        sockets.append(sock)
        tasks.append(asyncio.create_task(server.serve(sockets=[sock])))
    while not all(s.started for s in servers):
        await asyncio.sleep(0.01)
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    info = {"service": "baseline_endpoints", "address": addresses[0], "addresses": addresses}
    print(json.dumps({**info, "pid": os.getpid()}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in ("SIGTERM", "SIGINT"):
        loop.add_signal_handler(getattr(__import__("signal"), sig), stop.set)
    await stop.wait()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)


def run_endpoints(args) -> int:
    import uvloop

    uvloop.run(serve_endpoints(args))
    return 0


# ----- coordinator: Flask + ThreadPoolExecutor + requests -------------------------------------


class _Session:
    """A `requests` session to one endpoint (persistent connection; one caller at a time)."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.url, self.timeout_s = f"http://{address}", timeout_s
        self.session = requests.Session()

    def post(self, path: str, body: bytes) -> bytes:
        resp = self.session.post(
            self.url + path,
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=self.timeout_s,
        )
        if resp.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status_code}")
        return resp.content


class FlaskCoordinator(Coordinator):
    connect = _Session

    @staticmethod
    def dumps(obj) -> bytes:
        return dumps(obj)


def coordinator_app(co: Coordinator) -> Flask:
    app = Flask("baseline_coordinator")

    @app.post("/get_batch")
    def get_batch():
        req = flask_request.get_json(force=True, silent=True) or {}
        data = co.get_batch(int(req.get("num_groups", 32)), float(req.get("max_wait_s", 10)))
        if data is None:
            return {"error": "BATCH_NOT_READY"}, 503
        return FlaskResponse(data, mimetype="application/octet-stream")

    @app.get("/status")
    def status():
        return co.status()

    return app


def run_coordinator(args) -> int:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    co = FlaskCoordinator(args)
    srv = make_server("127.0.0.1", args.port, coordinator_app(co), threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    threading.Thread(target=co.run, daemon=True).start()
    address = f"127.0.0.1:{srv.server_port}"
    info = {"service": "baseline_coordinator", "address": address, "pid": os.getpid()}
    print(json.dumps(info), flush=True)
    _wait_for_signal()
    co.stopped = True
    return 0


# ----- trainer client (used by the benchmark) -------------------------------------------------


class BatchClient:
    """The trainer's side: POST /get_batch through a requests session, unpickle."""

    def __init__(self, address: str) -> None:
        self.conn = _Session(address, timeout_s=60.0)

    def fetch(self, num_groups: int, max_wait_s: float = 10.0) -> list[dict] | None:
        body = json.dumps({"num_groups": num_groups, "max_wait_s": max_wait_s}).encode()
        try:
            data = self.conn.post("/get_batch", body)
        except RuntimeError:
            return None  # 503: not ready within max_wait_s
        return cloudpickle.loads(data)

    def status(self) -> dict:
        return requests.get(self.conn.url + "/status", timeout=10).json()


if __name__ == "__main__":
    sys.exit(stdlib_main(roles={"endpoints": run_endpoints, "coordinator": run_coordinator}))
