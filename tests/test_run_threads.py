"""astra.run.threads: the trainer and each torch-engine RaaS on the CPU get their share of the
cores as OMP_NUM_THREADS, a RaaS that launches vLLM on the CPU its own cores as
VLLM_CPU_OMP_THREADS_BIND; a value set by the user wins; every other child is left alone."""

from __future__ import annotations

from pathlib import Path

from astra.run import threads
from astra.run.children import Child
from astra.run.layout import RunDir
from astra.run.recipe import RaasSpec, load_recipe
from astra.run.supervisor import Supervisor


def test_default_recipe_shares_the_cores_among_trainer_and_two_raas() -> None:
    recipe = load_recipe(None, [])  # one policy (one trainer), two torch RaaS, all on the CPU
    assert threads.cpu_processes(recipe) == 3
    assert threads.share(recipe, n_cores=2) == 1  # never 0
    assert threads.share(recipe, n_cores=16) == 5
    raas = recipe.raas[0]
    env = threads.child_env(recipe, "raas", raas, environ={}, n_cores=12)
    assert env["OMP_NUM_THREADS"] == "4"
    assert threads.child_env(recipe, "trainer", environ={}, n_cores=12)["OMP_NUM_THREADS"] == "4"
    for role in ("dataflow", "weights", "warmup"):
        assert "OMP_NUM_THREADS" not in threads.child_env(recipe, role, environ={}, n_cores=12)


def test_a_value_the_user_set_wins() -> None:
    recipe = load_recipe(None, ["env.OMP_NUM_THREADS='3'", "env.FOO='bar'"])
    env = threads.child_env(recipe, "trainer", environ={}, n_cores=64)
    assert env == {"OMP_NUM_THREADS": "3", "FOO": "bar"}
    plain = load_recipe(None, ["env.FOO='bar'"])
    outer = {"OMP_NUM_THREADS": "7"}  # the supervisor's own environment: inherited as it is
    assert threads.child_env(plain, "trainer", environ=outer, n_cores=64) == {"FOO": "bar"}


def test_only_cpu_compute_counts() -> None:
    gpu = ["trainer.device=cuda", "raas.1.device=cuda"]
    recipe = load_recipe(None, ["raas.0.engine=vllm", "raas.0.device=cuda", *gpu])
    assert threads.cpu_processes(recipe) == 0
    for role, spec in (("trainer", None), ("raas", recipe.raas[0]), ("raas", recipe.raas[1])):
        env = threads.child_env(recipe, role, spec, environ={})
        assert "OMP_NUM_THREADS" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    one_cpu_raas = load_recipe(None, ["raas.0.engine=openai", "trainer.device=cuda"])
    assert threads.cpu_processes(one_cpu_raas) == 1  # the torch RaaS; an HTTP engine is elsewhere
    assert threads.share(one_cpu_raas, n_cores=8) == 8


def test_vllm_on_the_cpu_gets_its_own_cores_and_the_trainer_the_rest() -> None:
    # The vllm_cpu recipe: one trainer, one RaaS launching vLLM on the CPU.
    recipe = load_recipe(Path("configs/recipes/vllm_cpu.yaml"), [])
    assert threads.cpu_processes(recipe) == 2
    vllm = recipe.raas[0]
    # One core each: vLLM's worker runs in its engine-core process, on one thread.
    assert threads.child_env(recipe, "raas", vllm, environ={}, n_cores=2) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
    }
    assert threads.child_env(recipe, "trainer", environ={}, n_cores=2)["OMP_NUM_THREADS"] == "1"
    assert threads.child_env(recipe, "raas", vllm, environ={}, n_cores=16) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3,4,5,6,7"
    }
    assert threads.child_env(recipe, "trainer", environ={}, n_cores=16)["OMP_NUM_THREADS"] == "8"
    # Two vLLM RaaS and one torch RaaS beside the trainer: disjoint slices, tensor parallel
    # ranks one list each.
    args = ["raas.0.engine=vllm", "raas.1.engine=vllm", "raas.1.engine_args='-tp 2'"]
    two = load_recipe(None, args)
    two = two.model_copy(update={"raas": [*two.raas, RaasSpec(name="torch-raas")]})
    assert threads.cpu_processes(two) == 4
    first = threads.child_env(two, "raas", two.raas[0], environ={}, n_cores=16)
    second = threads.child_env(two, "raas", two.raas[1], environ={}, n_cores=16)
    assert first["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2,3"
    assert second["VLLM_CPU_OMP_THREADS_BIND"] == "4,5|6,7"
    assert "OMP_NUM_THREADS" not in first
    assert threads.child_env(two, "raas", two.raas[2], environ={}, n_cores=16) == {
        "OMP_NUM_THREADS": "4"
    }
    # The user's binding wins, from the recipe's env: or from the supervisor's environment.
    told = load_recipe(
        Path("configs/recipes/vllm_cpu.yaml"), ["env.VLLM_CPU_OMP_THREADS_BIND=auto"]
    )
    assert (
        threads.child_env(told, "raas", told.raas[0], environ={}, n_cores=2)[
            "VLLM_CPU_OMP_THREADS_BIND"
        ]
        == "auto"
    )
    outer = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in threads.child_env(
        recipe, "raas", vllm, environ=outer, n_cores=2
    )


def test_vllm_with_one_core_runs_its_worker_in_the_engine_core_process_unless_told() -> None:
    recipe = load_recipe(Path("configs/recipes/vllm_cpu.yaml"), [])
    in_core = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}

    def env(r, **kw):
        return threads.child_env(r, "raas", r.raas[0], environ=kw.get("outer", {}), n_cores=2)

    assert env(recipe).items() >= in_core.items()
    # More than a core each: vLLM's own worker process, bound to its cores.
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in threads.child_env(
        recipe, "raas", recipe.raas[0], environ={}, n_cores=4
    )
    # Several ranks, or an executor the user names: vLLM decides.
    for args in ("-tp 2", "--pipeline-parallel-size=2", "--data-parallel-size 2",
                 "--distributed-executor-backend mp"):  # fmt: skip
        told = load_recipe(Path("configs/recipes/vllm_cpu.yaml"), [f"raas.0.engine_args='{args}'"])
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env(told), args
    # The user's value wins, from the recipe's env: or the supervisor's; so does their
    # OMP_NUM_THREADS.
    mp = load_recipe(
        Path("configs/recipes/vllm_cpu.yaml"), ["env.VLLM_ENABLE_V1_MULTIPROCESSING='1'"]
    )
    assert env(mp)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and "OMP_NUM_THREADS" not in env(mp)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env(
        recipe, outer={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    )
    omp = load_recipe(Path("configs/recipes/vllm_cpu.yaml"), ["env.OMP_NUM_THREADS='2'"])
    assert env(omp)["OMP_NUM_THREADS"] == "2" and env(omp)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_the_supervisor_gives_each_child_its_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 6)
    recipe = load_recipe(None, ["env.FOO='bar'"])
    rd = RunDir(tmp_path / "run")
    sup = Supervisor(recipe, rd, child_factory=Child)  # built, never spawned
    trainer = sup.add_child("trainer-policy", "trainer", ["unused"], ["policy"])
    raas = sup.add_child("raas-0", "raas", ["unused"], spec=recipe.raas[0])
    dataflow = sup.add_child("dataflow", "dataflow", ["unused"])
    assert trainer.env == raas.env == {"FOO": "bar", "OMP_NUM_THREADS": "2"}
    assert dataflow.env == {"FOO": "bar"}


def test_the_supervisor_gives_a_vllm_raas_its_cores_from_the_affinity_mask(tmp_path, monkeypatch):
    for var in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(threads, "core_ids", lambda: [4, 5, 6, 7])  # a process pinned to 4-7
    recipe = load_recipe(Path("configs/recipes/vllm_cpu.yaml"), [])
    sup = Supervisor(recipe, RunDir(tmp_path / "run"), child_factory=Child)  # never spawned
    vllm = sup.add_child("vllm-0", "raas", ["unused"], spec=recipe.raas[0])
    trainer = sup.add_child("trainer-policy", "trainer", ["unused"], ["policy"])
    assert vllm.env == {"VLLM_CPU_OMP_THREADS_BIND": "4,5"}  # two cores: its own worker process
    assert trainer.env == {"OMP_NUM_THREADS": "2"}
