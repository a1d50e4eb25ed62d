"""Logging set-up of every `astra` process: text for people, or JSON lines for log pipelines.

`ASTRA_LOG_FORMAT=json` (or `configure(..., fmt="json")`) writes one JSON object
per record: `ts` (ISO 8601, UTC, milliseconds), `level`, `logger`, `msg`, then
`pid`, then `exc` when there is a traceback, and any `extra=` fields a caller
passes. The keys come in that order so that line-oriented tools can match on
them. Text is `2026-01-01 12:00:00,000 INFO name: message` (Python's default
shape). `astra run` passes its own choice to every child through the
environment, so a run's logs are all of one format.

`kill -USR1 PID` makes a process that configured its logging here write every thread's
Python stack to stderr (its log, under `astra run`) and go on: what a process that does
not stop is doing, without a debugger.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
from typing import Any, TextIO

ENV = "ASTRA_LOG_FORMAT"
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        return json.dumps(out, ensure_ascii=False)


def log_format(fmt: str | None = None) -> str:
    """The format asked for: `fmt`, else $ASTRA_LOG_FORMAT, else text."""
    chosen = (fmt or os.environ.get(ENV) or "text").lower()
    if chosen not in FORMATS:
        raise ValueError(f"log format {chosen!r}: expected one of {', '.join(FORMATS)}")
    return chosen


def formatter(fmt: str | None = None) -> logging.Formatter:
    return JsonFormatter() if log_format(fmt) == "json" else logging.Formatter(TEXT_FORMAT)


def configure(level: str = "info", fmt: str | None = None, stream: TextIO | None = None) -> None:
    """Root logging to `stream` (stderr) at `level` in the chosen format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    dump_stacks_on(handler.stream)


def dump_stacks_on(stream: TextIO, *, chain: bool = False) -> None:
    """SIGUSR1 writes every thread's stack to `stream` (a real file; not on Windows); with
    `chain`, the handler installed before runs after (an event loop's: `dump_tasks`)."""
    usr1 = getattr(signal, "SIGUSR1", None)
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return  # an in-memory stream (a test's): nothing the C handler can write to
    if usr1 is not None:
        faulthandler.register(usr1, file=stream, all_threads=True, chain=chain)


def dump_tasks(stream: TextIO | None = None) -> None:
    """Writes the stack of every task of the running event loop: where each coroutine waits,
    which thread stacks do not show (an idle loop's thread sits in C)."""
    import asyncio

    out = stream or sys.stderr
    tasks = asyncio.all_tasks()
    print(f"{len(tasks)} asyncio tasks:", file=out)
    for task in tasks:
        print(f"--- {task!r}"[:400], file=out)
        for frame in _awaiting(task.get_coro()):
            code = frame.f_code
            print(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}', file=out)
    out.flush()


def _awaiting(coro: Any) -> list[Any]:
    """The frames of `coro` and of what it awaits, outermost first (a task's own stack stops
    at its coroutine: a suspended one has no f_back)."""
    frames: list[Any] = []
    while coro is not None and len(frames) < 100:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:  # finished, or compiled (gRPC's Cython coroutines)
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames
