"""Checks `astra run` makes before it starts anything, each failing as one line naming the key.

A mistake that would otherwise surface minutes later in a child's log (or as a
run that waits forever: a misspelled reward made every dispatch fail while the
trainer waited) ends the command at start-up instead, before a run directory is
made: the caller turns `PreflightError` into exit 2 and one line with the recipe
key, the value and the fix. Checked, in turn:

- the recipe's `env:` is applied to this process too (its PYTHONPATH reaches the
  supervisor's own imports, which the checks below and the random baseline need);
- every workflow and every reward a stream uses resolves (a built-in name, an
  entry point or a dotted path), with "did you mean" for a near miss;
- every policy's and RaaS's model is `tiny` or a directory with config.json of a
  supported architecture, safetensors weights and a tokenizer (with a chat template
  when a stream's workflow is chat-shaped, like `chat`);
- every data file (dataset.path, warmup.path, eval.path) is readable JSONL or
  Parquet and its records have the fields the run reads (`prompt`, and what a
  built-in reward or the warm-up reads: `answer`, or `numbers` and `target`);
- every RaaS launched on vLLM has a Python that can import vllm;
- a fixed port (`dataflow.metrics_port`) is free (every other port is picked free).
The run directory must be writable (checked by the caller as it makes it).
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

from astra.errors import AstraError
from astra.run.recipe import Recipe

TINY = "tiny"
# The record fields each built-in reward reads (astra.rewards.answers, code_tests).
REWARD_FIELDS = {
    "exact_match": ("answer",),
    "numeric": ("answer",),
    "arithmetic": ("answer",),
    "countdown": ("numbers", "target"),
}


class PreflightError(Exception):
    """One line: the recipe key at fault and the fix."""


def _did_you_mean(name: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{hint} Known: {', '.join(known) or 'none'}; or a dotted path pkg.module:function."


def apply_env(recipe: Recipe) -> None:
    """The recipe's `env:` in this process (children get it anyway): PYTHONPATH entries also
    go on sys.path, which an already running interpreter does not read again."""
    for key, value in recipe.env.items():
        os.environ[key] = value
    for entry in reversed(recipe.env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)


def check_plugins(recipe: Recipe) -> None:
    """Every stream's workflow and reward resolve here, as the RaaS will resolve them."""
    from astra.rewards.registry import UnknownReward, get_reward, known_rewards
    from astra.workflows.registry import UnknownWorkflow, get_workflow, known_workflows

    for i, stream in enumerate(recipe.streams):
        try:
            workflow = get_workflow(stream.workflow)
        except UnknownWorkflow as exc:
            if "." in stream.workflow or ":" in stream.workflow:  # a dotted path: say why
                raise PreflightError(
                    f"streams.{i}.workflow={stream.workflow}: {exc}. Is its package on "
                    "PYTHONPATH (recipe `env:`)?"
                ) from None
            raise PreflightError(
                f"streams.{i}.workflow={stream.workflow}: no such workflow."
                + _did_you_mean(stream.workflow, known_workflows())
            ) from None
        except TypeError as exc:
            raise PreflightError(f"streams.{i}.workflow={stream.workflow}: {exc}") from None
        reward = recipe.stream_reward(stream) or workflow.default_reward
        key = f"streams.{i}.reward" if stream.reward else f"streams.{i} (default reward)"
        try:
            get_reward(reward)
        except UnknownReward as exc:
            if "." in reward or ":" in reward:  # a dotted path: say why it did not import
                raise PreflightError(
                    f"{key}={reward}: {exc}. Is its package on PYTHONPATH (recipe `env:`)?"
                ) from None
            raise PreflightError(
                f"{key}={reward}: no such reward." + _did_you_mean(reward, known_rewards())
            ) from None
    for i, spec in enumerate(recipe.raas):
        if spec.command:
            continue
        for name in spec.workflows:
            try:
                get_workflow(name)
            except (UnknownWorkflow, TypeError):
                raise PreflightError(
                    f"raas.{i}.workflows: {name!r} is no workflow."
                    + _did_you_mean(name, known_workflows())
                ) from None


def model_problem(model: str) -> str | None:
    """Why `model` cannot be loaded (None: it can): `tiny` or a Hugging Face directory."""
    if model == TINY:
        return None
    directory = Path(model)
    if not directory.is_dir():
        return "no such directory (give `tiny` or a local Hugging Face model directory)"
    if not (directory / "config.json").is_file():
        return f"{directory}/config.json is missing (not a Hugging Face model directory)"
    try:
        from astra.engine.model_config import ModelConfig

        ModelConfig.from_dir(directory)
    except (AstraError, ValueError, KeyError) as exc:
        return f"{directory}/config.json: {getattr(exc, 'message', exc)}"
    if not any(directory.glob("*.safetensors")):
        return f"{directory}: no *.safetensors weights"
    from astra.engine.tokenizer import load_tokenizer

    try:
        load_tokenizer(directory)
    except AstraError as exc:
        return exc.message
    return None


def check_models(recipe: Recipe) -> None:
    for i, policy in enumerate(recipe.policies):
        if why := model_problem(policy.model):
            raise PreflightError(f"policies.{i}.model={policy.model}: {why}")
    for i, spec in enumerate(recipe.raas):
        if spec.model and not spec.command and (why := model_problem(spec.model)):
            raise PreflightError(f"raas.{i}.model={spec.model}: {why}")
    from astra.engine.chat import has_chat_template
    from astra.workflows.registry import get_workflow

    for i, stream in enumerate(recipe.streams):  # a chat workflow needs the model's template
        if getattr(get_workflow(stream.workflow), "chat", False):
            for p in (p for p in recipe.policies if p.id in recipe.stream_policies(stream)):
                if not has_chat_template(p.model):
                    raise PreflightError(
                        f"streams.{i}.workflow={stream.workflow}: the model of policy {p.id} "
                        f"({p.model}) has no chat template; give a model with one, or use "
                        "workflow single_turn (the prompt as it is)"
                    )


def _check_file(key: str, path: str, fields: tuple[str, ...]) -> None:
    from astra.dataflow.dataset import DatasetError, load_records

    try:
        records = load_records(path)
    except DatasetError as exc:
        raise PreflightError(f"{key}={path}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PreflightError(f"{key}={path}: cannot read it: {exc}") from None
    for n, record in enumerate(records, start=1):
        missing = [f for f in fields if f not in record]
        if missing:
            raise PreflightError(
                f"{key}={path}: record {n} has no {', '.join(map(repr, missing))} field "
                f"(it has {', '.join(sorted(record)) or 'none'}); each record needs "
                f"{', '.join(map(repr, fields))}"
            )


def check_data(recipe: Recipe) -> None:
    from astra.workflows.registry import get_workflow

    if recipe.dataset.kind == "file" and recipe.dataset.path:
        needs = ["prompt"]
        for stream in recipe.streams:
            reward = recipe.stream_reward(stream) or get_workflow(stream.workflow).default_reward
            needs += REWARD_FIELDS.get(reward, ())
        _check_file("dataset.path", recipe.dataset.path, tuple(dict.fromkeys(needs)))
    if recipe.warmup.steps and recipe.warmup.path:
        _check_file("warmup.path", recipe.warmup.path, ("prompt", "answer"))
    if recipe.eval.path:
        _check_file("eval.path", recipe.eval.path, ("prompt",))


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


def check_ports(recipe: Recipe) -> None:
    """A fixed port of the recipe (every other one is picked free) is free now."""
    import socket

    port = recipe.dataflow.metrics_port
    if not port:
        return
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the /metrics server
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise PreflightError(
                f"dataflow.metrics_port={port}: cannot listen on it ({exc.strerror}); give "
                "another port, or 0 for any free one"
            ) from None


def check(recipe: Recipe) -> None:
    """Every start-up check, in turn."""
    apply_env(recipe)
    check_plugins(recipe)
    check_models(recipe)
    check_data(recipe)
    check_engines(recipe)
    check_ports(recipe)
