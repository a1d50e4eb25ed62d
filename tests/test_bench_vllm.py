"""tools/bench/vllm_engine.py in its quick configuration against REAL vLLM: the tiny model
through the three systems (vLLM via VLLMEngine, the built-in engine, HF generate in the vLLM
environment's Python) at concurrency 1, 16 and 64, and vLLM's weight swaps with and without
requests in flight; then what the section renders. Skipped, with the reason, where there is
no vLLM environment or its Python has no transformers (the HF generate baseline)."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from astra.engine.http.vllm_env import vllm_python
from astra.errors import AstraError

pytest.importorskip("torch")

try:
    VLLM_PYTHON = vllm_python()
except AstraError as exc:
    pytest.skip(f"no vLLM here ({exc.message})", allow_module_level=True)

_tf = subprocess.run(
    [VLLM_PYTHON, "-c", "import transformers"],
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
)
if _tf.returncode != 0:
    _why = (_tf.stderr.strip().splitlines() or ["?"])[-1]
    pytest.skip(
        f"{VLLM_PYTHON} cannot import transformers, the HF generate baseline ({_why})",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    path = ROOT / "tools" / "bench" / "vllm_engine.py"
    spec = importlib.util.spec_from_file_location("bench_vllm_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def figure(cell: str) -> float:
    """The leading number of a table cell: "1,648.1 (52%)" -> 1648.1, "0.46x" -> 0.46."""
    found = re.match(r"\s*([\d,]+(?:\.\d+)?)", cell)
    assert found, cell
    return float(found.group(1).replace(",", ""))


def test_quick_run_measures_three_systems_and_vllm_swaps(bench, tmp_path):
    (mspec,) = bench.specs(quick=True)
    assert mspec.bench.name == "tiny" and mspec.bench.repeats == 1 and mspec.swap.swaps == 2
    res = asyncio.run(bench.bench_model(mspec, tmp_path / "m", VLLM_PYTHON))

    assert res.repeats == 1
    assert res.config["eos_token_id"] is None  # nothing may stop a request early
    assert [c.concurrency for c in res.cells] == [1, 16, 64]
    for cell in res.cells:
        lens = [r.new_tokens for r in cell.requests]
        for system in bench.SYSTEMS:  # every system ran every request to its own length
            (run,) = cell.runs[system]
            assert run.useful == sum(lens) and run.seconds > 0
    assert res.size_bytes > 0 and res.vllm_cores != "?"
    idle, busy = res.swaps
    assert (idle.clients, busy.clients) == (0, 16)
    assert idle.running == [0, 0] and max(busy.running) > 0
    for sw in res.swaps:
        assert len(sw.seconds) == len(sw.reload_s) == 2
        assert all(0 < r <= s for r, s in zip(sw.reload_s, sw.seconds, strict=True))
    assert busy.completed > 0 and busy.resumed > 0  # swaps cut running requests, they went on

    text = bench.render([res], started="now", seconds=1.0, loads=[0.5, 0.7], cmd="test")
    assert text.startswith(bench.SECTION + "\n")
    lines = text.splitlines()
    header = next(ln for ln in lines if ln.startswith("| concurrent requests"))
    for name in ("vLLM", "built-in", "HF generate"):
        assert name in header
    rows = {
        int(ln.split("|")[1]): ln.split("|") for ln in lines if re.match(r"\| \d+ \| \d+ \(", ln)
    }
    assert sorted(rows) == [1, 16, 64]
    for cols in rows.values():  # vLLM, built-in, HF generate tokens/s and the two ratios
        assert all(figure(c) > 0 for c in cols[3:8]), cols
    swaps = [ln.split("|") for ln in lines if ln.startswith("| tiny |")]
    assert len(swaps) == 2
    for cols in swaps:  # size, running, swaps, pause, reload, rate
        assert figure(cols[2]) > 0 and figure(cols[4]) == 2
        assert figure(cols[5]) > 0 and figure(cols[6]) > 0
    assert "Observations" in text and "Method." in text
