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
    text = re.sub(r"(?m)^\s*- ", " ", text)
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
    assert body[8].startswith("Measured 2000-01-01")  # when and where: a paragraph
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


def test_a_writer_renders_its_section_as_it_stands(tmp_path):
    """tools/bench/dataflow_state.py's section, rendered from the figures BENCHMARKS.md shows and
    written through `replace_section`, is the section BENCHMARKS.md holds (but for the line of
    when and where it was measured)."""
    path = ROOT / "tools" / "bench" / "dataflow_state.py"
    spec = importlib.util.spec_from_file_location("bench_dataflow_state", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
        mb = [3.4, 6.9, 10.3, 13.7, 17.2, 20.6, 24.0, 27.5]
        mb_astra = [3.4, 6.9, 10.3, 10.4, 10.4, 10.4, 10.4, 10.4]
        base = {
            "sizes": [m * 1e6 for m in [*mb, 27.5]],
            "rows": 320_000,
            "done": 320_000,
            "chunks": [],
            "wall_s": 7.3,
            "lookup_us": {"in the table": 7.1, "in a folded epoch": 7.0},
        }
        astra = {
            "sizes": [m * 1e6 for m in [*mb_astra, 10.4]],
            "rows": 80_000,
            "done": 320_000,
            "chunks": [0.0058] * 118 + [0.0062, 0.0063],
            "wall_s": 8.3,
            "lookup_us": {"in the table": 5.6, "in a folded epoch": 11.3},
        }
        out = tmp_path / "BENCHMARKS.md"
        out.write_text((ROOT / "BENCHMARKS.md").read_text())
        text = bench.section(base, astra, 8, 40_000, "1.7 / 2.6 / 2.2")
        bench.replace_section(out, bench.SECTION, text)
    finally:
        sys.modules.pop(spec.name, None)

    def own(page: str) -> str:
        part = page[page.index(bench.SECTION) :]
        part = part[: part.index("\n## ", 1)] if "\n## " in part[1:] else part
        flat = " ".join(part.split())
        return re.sub(r"Measured .*? on this machine: \d+ cores, Python [\d.]+,", "Measured", flat)

    assert own(out.read_text()) == own((ROOT / "BENCHMARKS.md").read_text())
    assert out.read_text().count("\n## ") == (ROOT / "BENCHMARKS.md").read_text().count("\n## ")
