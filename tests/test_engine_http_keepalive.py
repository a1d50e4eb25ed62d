"""astra.engine.http.client.JSONClient keeps connections alive: one TCP connection serves
request after request; a server that closes after each answer, or that dropped an idle
connection without saying so, costs a new connection and never a failed request; a
connection idle past KEEPALIVE_S is not reused. Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from astra.engine.http import client as http_client
from astra.engine.http.client import JSONClient


class Server:
    """An HTTP/1.1 JSON echo server that records the client port of every request.
    `mode`: "keep" (keep-alive), "close" (Connection: close on every answer) or "drop" (closes
    the connection after every answer without saying so, as a server whose keep-alive timer
    ran out between two requests)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.ports: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                outer.ports.append(self.client_address[1])
                length = int(self.headers.get("Content-Length", "0"))
                body = json.dumps({"echo": json.loads(self.rfile.read(length))}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if outer.mode == "close":
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                if outer.mode == "drop":
                    self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def calls(url: str, n: int, pause_s: float = 0.0) -> tuple[list, int]:
    client = JSONClient(url, timeout_s=10.0)
    try:
        answers = []
        for i in range(n):
            answers.append(await client.request("POST", "/v1/x", {"i": i}))
            await asyncio.sleep(pause_s)
        return answers, client.connections_opened
    finally:
        await client.close()


@pytest.mark.parametrize(("mode", "connections"), [("keep", 1), ("close", 5), ("drop", 5)])
def test_requests_share_a_connection_unless_the_server_closes_it(mode, connections) -> None:
    with Server(mode) as server:
        answers, opened = asyncio.run(asyncio.wait_for(calls(server.url, 5, 0.05), 30))
    assert answers == [{"echo": {"i": i}} for i in range(5)]  # none failed, none repeated
    assert len(server.ports) == 5
    assert len(set(server.ports)) == connections == opened


def test_a_connection_idle_too_long_is_not_reused(monkeypatch) -> None:
    monkeypatch.setattr(http_client, "KEEPALIVE_S", 0.0)
    with Server("keep") as server:
        answers, opened = asyncio.run(asyncio.wait_for(calls(server.url, 3), 30))
    assert len(answers) == 3 and len(set(server.ports)) == 3 == opened
