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
them, comma-separated), {labels} (the entry's labels as `k=v,k=v`, sorted by key, empty
when it has none: what the RaaS registers with, RegisterInstanceRequest.labels). `{{` and
`}}` are literal braces. Labels are what the run routes by and shows; a command that takes
{labels} needs labels whose keys hold no `=` or `,` and whose values hold no `,` (refused
when the recipe loads), so that the text splits back into the same pairs.
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
    "labels",
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


def labels_text(labels: Mapping[str, str]) -> str:
    """The {labels} placeholder: `k=v,k=v`, sorted by key ("" without labels)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def check_labels(command: Sequence[str], labels: Mapping[str, str]) -> None:
    """Raises ValueError for a label that {labels} could not carry unambiguously (only when
    the command takes {labels})."""
    fields = {f for arg in command for _, f, _, _ in string.Formatter().parse(arg)}
    if "labels" not in fields:
        return
    for k, v in sorted(labels.items()):
        if "=" in k or "," in k or "," in v:
            raise ValueError(
                f"labels[{k}]: the command takes {{labels}} (k=v,k=v): a key may not hold "
                "'=' or ',', nor a value ','"
            )


def fill(command: Sequence[str], values: Mapping[str, object]) -> list[str]:
    """The command line with its placeholders filled in (checked by check_command)."""
    return [arg.format_map({k: str(v) for k, v in values.items()}) for arg in command]
