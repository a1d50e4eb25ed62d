"""tools/bench/vllm_engine.py's report says when a system's repeats split into two modes (one
repeat many times faster than another), instead of letting the median pass for a typical figure.
No vLLM needed: the report is built from recorded runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    path = ROOT / "tools" / "bench" / "vllm_engine.py"
    spec = importlib.util.spec_from_file_location("bench_vllm_split", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    sys.path.remove(str(ROOT / "tools" / "bench"))


def cell(bench, concurrency: int, rates: dict[str, list[float]]):
    from engine import Run

    c = bench.Cell(concurrency, [])
    for system, per_repeat in rates.items():
        c.runs[system] = [Run(879 / r, 879, 879, 1.0) for r in per_repeat]
    return c


def test_a_split_between_repeats_is_named_and_a_spread_within_noise_is_not(bench):
    steady = {"vllm": [1400.0, 1500.0, 1300.0], "astra": [5000.0] * 3, "generate": [2800.0] * 3}
    split = {"vllm": [1390.0, 421.6, 424.8], "astra": [14000.0] * 3, "generate": [5800.0] * 3}
    assert bench.split_repeats("tiny", [cell(bench, 16, steady)]) == []
    (line,) = bench.split_repeats("tiny", [cell(bench, 16, steady), cell(bench, 64, split)])
    assert line.startswith("- tiny, vLLM at 64: the repeats split (1,390, 422, 425 tokens/s")
    assert "one mode of the two" in line
