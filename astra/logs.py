"""Logging set-up of every `astra` process: text for people, or JSON lines for log pipelines.

`ASTRA_LOG_FORMAT=json` (or `configure(..., fmt="json")`) writes one JSON object
per record: `ts` (ISO 8601, UTC, milliseconds), `level`, `logger`, `msg`, then
`pid`, then `exc` when there is a traceback, and any `extra=` fields a caller
passes. The keys come in that order so that line-oriented tools can match on
them. Text is `2026-01-01 12:00:00,000 INFO name: message` (Python's default
shape). `astra run` passes its own choice to every child through the
environment, so a run's logs are all of one format.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
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
