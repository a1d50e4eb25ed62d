"""Elastic and heterogeneous RaaS in `astra run`: the `elastic:` recipe section and its checks,
label routing in Dataflow's pool, the control-file protocol of `astra raas add|remove`, and two
real runs: RaaS joining and leaving by schedule and by hand (nothing lost or duplicated), and
RaaS of different capacities and labels."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from astra.dataflow.config import PoolSettings
from astra.dataflow.pool import Pool
from astra.run import control
from astra.run.children import stop_all
from astra.run.elastic import RESTORED, Elastic, ElasticError, hand_added
from astra.run.layout import RunDir
from astra.run.recipe import RaasSpec, RecipeError, load_recipe
from astra.run.supervisor import Supervisor
from tests.test_run import Run, gone
from tests.test_run_children import fake_factory

RECIPES = Path(__file__).resolve().parent.parent / "configs" / "recipes"
FAST = ["--set", "warmup.steps=0", "--set", "dataset.size=64"]
FAST += ["--set", "observe.baseline_samples=8", "--set", "supervision.stop_grace_s=10"]
FAST += ["--set", "eval.every_steps=0"]  # routing and work counts of the training streams only


# ----- the recipe section ------------------------------------------------------------------


def test_shipped_elastic_and_heterogeneous_recipes_load() -> None:
    r = load_recipe(RECIPES / "elastic.yaml")
    assert [(e.at_step, e.add.name if e.add else None, e.remove) for e in r.elastic] == [
        (20, "raas-2", None),
        (40, None, "raas-0"),
        (60, "raas-3", None),
    ]
    h = load_recipe(RECIPES / "heterogeneous.yaml")
    assert [(x.name, x.capacity, x.labels["hardware"]) for x in h.raas] == [
        ("small-a", 4, "small"),
        ("large-a", 16, "large"),
        ("large-b", 32, "large"),
    ]
    large = next(s for s in h.streams if s.name == "large")
    assert [x.name for x in h.raas if h.serves(x, large)] == ["large-a", "large-b"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["elastic=[{at_step: 0, remove: raas-0}]"], "elastic.0.at_step: Input should be greater"),
        (["elastic=[{at_step: 400, remove: raas-0}]"], "elastic.0.at_step: 400 is beyond"),
        (["elastic=[{at_s: -1, remove: raas-0}]"], "elastic.0.at_s: Input should be greater"),
        (["elastic=[{remove: raas-0}]"], "elastic.0: Value error, give exactly one of at_step"),
        (["elastic=[{at_step: 1, at_s: 2, remove: raas-0}]"], "exactly one of at_step and at_s"),
        (["elastic=[{at_step: 1}]"], "elastic.0: Value error, give exactly one of add and remove"),
        (["elastic=[{at_step: 1, add: {capacity: 2}}]"], "add.name is required"),
        (["elastic=[{at_step: 1, add: {name: x, colour: red}}]"], "elastic.0.add.colour: Extra"),
        (["elastic=[{at_step: 1, remove: raas-9}]"], "elastic.0.remove: no RaaS 'raas-9'"),
        (
            ["elastic=[{at_step: 1, add: {name: raas-1}}]"],
            "elastic.0.add.name: RaaS 'raas-1' is already running",
        ),
        (["elastic=[{at_step: 1, add: {name: dataflow}}]"], "'dataflow' is another child's"),
        (
            ["elastic=[{at_step: 1, add: {name: x, policies: [nope]}}]"],
            "elastic.0.add.policies: unknown policies ['nope']",
        ),
        (
            ["elastic=[{at_step: 1, remove: raas-0}, {at_step: 2, remove: raas-1}]"],
            "elastic.1.remove: it would leave no RaaS",
        ),
        (
            ["elastic=[{at_step: 1, remove: raas-0}, {at_step: 2, remove: raas-0}]"],
            "elastic.1.remove: no RaaS 'raas-0' is running then (running: raas-1)",
        ),
        (
            ["elastic=[{at_step: 5, add: {name: x}}, {at_step: 2, remove: raas-0}]"],
            "elastic.1.at_step: 2 is before elastic.0.at_step 5",
        ),
        (
            [
                "streams.0.raas_labels={gpu: h200}",
                "raas.0.labels={gpu: h200}",
                "elastic=[{at_step: 1, remove: raas-0}]",
            ],
            "elastic.0: after it no RaaS serves streams.main",
        ),
        (["streams.0.raas_labels={gpu: h200}"], "streams.main: no RaaS serves"),
        (["raas.0.name=weights"], "raas: names ['weights'] are the run's other children's"),
    ],
)
def test_bad_elastic_sections_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(RecipeError, match="invalid recipe") as info:
        load_recipe(None, overrides)
    assert message in str(info.value)


def test_elastic_events_may_remove_what_an_earlier_one_added() -> None:
    r = load_recipe(
        None,
        [
            "elastic=[{at_step: 2, add: {name: big, capacity: 64, labels: {hw: large}}}, "
            "{at_s: 1.5, remove: raas-0}, {at_step: 3, remove: big}]",
        ],
    )
    assert [e.trigger for e in r.elastic] == ["step 2", "1.5s", "step 3"]


# ----- label routing in Dataflow's pool ------------------------------------------------------


def test_pool_routes_by_free_slots_among_instances_with_the_labels() -> None:
    pool = Pool(PoolSettings(), connect=lambda address: object())  # type: ignore[arg-type,return-value]
    for name, capacity, labels in [
        ("small", 4, {"hardware": "small", "region": "a"}),
        ("large-a", 16, {"hardware": "large", "region": "a"}),
        ("large-b", 32, {"hardware": "large", "region": "b"}),
    ]:
        pool.register(name, f"{name}:1", capacity, ["p"], ["w"], labels, {})
    assert pool.pick("w", ["p"], 4).instance_id == "large-b"  # most free slots
    assert pool.pick("w", ["p"], 4, labels={"region": "a"}).instance_id == "large-a"
    assert pool.pick("w", ["p"], 4, labels={"hardware": "small"}).instance_id == "small"
    assert pool.pick("w", ["p"], 8, labels={"hardware": "small"}) is None  # too few slots
    assert pool.pick("w", ["p"], 4, labels={"hardware": "tpu"}) is None
    pool.instances["large-b"].free_slots = 0
    assert pool.pick("w", ["p"], 4, labels={"hardware": "large"}).instance_id == "large-a"


# ----- the control files -----------------------------------------------------------------------


def _fake_run(tmp_path: Path, state: str, pid: int | None = None) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    rd.recipe.write_text("name: x\n")
    entry = {"pid": os.getpid() if pid is None else pid, "state": state}
    rd.run_json.write_text(json.dumps({"supervisor": entry, "children": []}))
    return rd


def test_control_refuses_a_run_that_is_not_running(tmp_path: Path) -> None:
    with pytest.raises(control.ControlError, match="not a run directory"):
        control.submit(RunDir(tmp_path), {"action": "remove", "name": "x"}, 1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rd = _fake_run(tmp_path, "running", dead.pid)
    with pytest.raises(control.ControlError, match="is not running \\(no live supervisor\\)"):
        control.submit(rd, {"action": "remove", "name": "x"}, 1)
    rd.run_json.write_text(json.dumps({"supervisor": {"pid": os.getpid(), "state": "starting"}}))
    with pytest.raises(control.ControlError, match="still starting"):
        control.submit(rd, {"action": "remove", "name": "x"}, 1)
    rd.run_json.write_text(json.dumps({"supervisor": {"pid": os.getpid(), "state": "ended"}}))
    with pytest.raises(control.ControlError, match="not running \\(state 'ended'\\)"):
        control.submit(rd, {"action": "remove", "name": "x"}, 1)


def test_control_request_is_answered_or_withdrawn(tmp_path: Path) -> None:
    rd = _fake_run(tmp_path, "running")
    with pytest.raises(control.ControlError, match="did not take the request within 1s"):
        control.submit(rd, {"action": "remove", "name": "x"}, 1.0)
    assert control.take_requests(rd) == []  # withdrawn: nothing left to act on

    def supervisor() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for req in control.take_requests(rd):
                control.answer(rd, req["id"], {"ok": True, "echo": req["name"]})
                return
            time.sleep(0.05)

    thread = threading.Thread(target=supervisor)
    thread.start()
    answer = control.submit(rd, {"action": "remove", "name": "raas-7"}, 5.0)
    thread.join()
    assert answer == {"ok": True, "echo": "raas-7"}
    assert not list((rd.control / "answers").iterdir())  # the CLI deleted it


def test_raas_cli_usage_errors(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "astra.cli", "raas", "add", "--run-dir", str(tmp_path)]
    bad = subprocess.run([*cmd, "--label", "novalue"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr
    missing = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "not a run directory" in missing.stderr


def test_raas_add_command_is_split_as_a_shell_would_and_validated_by_the_spec(
    monkeypatch, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from astra.run import raas_cli

    sent: list[dict] = []
    monkeypatch.setattr(raas_cli, "_request", lambda run_dir, req, timeout_s: sent.append(req))
    args = ["add", "--run-dir", str(tmp_path), "--name", "js", "--command"]
    line = "node tools/raas-node/raas.js --dataflow {dataflow} --instance-id '{instance_id}'"
    ok = CliRunner().invoke(raas_cli.raas, [*args, line])
    assert ok.exit_code == 0, ok.output
    command = sent[0]["spec"]["command"]
    assert command[-4:] == ["--dataflow", "{dataflow}", "--instance-id", "{instance_id}"]
    assert RaasSpec.model_validate(sent[0]["spec"]).command == command  # what the run checks
    for bad in ("node 'unclosed", ""):
        refused = CliRunner().invoke(raas_cli.raas, [*args, bad])
        assert refused.exit_code == 2 and "--command" in refused.output
    assert len(sent) == 1


# ----- real runs ---------------------------------------------------------------------------------


def raas_cli(run: Run, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "astra.cli", "raas", *args, "--run-dir", str(run.run_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150)


def run_json(run: Run) -> dict:
    path = run.run_dir / "run.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def steps(run: Run) -> int:
    path = run.run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def wait_until(run: Run, what: str, check, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert run.proc.poll() is None, f"run ended while waiting for {what}: {run.output()}"
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {run.output()}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_raas_join_and_leave_by_schedule_and_by_hand(runs) -> None:
    schedule = "[{at_step: 2, add: {name: raas-2, capacity: 8, labels: {joined: schedule}}}, "
    schedule += "{at_step: 4, remove: raas-0}]"
    run = runs(
        str(RECIPES / "elastic.yaml"),
        *FAST,
        *("--set", "trainer.num_steps=100000", "--set", f"elastic={schedule}"),
    )
    running = lambda: run_json(run).get("supervisor", {}).get("state") == "running"  # noqa: E731
    wait_until(run, "state running", running, 120)

    added = raas_cli(run, "add", "--name", "hand", "--capacity", "8", "--label", "by=hand")
    assert added.returncode == 0, added.stderr
    entry = json.loads(added.stdout)
    assert entry["name"] == "hand" and entry["pid"] and entry["joined"] == "cli"
    assert entry["capacity"] == 8 and entry["labels"] == {"by": "hand"}
    taken = raas_cli(run, "add", "--name", "hand")
    assert taken.returncode == 1 and "name taken: RaaS 'hand' is running" in taken.stderr
    unknown = raas_cli(run, "remove", "nope")
    assert unknown.returncode == 1 and "unknown RaaS 'nope' (running: " in unknown.stderr

    def scheduled_done() -> bool:
        return len([e for e in run_json(run)["elastic"] if e["source"] != "cli"]) == 2

    wait_until(run, "the schedule", scheduled_done, 90)
    at = steps(run)
    wait_until(run, "3 steps with hand", lambda: steps(run) >= at + 3, 60)
    removed = raas_cli(run, "remove", "hand")
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout)["removed"] == "cli"
    at = steps(run)
    wait_until(run, "3 steps after the removals", lambda: steps(run) >= at + 3, 60)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(90) == 128 + signal.SIGTERM, run.output()

    s = run.summary()
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0, s
    assert s["steps"] >= 6 and s["groups_trained"] > 0
    raas = s["raas"]
    assert raas["raas-2"]["joined"] == "schedule: elastic.0 at step 2"
    assert raas["raas-2"]["work"]["groups_finished"] > 0  # the RaaS that joined did work
    assert raas["raas-2"]["labels"] == {"joined": "schedule"} and raas["raas-2"]["capacity"] == 8
    assert raas["raas-0"]["removed"] == "schedule: elastic.1 at step 4"
    assert raas["hand"]["joined"] == "cli" and raas["hand"]["removed"] == "cli"
    assert sorted((e["action"], e["name"]) for e in s["elastic"]) == [
        ("add", "hand"),
        ("add", "raas-2"),
        ("remove", "hand"),
        ("remove", "raas-0"),
    ]
    assert not any("error" in e for e in s["elastic"])

    final = run_json(run)
    assert final["supervisor"]["state"] == "ended"
    assert {c["name"] for c in final["children"] if c["role"] == "raas"} == {"raas-1", "raas-2"}
    assert {r["name"] for r in final["removed"]} == {"raas-0", "hand"}
    assert all(r["returncode"] == 0 for r in final["removed"])  # stopped cleanly, drained
    pids = [c["pid"] for c in final["children"] + final["removed"] if c["pid"]]
    assert all(gone(pid) for pid in pids)
    log = (run.run_dir / "logs" / "supervisor.log").read_text()
    assert "RaaS raas-0 removed (schedule: elastic.1 at step 4)" in log
    assert "exited with" not in log  # a removal is no death
    ended = raas_cli(run, "remove", "raas-1")
    assert ended.returncode == 1 and "is not running" in ended.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_heterogeneous_recipe_routes_by_capacity_and_shows_labels(runs) -> None:
    evals = ["eval.every_steps=2", "eval.size=8", "eval.streams=[main, large]"]
    run = runs(
        str(RECIPES / "heterogeneous.yaml"),
        *FAST,
        "--set",
        # 10 steps, not 4: the RaaS and the trainer start together, so the first RaaS up may
        # take the first groups alone; over 10 steps routing by free slots decides the shares.
        "trainer.num_steps=10",
        *(arg for e in evals for arg in ("--set", e)),
    )
    children = run.wait_for_children({"dataflow", "raas"}, 120)
    dataflow = next(c["address"] for c in children if c["role"] == "dataflow")
    cmd = [sys.executable, "-m", "astra.cli", "status", "--dataflow", dataflow]
    deadline, instances = time.monotonic() + 60, []
    while time.monotonic() < deadline and len(instances) < 3:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        instances = json.loads(out.stdout)["instances"] if out.returncode == 0 else []
    shown = {i["instance_id"]: (int(i["capacity"]), i["labels"]) for i in instances}
    assert shown == {
        "small-a": (4, {"hardware": "small", "region": "a"}),
        "large-a": (16, {"hardware": "large", "region": "a"}),
        "large-b": (32, {"hardware": "large", "region": "b"}),
    }
    assert run.wait(150) == 0, run.output()
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == 10
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    work = {name: r["work"]["groups_finished"] for name, r in s["raas"].items()}
    assert work["large-b"] > 0 and work["large-b"] >= work["small-a"], work
    assert s["raas"]["small-a"]["labels"] == {"hardware": "small", "region": "a"}
    # Each stream evaluated, as eval-<stream> (its workflow, policies and routing).
    rows = [json.loads(x) for x in (run.run_dir / "evals.jsonl").read_text().splitlines()]
    done = sorted((r["stream"], r["version"]) for r in rows)
    assert done == [(f"eval-{n}", v) for n in ("large", "main") for v in (0, 2, 4, 6, 8, 10)], done
    assert all(r["samples"] + r["failed_samples"] == 8 for r in rows)  # 8 problems, 1 each
    assert sorted(s["eval"]["streams"]) == ["eval-large", "eval-main"]
    assert s["eval"]["stream"] == "eval-main"


def test_hand_added_raas_are_those_added_by_hand_and_not_removed_since() -> None:
    spec = {"name": "h", "capacity": 4}
    events = [
        {"action": "add", "name": "h", "source": "cli", "spec": spec},
        {"action": "add", "name": "g", "source": "cli", "spec": {"name": "g"}},
        {"action": "add", "name": "x", "source": "cli", "error": "did not start"},
        {"action": "add", "name": "raas-2", "source": "schedule: elastic.0 at step 2", "spec": {}},
        {"action": "remove", "name": "g", "source": "cli"},
        {"action": "add", "name": "k", "source": RESTORED, "spec": {"name": "k"}},
    ]
    assert hand_added(events) == {"h": spec, "k": {"name": "k"}}
    assert hand_added([]) == {}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_raas_added_by_hand_comes_back_on_resume(runs) -> None:
    run = runs(
        *FAST, "--set", "trainer.num_steps=100000", "--set", "trainer.checkpoint.every_steps=2"
    )
    running = lambda: run_json(run).get("supervisor", {}).get("state") == "running"  # noqa: E731
    wait_until(run, "state running", running, 120)
    added = raas_cli(run, "add", "--name", "hand", "--capacity", "4", "--label", "by=hand")
    assert added.returncode == 0, added.stderr
    ckpts = run.run_dir / "checkpoints" / "policy"
    wait_until(run, "a checkpoint", lambda: bool(list(ckpts.glob("step-*"))), 90)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(90) == 128 + signal.SIGTERM, run.output()
    done = int(sorted(ckpts.glob("step-*"))[-1].name.removeprefix("step-"))

    cmd = [sys.executable, "-m", "astra.run", "--resume", str(run.run_dir)]
    resumed = subprocess.run(
        [*cmd, "--set", f"trainer.num_steps={done + 2}"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    final = run_json(run)
    (hand,) = [c for c in final["children"] if c["name"] == "hand"]
    assert hand["joined"] == RESTORED and hand["labels"] == {"by": "hand"} and hand["capacity"] == 4
    assert [e["source"] for e in final["elastic"]] == ["cli", RESTORED]
    s = run.summary()
    assert s["status"] == "completed" and s["groups_lost"] == 0 and s["groups_duplicated"] == 0


# ----- removals and additions while a RaaS restarts (fake children) ---------------------------


def _supervisor(tmp_path: Path, plans: dict[str, str], backoff_s: float):
    recipe = load_recipe(
        None,
        [
            f"supervision.restart_backoff_s={backoff_s}",
            "on_raas_death=restart",
            "eval.every_steps=0",
            "supervision.stop_grace_s=1",
        ],
    )
    rd = RunDir(tmp_path / "run")
    rd.config.mkdir(parents=True)
    factory = fake_factory(tmp_path, plans)
    return Supervisor(recipe, rd, child_factory=factory), factory


def _running(factory, name: str) -> list[int]:
    return [p.pid for n, p in factory.spawned if n == name and p.returncode is None]


def test_a_raas_removed_while_its_restart_starts_stays_removed(tmp_path: Path) -> None:
    """raas-0 crashes; while its restart starts, `astra raas remove raas-0`: the restart is
    cancelled (or, failing on the stop, ends there) and no raas-0 runs again, unowned."""
    sup, factory = _supervisor(tmp_path, {"raas-0": "serve,slow,serve", "raas": "serve"}, 0.05)

    async def main() -> None:
        r0 = sup.add_child("raas-0", "raas", ["unused"])
        r1 = sup.add_child("raas-1", "raas", ["unused"])
        await sup.start_children([r0, r1])
        try:
            os.kill(r0.pid, signal.SIGKILL)
            sup.restarts.start(r0, await r0.wait())
            while sum(n == "raas-0" for n, _ in factory.spawned) < 2:  # its restart starts
                await asyncio.sleep(0.02)
            await Elastic(sup).remove("raas-0", "cli")
            await asyncio.sleep(1.5)  # the slow start would have served by now
            assert [c.name for c in sup.children["raas"]] == ["raas-1"]
            assert _running(factory, "raas-0") == []
            assert sum(n == "raas-0" for n, _ in factory.spawned) == 2, sup.restarts.events
            assert r0.retired and not sup.restarts.restarting(r0)
        finally:
            await sup.restarts.close()
            await stop_all([sup.children["raas"]], 1.0)
            for pid in _running(factory, "raas-0"):
                os.killpg(pid, signal.SIGKILL)

    asyncio.run(main())


@pytest.mark.slow
def test_a_raas_name_is_not_taken_while_its_restart_is_pending(tmp_path: Path) -> None:
    """`astra raas add raas-0` while raas-0 waits out its restart's backoff is refused (two
    processes would run as one instance); once raas-0 is removed, its restart goes with it and
    the name is free."""
    sup, factory = _supervisor(tmp_path, {"dataflow": "serve", "raas": "serve"}, 0.5)

    async def main() -> None:
        df = sup.add_child("dataflow", "dataflow", ["unused"])
        r0 = sup.add_child("raas-0", "raas", ["unused"])
        r1 = sup.add_child("raas-1", "raas", ["unused"])
        await sup.start_children([df, r0, r1])
        elastic = Elastic(sup)
        try:
            os.kill(r0.pid, signal.SIGKILL)
            sup.restarts.start(r0, await r0.wait())  # back in 0.5 s
            with pytest.raises(ElasticError, match="'raas-0' is restarting"):
                await elastic.add(RaasSpec(name="raas-0"), "raas-0", "cli")
            while sup.restarts.restarting(r0):
                await asyncio.sleep(0.05)
            assert len(_running(factory, "raas-0")) == 1 and r0.returncode is None

            os.kill(r0.pid, signal.SIGKILL)  # again: back in 1 s, removed before
            sup.restarts.start(r0, await r0.wait())
            await elastic.remove("raas-0", "cli")
            assert not sup.restarts.pending
            await elastic.add(RaasSpec(name="raas-0"), "raas-0", "cli")
            await asyncio.sleep(1.5)
            assert len(_running(factory, "raas-0")) == 1
            (new,) = [c for c in sup.children["raas"] if c.name == "raas-0"]
            assert new is not r0 and new.returncode is None
        finally:
            await sup.restarts.close()
            await stop_all([sup.children["raas"], sup.children["core"]], 1.0)
            for pid in _running(factory, "raas-0"):
                os.killpg(pid, signal.SIGKILL)

    asyncio.run(main())
