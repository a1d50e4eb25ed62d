"""`astra run` restarts what dies (astra.run.restarts): the failure matrix of INVARIANTS.md held by
the supervisor itself. Real processes, real SIGKILLs, one after another, in one run that must still
complete with every group trained once and versions that never go back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from astra.run.children import ChildFailed
from astra.run.layout import RunDir, trainer_config
from astra.run.recipe import load_recipe
from astra.run.restarts import Restarts, port_of
from astra.run.supervisor import Supervisor
from tests.procs import held
from tests.test_run import gone
from tests.test_run_children import fake_factory


class _Sup:
    """What Restarts reads of a supervisor, for the decisions that need no process."""

    def __init__(self, recipe, rd: RunDir) -> None:
        self.recipe = self.started_recipe = recipe
        self.rd, self.dataset, self.children = rd, rd.dataset, {"core": []}
        self.addresses: dict[str, str] = {}


class _Child:
    restartable = True

    def __init__(self, name: str, role: str, address: str = "", args=()) -> None:
        self.name, self.role, self.info, self.args = name, role, {"address": address}, list(args)
        self.extra: dict = {}

    @property
    def address(self) -> str:
        return self.info["address"]


def test_restart_decisions_and_commands(tmp_path: Path) -> None:
    recipe = load_recipe(None, ["supervision.max_restarts=2", "eval.every_steps=0"])
    rd = RunDir(tmp_path / "run")
    rd.config.mkdir(parents=True)
    sup = _Sup(recipe, rd)
    r = Restarts(sup)  # type: ignore[arg-type]
    df = _Child("dataflow", "dataflow", "127.0.0.1:41001")
    ws = _Child("weights", "weights", "127.0.0.1:41002")
    sup.children["core"] = [df, ws]
    sup.addresses = {"dataflow": df.address, "weights": ws.address}
    assert port_of(df.address) == 41001
    cmd = r.command(df)
    config = Path(cmd[cmd.index("--config") + 1]).read_text()
    assert "port: 41001" in config  # every other process holds this address
    cmd = r.command(ws)
    assert cmd[cmd.index("--port") + 1] == "41002"
    trainer = _Child("trainer-policy", "trainer")
    cmd = r.command(trainer)
    config = Path(cmd[cmd.index("--config") + 1]).read_text()
    assert "dataflow: 127.0.0.1:41001" in config and "weights: 127.0.0.1:41002" in config
    # while they restart (their own address is empty) the commands keep their addresses
    df.info["address"] = ws.info["address"] = ""
    cmd = r.command(ws)
    assert cmd[cmd.index("--port") + 1] == "41002"
    cmd = r.command(trainer)
    config = Path(cmd[cmd.index("--config") + 1]).read_text()
    assert "dataflow: 127.0.0.1:41001" in config and "weights: 127.0.0.1:41002" in config
    raas = _Child("raas-0", "raas", args=["python", "-m", "astra.cli", "serve", "raas"])
    assert r.command(raas) == raas.args
    # the budget is per child; a RaaS is restarted only with on_raas_death: restart
    assert r.allowed(df)
    df.extra["restarts"] = 2
    assert not r.allowed(df) and r.allowed(ws)
    assert r.allowed(raas)
    sup.recipe = load_recipe(None, ["on_raas_death=continue"])
    assert not r.allowed(raas) and r.allowed(ws)
    sup.recipe = load_recipe(None, ["supervision.max_restarts=0"])
    assert not r.allowed(ws)
    assert not r.allowed(_Child("warmup-policy", "warmup"))


def test_resumed_trainer_runs_the_steps_left_from_its_checkpoint(tmp_path: Path) -> None:
    recipe = load_recipe(None, ["trainer.num_steps=30"])
    rd = RunDir(tmp_path / "run")
    step = rd.checkpoints("policy") / "step-00000012"
    step.mkdir(parents=True)
    (step / "trainer.json").write_text(json.dumps({"step": 12}))
    policy = recipe.policies[0]
    c = trainer_config(recipe, policy, rd, dataflow="a:1", weights="b:2", resume=True)
    assert c.num_steps == 18 and c.checkpoint.resume


def _fast_recipe(*more: str):
    return load_recipe(None, ["supervision.restart_backoff_s=0.05", "eval.every_steps=0", *more])


def _run_dir(tmp_path: Path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.config.mkdir(parents=True)
    return rd


def test_a_core_service_keeps_its_port_after_a_restart_that_failed(tmp_path: Path) -> None:
    """The WeightService dies; its first restart exits before serving (its address stays
    empty); the second comes back on the port of its first start."""
    rd = _run_dir(tmp_path)
    factory = fake_factory(tmp_path, {"weights": "serve,die,serve"})

    async def main() -> None:
        sup = Supervisor(_fast_recipe("supervision.max_restarts=3"), rd, child_factory=factory)
        ws = sup.add_child("weights", "weights", ["unused"])
        await sup.start_children([ws])
        try:
            os.kill(ws.pid, signal.SIGKILL)
            sup.restarts.start(ws, await ws.wait())  # what Supervisor._watch does
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and sup.failure is None:
                if len(factory.commands) == 3 and ws.address and not sup.restarts.pending:
                    break
                await asyncio.sleep(0.05)
            assert sup.failure is None, (sup.failure, sup.restarts.events)
            assert [e.get("error") for e in sup.restarts.events] == [
                "weights exited (3) before serving",
                None,
            ]
            ports = [c[c.index("--port") + 1] for _, c in factory.commands[1:]]
            assert ports == ["41002", "41002"] and ws.address == "127.0.0.1:41002"
        finally:
            await sup.restarts.close()
            await ws.stop(0)

    asyncio.run(main())


def test_dataflows_address_is_kept_when_the_weightservice_beside_it_fails_to_start(
    tmp_path: Path,
) -> None:
    """astra.run.starting.start_core starts the WeightService again alone when it cannot take
    its port back: Dataflow, which served, keeps the address its restarts come back on."""
    factory = fake_factory(tmp_path, {"dataflow": "serve", "weights": "die"}, {"dataflow": "41001"})

    async def main() -> None:
        sup = Supervisor(_fast_recipe(), _run_dir(tmp_path), child_factory=factory)
        df = sup.add_child("dataflow", "dataflow", ["unused"])
        ws = sup.add_child("weights", "weights", ["unused"])
        try:
            with pytest.raises(ChildFailed, match="weights exited"):
                await sup.start_children([df, ws])
            assert sup.addresses == {"dataflow": "127.0.0.1:41001"}
        finally:
            await df.stop(0)
            await ws.stop(0)

    asyncio.run(main())


def test_a_trainer_restarted_while_dataflow_restarts_is_given_dataflows_address(
    tmp_path: Path,
) -> None:
    """Dataflow and a trainer die together; the trainer's restart is computed while Dataflow's
    own is starting (its address empty): it gets the address Dataflow comes back on."""
    rd = _run_dir(tmp_path)
    rd.dataset.parent.mkdir(parents=True)
    rd.dataset.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    plans = {"dataflow": "serve,slow", "weights": "serve", "trainer": "serve"}
    ports = {"dataflow": "41001", "weights": "41002", "trainer": "41003"}
    factory = fake_factory(tmp_path, plans, ports)

    async def main() -> None:
        recipe = _fast_recipe()
        sup = Supervisor(recipe, rd, child_factory=factory)
        sup.dataset = rd.dataset
        df = sup.add_child("dataflow", "dataflow", ["unused"])
        ws = sup.add_child("weights", "weights", ["unused"])
        await sup.start_children([df, ws])
        tr = sup.add_child(f"trainer-{recipe.policies[0].id}", "trainer", ["unused"])
        await sup.start_children([tr])
        try:
            for c in (df, tr):
                os.kill(c.pid, signal.SIGKILL)
            for c in (df, tr):  # the order Supervisor._watch handles them in
                sup.restarts.start(c, await c.wait())
            deadline = time.monotonic() + 20
            while sup.restarts.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert sup.failure is None and not sup.restarts.pending, sup.restarts.events
            restarted = [c for name, c in factory.commands if name == tr.name][1:]
            assert len(restarted) == 1
            config = yaml.safe_load(
                Path(restarted[0][restarted[0].index("--config") + 1]).read_text()
            )
            assert config["dataflow"] == "127.0.0.1:41001"
            assert config["weights"] == "127.0.0.1:41002"
        finally:
            await sup.restarts.close()
            for c in (df, ws, tr):
                await c.stop(0)

    asyncio.run(main())


def _pid(run, name: str) -> int | None:
    return next((c["pid"] for c in run.children() if c["name"] == name and c["address"]), None)


def _restarted(run, name: str, old_pid: int, timeout_s: float) -> int:
    """Waits until `name` serves again as another process; its new pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = _pid(run, name)
        if pid is not None and pid != old_pid:
            return pid
        if run.proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{name} was not restarted: {run.output()}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_service_killed_in_turn_is_restarted_and_the_run_completes(runs) -> None:
    steps = 120
    run = runs(
        *("--set", f"trainer.num_steps={steps}", "--set", "trainer.checkpoint.every_steps=5"),
        *("--set", "supervision.restart_backoff_s=0.2"),
        *("--set", "supervision.progress_warn_s=20"),  # a hang says why in the output
    )
    run.wait_for_children({"dataflow", "weights", "raas", "trainer"}, 120)
    killed = []
    for name in ("weights", "dataflow", "trainer-policy", "raas-0"):
        pid = _pid(run, name)
        assert pid is not None, run.output()
        time.sleep(1.5)  # let it work a little first
        # The last kill: the trainer is held (SIGSTOP) until raas-0 serves again, or its
        # remaining steps could end the run first under load (as they did in the Ray test).
        with held(_pid(run, "trainer-policy") if name == "raas-0" else None):
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
            _restarted(run, name, pid, 90)
    assert run.wait(240) == 0, run.output()
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == steps, s
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0, s
    assert [e["child"] for e in s["restarts"]] == [
        "weights",
        "dataflow",
        "trainer-policy",
        "raas-0",
    ]
    assert all(e["exit"] == -signal.SIGKILL and "serving_after_s" in e for e in s["restarts"])
    assert s["versions_published"] >= steps
    # versions never go back: each step's version is above the one of the step before it
    rows = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    final: dict[int, int] = {}
    for row in rows:  # a step run again after the trainer's restart replaces the first run of it
        final[row["step"]] = row["version"]
    assert sorted(final) == list(range(1, steps + 1))
    versions = [final[k] for k in sorted(final)]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    supervisor_log = (run.run_dir / "logs" / "supervisor.log").read_text()
    assert supervisor_log.count("restart 1 of 3") == 4
    assert all(gone(pid) for pid in killed)
    assert all(gone(c["pid"]) for c in run.children())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trainer_stopped_by_a_sigterm_from_outside_is_restarted_not_taken_as_finished(
    runs,
) -> None:
    # A trainer exits 0 on SIGTERM (as every server); the supervisor read any exit 0 as
    # "finished its steps" and the run went on without a trainer. Its checkpoints decide.
    steps = 60
    run = runs(
        *("--set", f"trainer.num_steps={steps}", "--set", "trainer.checkpoint.every_steps=5"),
        *("--set", "supervision.restart_backoff_s=0.2"),
        *("--set", "supervision.progress_warn_s=20"),  # a hang says why in the output
    )
    run.wait_for_children({"dataflow", "weights", "raas", "trainer"}, 120)
    pid = _pid(run, "trainer-policy")
    assert pid is not None, run.output()
    time.sleep(1.5)
    os.kill(pid, signal.SIGTERM)  # the trainer only, as an operator or a node agent would
    _restarted(run, "trainer-policy", pid, 90)
    assert run.wait(240) == 0, run.output()
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == steps, s
    assert [(e["child"], e["exit"]) for e in s["restarts"]] == [("trainer-policy", 0)]


@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [0])
def test_without_restarts_a_dead_core_service_stops_the_run(runs, max_restarts) -> None:
    run = runs(
        "--set", "trainer.num_steps=100000", "--set", f"supervision.max_restarts={max_restarts}"
    )
    run.wait_for_children({"dataflow", "weights", "raas", "trainer"}, 120)
    os.killpg(_pid(run, "weights"), signal.SIGKILL)
    assert run.wait(90) == 1, run.output()
    s = run.summary()
    assert s["status"].startswith("failed: weights exited with -9") and s["restarts"] == []
