"""tools/bench/vs_trl.py: without a TRL environment it refuses (exit 2) or, with
--skip-missing, skips writing nothing; without the TRL + vLLM one or vLLM's own (.venv-vllm)
it refuses too; with .venv-trl (`make trl`) its --quick form runs a real `astra run` and TRL's
GRPOTrainer from that run's warm-up checkpoint and reports both curves, and with
.venv-trl-vllm (`make trl-vllm`) and .venv-vllm (`make vllm`) TRL generating through vLLM and
`astra run` with its rollouts on vLLM as a third and a fourth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "tools" / "bench" / "vs_trl.py"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
TRL_VLLM_PYTHON = ROOT / ".venv-trl-vllm" / "bin" / "python"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_missing_trl_is_refused_or_skipped_and_writes_nothing(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    out, fig = tmp_path / "B.md", tmp_path / "f.png"
    common = ("--trl-python", str(missing), "--output", str(out), "--plot", str(fig))
    refused = run(*common, timeout=120)
    assert refused.returncode == 2
    assert "no TRL environment" in refused.stderr and "make trl" in refused.stderr
    skipped = run(*common, "--skip-missing", timeout=120)
    assert skipped.returncode == 0 and "skipped" in skipped.stderr
    assert not out.exists() and not fig.exists()


@pytest.mark.skipif(not TRL_PYTHON.is_file(), reason="no .venv-trl here (make trl)")
def test_missing_trl_vllm_env_is_refused_or_left_out(tmp_path):
    """With TRL but without the TRL + vLLM environment: exit 2 naming `make trl-vllm`,
    nothing measured or written (the check comes before any run)."""
    missing = tmp_path / "no-venv" / "bin" / "python"
    out, fig = tmp_path / "B.md", tmp_path / "f.png"
    common = ("--trl-vllm-python", str(missing), "--output", str(out), "--plot", str(fig))
    refused = run(*common, timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "no TRL + vLLM environment" in refused.stderr and "make trl-vllm" in refused.stderr
    assert "astra run:" not in refused.stderr  # nothing started
    assert not out.exists() and not fig.exists()


@pytest.mark.skipif(
    not (TRL_PYTHON.is_file() and TRL_VLLM_PYTHON.is_file()),
    reason="no .venv-trl or .venv-trl-vllm here (make trl trl-vllm)",
)
def test_missing_vllm_env_is_refused_before_anything_runs(tmp_path):
    """With both TRL environments but without vLLM's (Astra + vLLM's engine): exit 2 naming
    `make vllm`, nothing measured or written."""
    missing = tmp_path / "no-venv" / "bin" / "python"
    out, fig = tmp_path / "B.md", tmp_path / "f.png"
    common = ("--vllm-python", str(missing), "--output", str(out), "--plot", str(fig))
    refused = run(*common, timeout=600)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "no vLLM environment" in refused.stderr and "make vllm" in refused.stderr
    assert "astra run:" not in refused.stderr
    assert not out.exists() and not fig.exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not TRL_PYTHON.is_file(), reason="no .venv-trl here (make trl)")
def test_quick_form_measures_both_systems(tmp_path):
    out, fig, data = tmp_path / "B.md", tmp_path / "f.png", tmp_path / "curves.json"
    proc = run(
        "--quick",
        "--no-vllm",
        "--no-write",
        "--plot",
        str(fig),
        "--json",
        str(data),
        "--output",
        str(out),
        timeout=850,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not out.exists() and fig.stat().st_size > 0
    curves = json.loads(data.read_text())
    for name in ("Astra", "TRL"):
        side = curves[name]
        assert side["steps"] == 8 and side["tokens"] > 0 and side["train_s"] > 0
        steps = [s for _, _, s in side["curve"]]
        assert steps[0] == 0 and max(steps) >= 4  # the start and at least one later evaluation
        assert all(0.0 <= acc <= 1.0 for _, acc, _ in side["curve"])
    assert "## Astra vs TRL" in proc.stdout and "QUICK" in proc.stdout
    assert "TRL + vLLM was not measured: left out (--no-vllm)" in proc.stdout
    assert "Astra + vLLM was not measured: left out (--no-vllm)" in proc.stdout
    assert "TRL + vLLM" not in curves and "Astra + vLLM" not in curves


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(
    not (TRL_PYTHON.is_file() and TRL_VLLM_PYTHON.is_file() and VLLM_PYTHON.is_file()),
    reason="no .venv-trl, .venv-trl-vllm or .venv-vllm here (make trl trl-vllm vllm)",
)
def test_quick_form_measures_trl_and_astra_with_vllm(tmp_path):
    """Both vLLM systems too: Astra + vLLM starts from the Astra run's warm-up checkpoint, so
    its held-out accuracy at version 0 is the Astra run's (the same model, the same problems,
    greedy: the engines may differ in the last bits of a logit, hence the tolerance)."""
    data = tmp_path / "curves.json"
    proc = run("--quick", "--no-write", "--json", str(data), timeout=1450)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curves = json.loads(data.read_text())
    for name in ("TRL + vLLM", "Astra + vLLM"):
        side = curves[name]
        assert side["steps"] == 8 and side["tokens"] > 0 and side["train_s"] > 0
        steps = [s for _, _, s in side["curve"]]
        assert steps[0] == 0 and max(steps) >= 4
        assert 0 < side["startup_s"] <= side["train_s"]
    assert abs(curves["Astra + vLLM"]["curve"][0][1] - curves["Astra"]["curve"][0][1]) <= 0.02
    assert "Astra against TRL + vLLM" in proc.stdout
    assert "Astra + vLLM against TRL (the same target)" in proc.stdout
    assert "Astra + vLLM against TRL + vLLM" in proc.stdout


def test_trls_time_to_the_threshold_with_its_evaluations_on_its_clock():
    """TRL pauses training to evaluate and its clock leaves that out; the section also gives
    its times with them counted (Astra evaluates beside training, on its own clock)."""
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    import vs_trl
    import vs_trl_report

    astra = vs_trl.Side("Astra", curve=[(0.0, 0.8, 0), (10.0, 0.86, 20)])
    trl = [
        vs_trl.Side("TRL", curve=[(0.0, 0.8, 0), (6.0, 0.85, 10)], eval_before={10: 3.0}),
        vs_trl.Side(
            "TRL",
            curve=[(0.0, 0.8, 0), (5.0, 0.84, 10), (9.0, 0.9, 20)],
            eval_before={10: 2.0, 20: 4.0},
            seed=1,
        ),
        vs_trl.Side("TRL", curve=[(0.0, 0.8, 0)], seed=2),
    ]
    assert trl[0].time_to(0.85) == 6.0 and trl[0].time_to_with_evals(0.85) == 9.0
    assert trl[2].time_to_with_evals(0.85) is None
    line = vs_trl_report.with_evals([[astra], trl], 0.85)
    assert line is not None
    assert "TRL 13 s (runs: 9 s, 13 s, not reached), 1.30x Astra's 10 s" in line
    assert (
        vs_trl_report.with_evals([[astra], [vs_trl.Side("TRL", curve=trl[0].curve)]], 0.85) is None
    )
