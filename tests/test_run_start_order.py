"""`astra run` starts its services in stages (astra.run.starting): Dataflow and the
WeightService beside the warm-up (neither needs the warmed-up model), then every RaaS and every
trainer together, so that a trainer's start-up (imports, model load, publishing version 0)
overlaps the RaaS's instead of following it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from astra.run.children import Child, ChildFailed
from astra.run.layout import RunDir
from astra.run.recipe import load_recipe
from astra.run.starting import start_all
from astra.run.supervisor import Supervisor
from tests.test_run_children import fake_factory


def test_trainers_start_with_the_raas_not_after_them(tmp_path: Path) -> None:
    """A RaaS that dies before serving fails the start, yet the trainer was started in the
    same stage (before, it started only once every RaaS had served); Dataflow and the
    WeightService were serving before either was started."""
    rd = RunDir(tmp_path / "run")
    rd.config.mkdir(parents=True)
    rd.dataset.parent.mkdir(parents=True)
    rd.dataset.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    plans = {"dataflow": "serve", "weights": "serve", "raas": "die", "trainer": "serve"}
    ports = {"dataflow": "41001", "weights": "41002", "trainer": "41003"}
    factory = fake_factory(tmp_path, plans, ports)
    recipe = load_recipe(
        None, ["eval.every_steps=0", "warmup.steps=0", "supervision.startup_timeout_s=30"]
    )

    async def main() -> list[str]:
        sup = Supervisor(recipe, rd, child_factory=factory)
        sup.dataset = rd.dataset
        try:
            with pytest.raises(ChildFailed, match="raas-0 exited"):
                await start_all(sup, rd.dataset, {p.id: 5 for p in recipe.policies})
        finally:
            for group in sup.children.values():
                for child in group:
                    await child.stop(0)
        return [name for name, _ in factory.spawned]

    spawned = asyncio.run(main())
    assert spawned[:2] == ["dataflow", "weights"]
    assert sorted(spawned[2:]) == ["raas-0", "raas-1", "trainer-policy"]
    commands = dict(factory.commands)
    assert "127.0.0.1:41001" in commands["raas-0"]  # given Dataflow's address: started after it


def test_dataflow_and_the_weightservice_start_beside_the_warmup(tmp_path: Path) -> None:
    """A warm-up that fails: Dataflow and the WeightService had been started beside it (before,
    only after it), the failure is the warm-up's, no RaaS or trainer was started, and every
    child started is stopped."""
    rd = RunDir(tmp_path / "run")
    rd.config.mkdir(parents=True)
    rd.dataset.parent.mkdir(parents=True)
    rd.dataset.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    plans = {"dataflow": "serve", "weights": "serve", "warmup": "die"}
    factory = fake_factory(tmp_path, plans, {"dataflow": "41001", "weights": "41002"})
    recipe = load_recipe(None, ["warmup.steps=5", "supervision.startup_timeout_s=30"])

    async def main() -> list[tuple[str, int | None]]:
        sup = Supervisor(recipe, rd, child_factory=factory)
        sup.dataset = rd.dataset
        try:
            with pytest.raises(ChildFailed, match="warmup-policy exited"):
                await start_all(sup, rd.dataset, {p.id: 5 for p in recipe.policies})
        finally:
            for group in sup.children.values():
                for child in group:
                    await child.stop(0)
        return [(name, proc.returncode) for name, proc in factory.spawned]

    spawned = asyncio.run(main())
    assert sorted(name for name, _ in spawned) == ["dataflow", "warmup-policy", "weights"]
    assert all(rc is not None for _, rc in spawned)  # none left running


def test_the_commands_for_a_warmed_up_model_directory_never_import_torch(tmp_path: Path) -> None:
    """Between the warm-up's end and the services' start the supervisor only writes their
    configs: for a model directory (a warm-up's) that must not import torch (a second or more
    on a loaded machine, on the start-up's path); the embedded `tiny` still reads its own
    vocabulary size."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 123}')
    probe = f"""
import sys
from pathlib import Path
from astra.run import layout
from astra.run.layout import RunDir
from astra.run.recipe import load_recipe
from astra.run.starting import start_all
rd = RunDir(Path({str(tmp_path / "run")!r}))
for d in (rd.config, rd.dataset.parent):
    d.mkdir(parents=True, exist_ok=True)
rd.dataset.write_text('{{"prompt": "1+1=", "answer": "2"}}\\n')
r = load_recipe(None, ["eval.every_steps=0", "policies.0.model={model}"])
layout.dataflow_command(r, rd, rd.dataset)
layout.weights_command(r, rd, 0)
layout.raas_command(r, 0, rd, "127.0.0.1:1")
layout.trainer_command(r, r.policies[0], rd, dataflow="127.0.0.1:1", weights="127.0.0.1:2", resume=False)
assert layout.vocab_size(str({str(model)!r})) == 123
assert "torch" not in sys.modules, "torch imported"
assert layout.vocab_size("tiny") == 100 and "torch" in sys.modules
"""
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def _stage(tmp_path: Path, code: str) -> Child:
    return Child("warmup-policy", "warmup", [sys.executable, "-c", code], tmp_path / "w.log", {})


def test_a_stage_result_is_taken_at_its_line_not_at_its_exit(tmp_path: Path) -> None:
    """`astra sft` prints its result once its model is durable; the interpreter's teardown
    after that is not waited for (a stage that lingers is stopped by the caller). Without a
    result line the exit status says why."""
    lingering = "import json, time; print('noise'); print(json.dumps({'out': 'm'}), flush=True); time.sleep(60)"

    async def main() -> None:
        child = _stage(tmp_path, lingering)
        await child.spawn()
        try:
            assert await asyncio.wait_for(child.result(), 30) == {"out": "m"}
            assert child.returncode is None  # still running: its exit was not waited for
        finally:
            await child.stop(5)
        for code, why in (
            ("import sys; sys.exit(1)", "exited with 1"),
            ("print('no json')", "no result line"),
        ):
            child = _stage(tmp_path, code)
            await child.spawn()
            with pytest.raises(ChildFailed, match=why):
                await asyncio.wait_for(child.result(), 30)
            await child.stop(5)

    asyncio.run(main())
