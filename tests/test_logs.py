"""Log formats: JSON records parse and carry the fields; the run's observer reads both formats."""

from __future__ import annotations

import io
import json
import logging

import pytest

from astra.logs import ENV, configure, log_format
from astra.run.observe import STEP_LINE


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_records_are_one_object_per_line(restore_root):
    out = io.StringIO()
    configure("info", "json", out)
    log = logging.getLogger("astra.test")
    log.info("hello %s", "world", extra={"policy": "p", "step": 3})
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")
    log.debug("not shown")
    first, second = (json.loads(x) for x in out.getvalue().splitlines())
    assert list(first)[:5] == ["ts", "level", "logger", "msg", "pid"]
    assert first["msg"] == "hello world" and first["level"] == "INFO"
    assert (first["policy"], first["step"]) == ("p", 3) and first["ts"].endswith("Z")
    assert second["level"] == "ERROR" and "ValueError: bad" in second["exc"]


def test_format_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "JSON")
    assert log_format() == "json"
    assert log_format("text") == "text"
    monkeypatch.setenv(ENV, "xml")
    with pytest.raises(ValueError, match="xml"):
        log_format()


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("skipped", ["", "NON_FINITE_LOSS"])
def test_the_observer_reads_trainer_step_lines_in_both_formats(restore_root, fmt, skipped):
    out = io.StringIO()
    configure("info", fmt, out)
    loss = "nan" if skipped else "0.125"
    logging.getLogger("astra.servers.trainer").info(
        "step %d version %d loss %s %s", 7, 8, loss, skipped
    )
    m = STEP_LINE.search(out.getvalue().encode())
    assert m is not None
    assert m.groups() == (b"7", b"8", loss.encode(), skipped.encode(), None)
