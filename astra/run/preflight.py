"""Checks `astra run` makes before it starts anything, each failing as one line naming the key.

A mistake that would otherwise surface minutes later in a child's log (or as a
run that waits forever) ends the command at start-up instead: the caller turns
`PreflightError` into a usage error (exit 2). Today: every RaaS launched on vLLM
has a Python that can import vllm (astra.engine.http.vllm_env).
"""

from __future__ import annotations

from astra.errors import AstraError
from astra.run.recipe import Recipe


class PreflightError(Exception):
    """One line: the recipe key at fault and the fix."""


def check_engines(recipe: Recipe) -> None:
    """Raises PreflightError when a RaaS's engine cannot be started on this machine."""
    from astra.engine.http.vllm_env import vllm_python

    checked: dict[str, str] = {}
    for i, spec in enumerate(recipe.raas):
        if spec.command or spec.engine != "vllm":
            continue
        if spec.engine_python in checked:
            continue
        try:
            checked[spec.engine_python] = vllm_python(spec.engine_python)
        except AstraError as exc:
            raise PreflightError(f"raas.{i}.engine=vllm: {exc.message}") from exc


def check(recipe: Recipe) -> None:
    """Every start-up check, in turn."""
    check_engines(recipe)
