"""Dotted command-line overrides (`--set trainer.num_steps=5`, `raas.0.capacity=4`) on raw YAML data.

Values are parsed as YAML scalars ("5" -> 5, "[a, b]" -> a list). A path
through a list uses integer indexes; a list the data does not hold yet is
copied from the defaults first, so `raas.1.capacity=4` works on a file
that leaves `raas` at its default. Unknown keys are left for the typed model
to reject, naming the key.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml


class OverrideError(ValueError):
    """An override that cannot be applied; the message names it."""


def parse_overrides(items: list[str] | tuple[str, ...]) -> list[tuple[list[str], Any]]:
    """`KEY.SUB=VALUE` strings -> (path, YAML-parsed value)."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        path = key.strip().split(".")
        if not sep or not all(path):
            raise OverrideError(f"--set {item!r}: expected DOTTED.KEY=VALUE")
        try:
            out.append((path, yaml.safe_load(raw)))
        except yaml.YAMLError as exc:
            raise OverrideError(f"--set {item!r}: not a YAML value: {exc}") from exc
    return out


def apply_override(data: dict[str, Any], path: list[str], value: Any, defaults: Any) -> None:
    """Sets `path` in `data`; missing lists are copied from `defaults` so indexes work."""
    node: Any = data
    for depth, key in enumerate(path):
        where = ".".join(path[: depth + 1])
        default = defaults.get(key) if isinstance(defaults, dict) else None
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise OverrideError(f"{where}: no item {key} (the list has {len(node)})")
            index: int | str = int(key)
            default = (
                defaults[int(key)]
                if isinstance(defaults, list) and int(key) < len(defaults)
                else None
            )
        elif isinstance(node, dict):
            index = key
        else:
            raise OverrideError(f"{where}: {'.'.join(path[:depth])} is not a section or a list")
        if depth == len(path) - 1:
            node[index] = value
            return
        child = node[index] if isinstance(node, list) else node.get(key)
        if child is None and isinstance(node, dict):
            node[key] = copy.deepcopy(default) if isinstance(default, list) else {}
        elif not isinstance(child, dict | list):
            raise OverrideError(f"{where}: holds {child!r}, not a section or a list")
        node, defaults = node[index], default
