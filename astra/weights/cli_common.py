"""What the `astra weights` commands share: argument types, the identity check, the exit codes.

`run_command` runs a command body: argument errors exit 2, operational failures exit 1 with
one JSON error on stderr; `emit` prints a result as JSON on stdout. Used by astra.weights.cli
(local commands) and astra.weights.cli_remote (commands on a WeightService).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from astra.errors import AstraError, InvalidArgument

log = logging.getLogger("astra.weights.cli")
T = TypeVar("T")

DIR = click.Path(exists=True, file_okay=False, path_type=Path)


def identity_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from astra.weights.layout import check_identity

    if value is None:
        return None
    try:
        return check_identity(value, allow_initial=param.name == "base_version")
    except InvalidArgument as exc:
        raise click.BadParameter(exc.message) from exc


def run_command(action: Callable[[], T]) -> T:
    """Runs a command body: argument errors exit 2, operational failures exit 1."""
    try:
        return action()
    except InvalidArgument as exc:
        raise click.UsageError(exc.message) from exc
    except (AstraError, OSError) as exc:
        error: dict[str, Any] = {"message": str(exc)}
        if isinstance(exc, AstraError):
            error.update(code=exc.code, reason=exc.reason, **exc.metadata)
        else:
            error.update(code="INTERNAL", reason=type(exc).__name__)
        log.debug("failure", exc_info=True)
        click.echo(json.dumps({"error": error}), err=True)
        sys.exit(1)


def emit(result: dict[str, Any]) -> None:
    click.echo(json.dumps(result, indent=2))
