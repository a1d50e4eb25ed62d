"""tools/bench/vllm_engine.py's report says when a system's repeats split into two modes (one
repeat many times faster than another), instead of letting the median pass for a typical figure.
No vLLM needed: the report is built from recorded runs."""

from __future__ import annotations

import pytest

from tests.conftest import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("vllm_engine.py", "bench_vllm_split") as module:
        yield module


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
