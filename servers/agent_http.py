"""The agent endpoint over HTTP/1.1: OpenAI's `/v1/chat/completions`, `/v1/completions` and
`/v1/models`, on asyncio streams (no web framework).

Thin: it frames requests and responses; astra.agents.endpoint does the work. The API key is
the `Authorization: Bearer` token, or the `X-Astra-Episode` header where the caller's own
bearer token is fixed (a verifiers environment's relay, astra.workflows.verifiers_env).
It listens on 127.0.0.1 and on a Unix socket (`unix_path`, in a directory of its own), which
sandboxed agents without a network reach. Connections are kept alive between requests; a streamed answer (`text/event-stream`) is
written event by event as the endpoint yields them, and ends its connection. Request bodies
above MAX_BODY_BYTES and
header blocks above MAX_HEADER_BYTES are refused (413 / 431), and a client that sends nothing
for IDLE_S is dropped, so a flooding or stuck agent cannot hold the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any

from astra.agents.endpoint import AgentEndpoint
from astra.agents.openai_api import ApiError
from astra.agents.recorder import EPISODE_HEADER
from astra.waits import within

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 << 20
MAX_HEADER_BYTES = 64 << 10
IDLE_S = 120.0
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 413: "Payload Too Large", 429: "Too Many Requests",
           431: "Request Header Fields Too Large", 500: "Internal Server Error"}  # fmt: skip
ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}


class AgentHTTPServer:
    def __init__(self, endpoint: AgentEndpoint, host: str = "127.0.0.1", port: int = 0) -> None:
        self.endpoint, self.host, self.port = endpoint, host, port
        self._server: asyncio.Server | None = None
        self._unix: asyncio.Server | None = None
        self._dir = ""
        self._connections: set[asyncio.Task] = set()

    @property
    def unix_path(self) -> str:
        return os.path.join(self._dir, "endpoint.sock") if self._dir else ""

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> AgentHTTPServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="astra-agents-")
        self._unix = await asyncio.start_unix_server(self._serve, self.unix_path)
        return self

    async def stop(self) -> None:
        """Stops listening and ends every connection (a call under way is cancelled)."""
        for server in (self._server, self._unix):
            if server is not None:
                server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(self._connections, timeout=5.0)
        for server in (self._server, self._unix):
            if server is not None:
                with contextlib.suppress(Exception):
                    await within(server.wait_closed(), 5.0)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("agent endpoint: a connection failed")
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serves one request; False when the connection is to end."""
        try:
            head = await within(reader.readuntil(b"\r\n\r\n"), IDLE_S)
        except asyncio.LimitOverrunError:
            await _send_json(writer, 431, ApiError(431, "headers too large").body(), close=True)
            return False
        if len(head) > MAX_HEADER_BYTES:
            await _send_json(writer, 431, ApiError(431, "headers too large").body(), close=True)
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, path, *_ = [*lines[0].split(" "), "", ""][:3]
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        size = int(headers.get("content-length", "0") or 0)
        if size > MAX_BODY_BYTES:
            body = ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes").body()
            await _send_json(writer, 413, body, close=True)
            return False
        raw = await within(reader.readexactly(size), IDLE_S) if size else b""
        keep = headers.get("connection", "").lower() != "close"
        path = path.split("?", 1)[0]
        if method == "GET" and path == "/v1/models":
            await _send_json(writer, 200, self.endpoint.models(), close=not keep)
            return keep
        if path not in ROUTES or method != "POST":
            status = 405 if path in ROUTES else 404
            err = ApiError(status, f"{method} {path} is not served here")
            await _send_json(writer, status, err.body(), close=not keep)
            return keep
        bearer = headers.get("authorization", "").removeprefix("Bearer ").strip()
        key = headers.get(EPISODE_HEADER, "").strip() or bearer
        try:
            req, out = await self.endpoint.complete(key, raw, chat=ROUTES[path])
        except ApiError as exc:
            await _send_json(writer, exc.status, exc.body(), close=not keep)
            return keep
        except Exception as exc:  # the engine failed: the agent hears it, the server stays
            log.exception("agent endpoint: %s %s failed", method, path)
            err = ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}")
            await _send_json(writer, 500, err.body(), close=True)
            return False
        if not req.stream:
            await _send_json(writer, 200, out, close=not keep)
            return keep
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Connection: close\r\n\r\n"
        )
        async with contextlib.aclosing(out):  # a client that leaves ends the generation
            async for event in out:
                writer.write(event)
                await writer.drain()
        return False


async def _send_json(writer: asyncio.StreamWriter, status: int, body: Any, *, close: bool) -> None:
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
