"""`astra run` starts its services in stages (astra.run.supervisor): Dataflow and the
WeightService first, then every RaaS and every trainer together, so that a trainer's start-up
(imports, model load, publishing version 0) overlaps the RaaS's instead of following it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from astra.run.children import ChildFailed
from astra.run.layout import RunDir
from astra.run.recipe import load_recipe
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
    recipe = load_recipe(None, ["eval.every_steps=0", "supervision.startup_timeout_s=30"])

    async def main() -> list[str]:
        sup = Supervisor(recipe, rd, child_factory=factory)
        sup.dataset = rd.dataset
        try:
            with pytest.raises(ChildFailed, match="raas-0 exited"):
                await sup._start_all(rd.dataset, {p.id: 5 for p in recipe.policies})
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
