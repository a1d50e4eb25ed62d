"""CPU threads of a run's torch processes: each gets its share of the cores, unless told.

torch sizes its intra-op thread pool to every core of the machine. An `astra run` on one CPU
machine starts several processes that compute with torch (the trainer of each policy, each
RaaS with the built-in torch engine): left alone, each would run as many threads as there are
cores, so n processes keep n times the cores' worth of threads busy-waiting on each other. On
the small operations of a small model that costs more than the threads give: on the 2-core
machine of BENCHMARKS.md one trainer step of the embedded task took ~600 ms instead of ~70 ms.

`child_env` gives a trainer or torch-engine RaaS on the CPU `OMP_NUM_THREADS` = the cores this
process may run on divided by the number of the recipe's CPU compute processes (at least 1),
unless OMP_NUM_THREADS is set already (in the recipe's `env:` or the supervisor's environment):
then that wins. A RaaS that launches vLLM on the CPU is one of those processes too: vLLM binds
its worker's threads to cores (by default every core but one, spinning between its steps), so
left alone it takes the cores the trainer computes on; on the 2-core machine of BENCHMARKS.md a
step of the embedded task on vLLM took ~560 ms instead of ~230 ms. Such a RaaS gets
`VLLM_CPU_OMP_THREADS_BIND` = its own slice of the cores (a share, from the first core this
process may run on), unless VLLM_CPU_OMP_THREADS_BIND is set already. Where that share is one
core and vLLM runs one rank (no tensor, pipeline or data parallelism, no executor backend
named in engine_args), its worker runs inside vLLM's engine-core process instead of a process of
its own (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `OMP_NUM_THREADS=1`, unless either is set): the
worker process spins on `sched_yield` between steps waiting for the engine core's next message
(a quarter of its samples), and on one core that spinning takes CPU from everything else; in
the engine-core process a sequence costs the server about half the CPU (BENCHMARKS.md, "vLLM on
a CPU core: the worker in the engine-core process"). Other children
(Dataflow, the WeightService, an external RaaS, anything on a GPU) get the recipe's `env:`
unchanged. A RaaS added during the run (`elastic:`, `astra raas add`) gets the share computed
at the start.
Never starts, stops or inspects a process: it only computes environments.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

from astra.run.recipe import RaasSpec, Recipe

THREADS_VAR = "OMP_NUM_THREADS"
VLLM_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
VLLM_MP_VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"


def core_ids() -> list[int]:
    """The CPUs this process may run on, in order (its affinity mask where the OS has one)."""
    try:
        return sorted(os.sched_getaffinity(0)) or [0]
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cores() -> int:
    """How many CPUs this process may run on."""
    return len(core_ids())


def computes_on_cpu(recipe: Recipe, role: str, spec: RaasSpec | None = None) -> bool:
    """Whether a child of `role` (with its RaaS `spec`) runs torch compute on the CPU."""
    if role == "trainer":
        return recipe.trainer.device == "cpu"
    if role == "raas" and spec is not None:
        return spec.engine == "torch" and spec.device == "cpu" and not spec.command
    return False


def binds_cpu_cores(spec: RaasSpec | None) -> bool:
    """Whether a RaaS launches vLLM on the CPU (which binds its threads to cores)."""
    return spec is not None and spec.engine == "vllm" and spec.device == "cpu" and not spec.command


def cpu_processes(recipe: Recipe) -> int:
    """How many of the recipe's children compute on the CPU: trainers, torch-engine RaaS and
    RaaS that launch vLLM there."""
    trainers = len(recipe.policies) if computes_on_cpu(recipe, "trainer") else 0
    return trainers + sum(
        computes_on_cpu(recipe, "raas", spec) or binds_cpu_cores(spec) for spec in recipe.raas
    )


def share(recipe: Recipe, n_cores: int | None = None) -> int:
    """Threads (cores) for each CPU compute process: the cores over those processes, at least 1."""
    n = cpu_processes(recipe)
    available = n_cores if n_cores is not None else cores()
    return max(1, available // max(n, 1))


def child_env(
    recipe: Recipe,
    role: str,
    spec: RaasSpec | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    n_cores: int | None = None,
) -> dict[str, str]:
    """The environment a child adds to the supervisor's: the recipe's `env:`, plus its
    thread share where it computes with torch on the CPU and nobody set OMP_NUM_THREADS, or
    its cores where it launches vLLM on the CPU and nobody set VLLM_CPU_OMP_THREADS_BIND."""
    env = dict(recipe.env)
    outer = os.environ if environ is None else environ
    if role == "raas" and binds_cpu_cores(spec):
        if VLLM_BIND_VAR not in env and VLLM_BIND_VAR not in outer:
            env[VLLM_BIND_VAR] = vllm_cores(recipe, spec, n_cores)
        told = VLLM_MP_VAR in env or VLLM_MP_VAR in outer
        if not told and worker_in_engine_process(recipe, spec, n_cores):
            env[VLLM_MP_VAR] = "0"
            if THREADS_VAR not in env and THREADS_VAR not in outer:
                env[THREADS_VAR] = "1"
        return env
    if THREADS_VAR in env or THREADS_VAR in outer or not computes_on_cpu(recipe, role, spec):
        return env
    env[THREADS_VAR] = str(share(recipe, n_cores))
    return env


def vllm_cores(recipe: Recipe, spec: RaasSpec | None, n_cores: int | None = None) -> str:
    """The `VLLM_CPU_OMP_THREADS_BIND` value of a RaaS that launches vLLM on the CPU: the k-th
    such RaaS of the recipe takes the k-th slice of `share` cores (one the recipe does not
    list, or one past the cores, wraps around), split into one list per rank ("0,1|2,3") when
    its engine_args ask for tensor or pipeline parallelism (each rank at least one core)."""
    ids = core_ids() if n_cores is None else list(range(n_cores))
    width = share(recipe, len(ids))
    binders = [s for s in recipe.raas if binds_cpu_cores(s)]
    k = next((i for i, s in enumerate(binders) if s is spec), 0)
    ranks = _ranks(spec.engine_args if spec is not None else "")
    per_rank = max(1, width // ranks)
    start = k * width
    lists = []
    for r in range(ranks):
        first = start + r * per_rank
        lists.append(",".join(str(ids[(first + i) % len(ids)]) for i in range(per_rank)))
    return "|".join(lists)


def worker_in_engine_process(
    recipe: Recipe, spec: RaasSpec | None, n_cores: int | None = None
) -> bool:
    """Whether a RaaS launching vLLM on the CPU runs vLLM's worker in its engine-core process:
    its share is one core, it runs one rank and its engine_args name no executor backend."""
    engine_args = spec.engine_args if spec is not None else ""
    if share(recipe, n_cores) != 1 or _ranks(engine_args) != 1:
        return False
    from astra.engine.http.vllm_launch import option_value

    args = shlex.split(engine_args)
    if option_value(args, "--distributed-executor-backend") is not None:
        return False
    dp = option_value(args, "--data-parallel-size") or option_value(args, "-dp")
    return dp is None or dp == "1"


def _ranks(engine_args: str) -> int:
    """vLLM's local ranks for these server arguments: tensor x pipeline parallel size."""
    # Imported here: only a recipe with a vLLM RaaS on the CPU needs it, and the engine
    # package's import would otherwise be paid by every `astra run` at start-up.
    from astra.engine.http.vllm_launch import option_value

    args = shlex.split(engine_args)
    out = 1
    for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        for name in names:
            value = option_value(args, name)
            if value is not None and value.isdigit() and int(value) > 0:
                out *= int(value)
                break
    return out
