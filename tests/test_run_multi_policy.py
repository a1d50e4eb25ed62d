"""`astra run configs/recipes/multi_policy.yaml` end to end with real processes: a solver and a
verifier (multi_agent) trained by two trainers under the lockstep version barrier.

While the run goes on the test watches Dataflow's GetStatus (each RaaS's loaded versions as
Dataflow records them, each policy's current version) and every RaaS's own GetStatus: at no
observation may a RaaS serve a solver and a verifier of different versions, nor a version that
not every policy has announced yet."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astra.clients.dataflow import DataflowClient
from astra.clients.raas import RolloutClient

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "recipes" / "multi_policy.yaml"
STEPS, BATCH = 4, 4
POLICIES = ("solver", "verifier")
TIMEOUT_S = 150


def children(run_dir: Path) -> list[dict]:
    path = run_dir / "run.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())["children"]
    return []


async def watch(proc: subprocess.Popen, run_dir: Path, deadline: float) -> list[dict]:
    """Observations until the run exits: {"source", "instance", "loaded", "current"}."""
    seen: list[dict] = []
    dataflow: DataflowClient | None = None
    raas: dict[str, RolloutClient] = {}
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            for c in children(run_dir):
                if c["role"] == "dataflow" and c.get("address") and dataflow is None:
                    dataflow = DataflowClient(c["address"], timeout_s=2.0)
                if c["role"] == "raas" and c.get("address") and c["name"] not in raas:
                    raas[c["name"]] = RolloutClient(c["address"], timeout_s=2.0)
            current: dict[str, int] | None = None
            if dataflow is not None:
                with contextlib.suppress(Exception):
                    status = await dataflow.get_status()
                    current = {p.policy_id: p.current_version for p in status.policies}
                    for i in status.instances:
                        loaded = {v.policy_id: v.version for v in i.loaded_versions}
                        seen.append(
                            {
                                "source": "dataflow",
                                "instance": i.instance_id,
                                "loaded": loaded,
                                "current": current,
                            }
                        )
            for name, client in raas.items():
                with contextlib.suppress(Exception):
                    status = await client.get_status()
                    loaded = {v.policy_id: v.version for v in status.loaded_versions}
                    seen.append({"source": "raas", "instance": name, "loaded": loaded})
            await asyncio.sleep(0.1)
    finally:
        for client in [dataflow, *raas.values()]:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
    return seen


def test_solver_and_verifier_train_together_under_the_lockstep_barrier(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "astra.run", str(RECIPE), "--run-dir", str(run_dir)]
    for override in (
        f"trainer.num_steps={STEPS}",
        f"trainer.batch_groups={BATCH}",
        "dataset.size=64",
        "supervision.stop_grace_s=10",
        "warmup.steps=5",
        "eval.size=8",
    ):
        cmd += ["--set", override]
    out = (tmp_path / "run.out").open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        seen = asyncio.run(watch(proc, run_dir, time.monotonic() + TIMEOUT_S))
        rc = proc.wait(max(1.0, TIMEOUT_S / 5))
        log = (tmp_path / "run.out").read_text(errors="replace")[-4000:]
        assert rc == 0, log
    finally:
        for pgid in [proc.pid, *(c["pid"] for c in children(run_dir) if c.get("pid"))]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        proc.wait(10)
        out.close()

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed"
    assert s["steps_per_policy"] == dict.fromkeys(POLICIES, STEPS)
    assert all(s["versions_per_policy"][p] >= STEPS for p in POLICIES)  # published and announced
    assert s["groups_trained_per_policy"] == dict.fromkeys(POLICIES, STEPS * BATCH)
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    assert s["counters"]["failed_groups"] == 0 and s["counters"]["malformed_results"] == 0
    names = {c["name"] for c in children(run_dir)}
    assert {"trainer-solver", "trainer-verifier", "raas-0", "raas-1"} <= names
    for p in POLICIES:
        log = (run_dir / "logs" / f"trainer-{p}.log").read_text()
        assert f"trainer stopped at step {STEPS}" in log
    # each role warmed up on its own records: the verifier on verdicts, the solver on answers
    verifier = [json.loads(x) for x in (run_dir / "warmup" / "verifier" / "data.jsonl").open()]
    assert all(r["answer"].endswith((" correct", " incorrect")) for r in verifier)
    assert {r["answer"].split()[-1] for r in verifier} == {"correct", "incorrect"}
    assert not (run_dir / "warmup" / "solver" / "data.jsonl").exists()
    assert all((run_dir / "warmup" / p / "model" / "config.json").is_file() for p in POLICIES)
    # Held-out evaluation scores each agent on its own samples, at the same versions.
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    by_policy = {p: [e["version"] for e in evals if e["policy"] == p] for p in POLICIES}
    assert by_policy["solver"] == by_policy["verifier"] and 0 in by_policy["solver"], evals
    assert all(e["groups"] == 8 and e["samples"] + e["failed_samples"] == 8 for e in evals)
    assert set(s["eval"]["policies"]) == set(POLICIES)

    # The barrier held at every observation.
    assert seen, "nothing observed"
    for o in seen:
        assert set(o["loaded"]) == set(POLICIES), o
        assert o["loaded"]["solver"] == o["loaded"]["verifier"], f"a mix of versions: {o}"
        if "current" in o:  # Dataflow's snapshot: nothing loaded before every policy had it
            assert o["loaded"]["solver"] <= min(o["current"].values()), o
    assert {o["source"] for o in seen} == {"dataflow", "raas"}
    assert max(o["loaded"]["solver"] for o in seen) >= 1, "no version was ever loaded"
