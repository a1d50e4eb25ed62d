"""tools/bench/vllm_worker.py: what its section says, a missing vLLM is an error and not a
figure, and (with vLLM) a real server in each mode, checked for which processes it runs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import vllm_worker

ARGS = SimpleNamespace(repeats=1, seconds=1.0, runs=1, steps=20)


def test_the_section_opens_with_a_table_and_pairs_the_modes_by_repeat():
    engine = [
        {"mode": "worker process", "by_c": {"8": {"seqs_per_s": 100.0, "cpu_ms_per_seq": 10.0}}},
        {"mode": "in engine core", "by_c": {"8": {"seqs_per_s": 150.0, "cpu_ms_per_seq": 6.0}}},
    ]
    runs = [
        {"mode": "worker process", "s_per_step": 0.3, "wall_s": 90.0, "lost": 0, "duplicated": 0},
        {"mode": "in engine core", "s_per_step": 0.2, "wall_s": 80.0, "lost": 0, "duplicated": 1},
    ]
    text = vllm_worker.section(engine, runs, [8], ARGS, 10.0, "0.1")
    lines = text.splitlines()
    assert lines[0] == vllm_worker.SECTION and lines[2].startswith("| concurrent requests")
    assert "| 8 | 100.00 (100.00-100.00) | 150.00 (150.00-150.00) |" in text
    assert text.count("0.60 (0.60-0.60)") == 1  # 6.0 / 10.0 CPU-ms per sequence
    assert "| in engine core | 1 | 0.20 (0.20-0.20) | 80.00 (80.00-80.00) | 0 / 1 |" in text


def test_without_vllm_it_fails_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(vllm_worker, "vllm_python", lambda: None)
    monkeypatch.setattr(vllm_worker, "ROOT", tmp_path)  # a write would land here
    assert vllm_worker.main(["--runs", "0"]) == 2
    assert "vLLM is not installed" in capsys.readouterr().err
    assert not (tmp_path / "BENCHMARKS.md").exists()


def vllm_comms(pid: int) -> list[str]:
    import psutil

    procs = psutil.Process(pid).children(recursive=True)
    return sorted(p.name() for p in procs)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_mode_serves_with_the_processes_it_names(tmp_path, monkeypatch):
    python = vllm_worker.vllm_python()
    if python is None:
        pytest.skip("no vLLM environment (make vllm)")
    from astra.engine.tiny import save_tiny

    model = save_tiny(tmp_path / "model")
    seen = {}

    def spy(pid: int) -> float:
        seen.setdefault(len(seen), vllm_comms(pid))
        return 0.0

    monkeypatch.setattr(vllm_worker, "tree_cpu_s", spy)
    for mode in vllm_worker.MODES:
        seen.clear()
        got = asyncio.run(
            vllm_worker.engine_mode(str(python), model, mode, [2], 1.0, tmp_path / f"{mode}.log")
        )
        assert got["2"]["seqs_per_s"] > 0
        workers = [n for n in seen[0] if "Worker" in n]
        assert "VLLM::EngineCore" in seen[0] or "VLLM::EngineCor" in seen[0], seen[0]
        assert bool(workers) == (mode == "worker process"), (mode, seen[0])
