"""`astra raas add|remove --run-dir DIR`: add a RaaS to a running `astra run`, or remove one.

The request goes to the run's supervisor as a file (astra.run.control), which
starts or stops the child and answers; the answer is printed as one JSON line
on stdout (the child's run.json entry). Exit status: 0 done, 1 refused or not
answered (the reason on stderr: run not running, unknown name, name taken, a
RaaS that did not start), 2 usage.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

RUN_DIR = click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False, exists=True),
    help="Directory of the running `astra run`.",
)
TIMEOUT = click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1.0),
    default=300.0,
    show_default=True,
    help="Seconds to wait for the run's answer.",
)


@click.group("raas")
def raas() -> None:
    """Add or remove RaaS of a running `astra run` (elastic pool); check a RaaS's contract."""


def _label(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    labels = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", ctx, param)
        labels[key] = value
    return labels


def _request(run_dir: str, request: dict, timeout_s: float) -> None:
    from astra.run.control import ControlError, submit
    from astra.run.layout import RunDir

    try:
        answer = submit(RunDir(Path(run_dir)), request, timeout_s)
    except ControlError as exc:
        click.echo(f"astra raas {request['action']}: {exc}", err=True)
        sys.exit(1)
    if not answer.get("ok"):
        click.echo(f"astra raas {request['action']}: {answer.get('error')}", err=True)
        sys.exit(1)
    answer.pop("ok", None)
    click.echo(json.dumps(answer))


@raas.command("add")
@RUN_DIR
@click.option("--name", help="Instance id; default: raas-<i>, the first not used in the run.")
@click.option("--capacity", type=click.IntRange(min=1), help="Samples at once (default 16).")
@click.option(
    "--label", "labels", multiple=True, callback=_label, metavar="KEY=VALUE", help="Repeatable."
)
@click.option("--policy", "policies", multiple=True, help="Policies served; default: all.")
@click.option("--model", help="Model; default: its first policy's (after the warm-up).")
@click.option("--device", help="Torch device (default cpu).")
@click.option(
    "--command",
    help="An external RaaS instead of `astra serve raas`: its command line, split as a shell "
    "would, with placeholders such as {dataflow} and {instance_id} (docs/running.md).",
)
@TIMEOUT
def add(
    run_dir: str,
    name: str | None,
    capacity: int | None,
    labels: dict[str, str],
    policies: tuple[str, ...],
    model: str | None,
    device: str | None,
    command: str | None,
    timeout_s: float,
) -> None:
    """Start one more RaaS in the run; it registers with Dataflow and gets work at once."""
    spec: dict = {"labels": labels, "policies": list(policies)}
    if command is not None:
        try:
            spec["command"] = shlex.split(command)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--command") from None
        if not spec["command"]:
            raise click.BadParameter("empty", param_hint="--command")
    optional = {"name": name, "capacity": capacity, "model": model, "device": device}
    spec.update({k: v for k, v in optional.items() if v is not None})
    _request(run_dir, {"action": "add", "spec": spec}, timeout_s)


@raas.command("remove")
@click.argument("name")
@RUN_DIR
@TIMEOUT
def remove(name: str, run_dir: str, timeout_s: float) -> None:
    """Stop the RaaS NAME: it deregisters, and Dataflow dispatches again what it held."""
    _request(run_dir, {"action": "remove", "name": name}, timeout_s)
