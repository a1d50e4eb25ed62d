"""The HTTP side of the FAKE engine servers (astra.testing.fake_engines): one request handler.

Reads a JSON body, hands (method, path, body) to the fake server's `handle`, and writes its
answer as JSON (or text) with the `X-Fake-Engine: <flavor>` header every fake answer
carries. A client that went away mid-answer is ignored. Never used outside tests.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol


class Served(Protocol):
    @property
    def flavor(self) -> str: ...

    def handle(self, method: str, raw_path: str, body: Any) -> tuple[int, Any]: ...


def make_handler(server: Served) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                self._send(400, {"error": {"message": "body is not JSON", "code": 400}})
                return
            status, answer = server.handle(method, self.path, body)
            self._send(status, answer)

        def _send(self, status: int, answer: Any) -> None:
            if isinstance(answer, str):
                data, ctype = answer.encode(), "text/plain"
            else:
                data, ctype = json.dumps(answer).encode(), "application/json"
            try:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Fake-Engine", server.flavor)
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client went away (a cancelled request)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler
