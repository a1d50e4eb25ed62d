"""tools/bench/engine.py in a tiny configuration: the tiny model through both systems (the
built-in engine and transformers' generate), and the consistency of what the benchmark
reports. Skipped where transformers is not installed (the `bench` extra; `dev` has it
through peft)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "tools" / "bench" / "engine.py"
    spec = importlib.util.spec_from_file_location("bench_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.timeout(120)
def test_tiny_comparison_is_consistent(bench, tmp_path):
    lengths = bench.Lengths(median=4, sigma=0.8, lo=1, hi=12)
    spec = bench.Spec("tiny", lengths, concurrency=(1, 4), repeats=2, single_requests=3)
    res = asyncio.run(bench.bench_model(spec, tmp_path / "m", threads=1))
    assert res.repeats == 2
    assert res.config["eos_token_id"] is None  # nothing may stop a request early
    assert [c.concurrency for c in res.cells] == [1, 4]
    for cell in res.cells:
        lens = [r.new_tokens for r in cell.requests]
        assert len(lens) == (3 if cell.concurrency == 1 else 4)
        assert all(1 <= n <= 12 for n in lens)
        for system in bench.SYSTEMS:  # both systems ran every repeat, every request to length
            runs = cell.runs[system]
            assert len(runs) == 2
            assert all(r.useful == sum(lens) and r.seconds > 0 for r in runs)
        for r in cell.runs["astra"]:
            assert r.computed == sum(lens)
        # generate samples every row of a static batch up to the batch's longest request
        batches = [lens[i : i + cell.concurrency] for i in range(0, len(lens), cell.concurrency)]
        want = sum(len(b) * max(b) for b in batches)
        assert all(r.computed == want for r in cell.runs["generate"])
        assert len(cell.ratios()) == 2
    # the same seeded workload every time; lengths drawn per concurrency
    again = bench.make_requests(spec, 4, int(res.config["vocab_size"]))
    assert again == res.cells[1].requests
    text = bench.render([res], started="now", seconds=1.0, loads=[0.5, 0.7], cmd="test", threads=1)
    assert text.startswith(bench.SECTION)
    assert "| 4 | 4 (" in text
    assert "Target (astra" in text  # no 64-concurrency cell here: no verdict row, still renders


def test_lengths_are_seeded_and_clipped(bench):
    lengths = bench.Lengths(median=12, sigma=0.75, lo=2, hi=64)
    a = lengths.draw(1000, (0, 64, 1))
    assert a == lengths.draw(1000, (0, 64, 1))
    assert min(a) >= 2 and max(a) <= 64
    assert sorted(a)[500] in range(10, 15)  # the median is the log-normal's
