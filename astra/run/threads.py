"""CPU threads of a run's torch processes: each gets its share of the cores, unless told.

torch sizes its intra-op thread pool to every core of the machine. An `astra run` on one CPU
machine starts several processes that compute with torch (the trainer of each policy, each
RaaS with the built-in torch engine): left alone, each would run as many threads as there are
cores, so n processes keep n times the cores' worth of threads busy-waiting on each other. On
the small operations of a small model that costs more than the threads give: on the 2-core
machine of BENCHMARKS.md one trainer step of the embedded task took ~600 ms instead of ~70 ms.

`child_env` gives a trainer or torch-engine RaaS on the CPU `OMP_NUM_THREADS` = the cores this
process may run on divided by the number of such processes in the recipe (at least 1), unless
OMP_NUM_THREADS is set already (in the recipe's `env:` or the supervisor's environment): then
that wins. Other children (Dataflow, the WeightService, a RaaS that launches vLLM or SGLang,
an external RaaS, anything on a GPU) get the recipe's `env:` unchanged. A RaaS added during
the run (`elastic:`, `astra raas add`) gets the share computed at the start.
Never starts, stops or inspects a process: it only computes environments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from astra.run.recipe import RaasSpec, Recipe

THREADS_VAR = "OMP_NUM_THREADS"


def cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def computes_on_cpu(recipe: Recipe, role: str, spec: RaasSpec | None = None) -> bool:
    """Whether a child of `role` (with its RaaS `spec`) runs torch compute on the CPU."""
    if role == "trainer":
        return recipe.trainer.device == "cpu"
    if role == "raas" and spec is not None:
        return spec.engine == "torch" and spec.device == "cpu" and not spec.command
    return False


def cpu_processes(recipe: Recipe) -> int:
    """How many of the recipe's children compute with torch on the CPU (trainers, RaaS)."""
    trainers = len(recipe.policies) if computes_on_cpu(recipe, "trainer") else 0
    return trainers + sum(computes_on_cpu(recipe, "raas", spec) for spec in recipe.raas)


def share(recipe: Recipe, n_cores: int | None = None) -> int:
    """Threads for each CPU torch process: the cores over those processes, at least 1."""
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
    thread share where it computes on the CPU and nobody set OMP_NUM_THREADS."""
    env = dict(recipe.env)
    outer = os.environ if environ is None else environ
    if THREADS_VAR in env or THREADS_VAR in outer or not computes_on_cpu(recipe, role, spec):
        return env
    env[THREADS_VAR] = str(share(recipe, n_cores))
    return env
