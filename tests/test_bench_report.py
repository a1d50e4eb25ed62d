"""tools/bench/report.py: the layout every benchmark section gets (tables first, prose as short
bullets, every word kept), and BENCHMARKS.md as the writers leave it."""

from __future__ import annotations

import collections
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SECTION = (
    """## Example (a benchmark)

Measured 2000-01-01 00:00 UTC with `python tools/bench/x.py` (1 s) on this machine: 2 cores. Load \
average (1 min) 1.0 at the start, 2.0 at the end: other jobs shared the cores, so rates depend on \
what they left free (see the cores-busy row); CPU per trajectory depends on it less, e.g. here.

Parameters: 4 servers; groups of 8 (i.e. 8 samples); batches of 32 groups (256 trajectories); \
buffer bound 4096 groups, no staleness bound; throughput phase: 8 s warm-up + 30 s window; latency \
phase: 4 s + 16 s, trainer paced.

**tiny** (0.1M parameters):

| metric | a | b |
|---|---:|---:|
| rate | 1 | 2 |

**~100M** (100M parameters):

| metric | a | b |
|---|---:|---:|
| rate | 3 | 4 |

Observations:

- tiny: a is faster. """
    + "It gains 2x because it batches. " * 12
    + """

Method. One invocation runs both systems (a, then b), versions 0, 50, ... (summary.json). \
"""
    + "Each system runs as separate processes on loopback and shares the 2 cores. " * 5
    + "\n"
)


def words(text: str) -> collections.Counter:
    text = re.sub(r"(?m)^\\s*- ", " ", text)
    return collections.Counter(w.strip(";:.") for w in text.split() if w.strip(";:.-"))


@pytest.fixture(scope="module")
def report():
    path = ROOT / "tools" / "bench" / "report.py"
    spec = importlib.util.spec_from_file_location("bench_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_layout_opens_with_the_tables_and_keeps_every_word(report):
    out = report.layout(SECTION)
    lines = out.splitlines()
    assert lines[0] == "## Example (a benchmark)"
    body = [ln for ln in lines[1:] if ln.strip()]
    assert body[0] == "**tiny** (0.1M parameters):"
    assert body[1].startswith("| metric")
    assert body[4] == "**~100M** (100M parameters):"  # the second table moves with the first
    assert body[8].startswith("- Measured 2000-01-01")
    assert words(out) == words(SECTION)
    assert all(len(ln) <= report.WIDTH for ln in lines if not ln.startswith("|"))
    assert "Method:" in lines and "Parameters:" in lines
    assert "- groups of 8 (i.e. 8 samples)" in lines  # parameters one per line
    assert any("versions 0, 50, ... (summary.json)." in ln for ln in lines)  # no split at '...'
    assert any(ln.startswith("    - It gains 2x") for ln in lines)  # a long item's sentences
    assert report.layout(out) == out


def test_replace_section_writes_the_layout(report, tmp_path):
    path = tmp_path / "B.md"
    path.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    report.replace_section(path, "## Example (a benchmark)", SECTION)
    text = path.read_text()
    assert text.startswith("# Benchmarks\n\n## Other\n\nkept\n")
    assert text.endswith(report.layout(SECTION))


def test_benchmarks_md_is_laid_out(report, tmp_path):
    """BENCHMARKS.md as a writer would leave it: laying it out again changes nothing."""
    copy = tmp_path / "BENCHMARKS.md"
    copy.write_text((ROOT / "BENCHMARKS.md").read_text())
    report.layout_file(copy)
    assert copy.read_text() == (ROOT / "BENCHMARKS.md").read_text()
