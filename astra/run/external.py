"""An external RaaS in a run: a recipe's `raas:` entry with `command:` instead of the built-in
`astra serve raas` (an engine in another language, or one of the user's own).

The supervisor starts the command like any child (its own session, its log, SIGTERM then
SIGKILL, restarts, `elastic:` schedules) and expects of it what the RaaS contract and
`astra serve raas` promise: it serves astra.raas.v1.RolloutService, registers with the
Dataflow it is given under the instance id it is given, heartbeats, and prints one JSON line
on stdout once it serves (`{"service": "raas", "address": "HOST:PORT", ...}`). Where the run
issues TLS credentials, ASTRA_TLS_DIR names the child's directory.

Each argument may hold these placeholders, filled in per RaaS: {dataflow} (Dataflow's
address), {instance_id}, {capacity}, {state_dir} (a directory of its own under the run),
{run_dir}, {policy} / {workflow} (the first it serves), {policies} / {workflows} (all of
them, comma-separated). `{{` and `}}` are literal braces. Labels in the entry are what the
run routes by and shows; the command passes them to its process itself.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence

PLACEHOLDERS = (
    "dataflow",
    "instance_id",
    "capacity",
    "state_dir",
    "run_dir",
    "policy",
    "policies",
    "workflow",
    "workflows",
)


def check_command(command: Sequence[str]) -> None:
    """Raises ValueError naming the argument whose placeholders are not ones of PLACEHOLDERS,
    or are not well formed."""
    if not command[0].strip():
        raise ValueError("command: the first argument (the program) is empty")
    for i, arg in enumerate(command):
        try:
            fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(arg)]
        except ValueError as exc:
            raise ValueError(
                f"command[{i}] {arg!r}: {exc} (write {{{{ and }}}} for braces)"
            ) from None
        for field, spec, conv in fields:
            if field is None:
                continue
            if field not in PLACEHOLDERS:
                known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
                raise ValueError(
                    f"command[{i}] {arg!r}: unknown placeholder {{{field}}} (known: {known})"
                )
            if spec or conv:
                raise ValueError(
                    f"command[{i}] {arg!r}: a placeholder takes no format or conversion"
                )


def fill(command: Sequence[str], values: Mapping[str, object]) -> list[str]:
    """The command line with its placeholders filled in (checked by check_command)."""
    return [arg.format_map({k: str(v) for k, v in values.items()}) for arg in command]
