"""Loading typed service configs: YAML file, then environment, then flags.

Each service has a pydantic model with `extra="forbid"`, so an unknown key —
in the file, in an environment variable or in a flag — is an error that
names it, never silently dropped. Environment overrides use the service's
prefix and `__` for nesting: ASTRA_DATAFLOW__POOL__CONFIRM_FAILURES=5.
Values from the environment are parsed as YAML scalars ("5" -> 5).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """The base of every config section: an unknown key is an error naming it, and a key
    that was renamed (`renamed`: old -> new) one naming its new name."""

    model_config = ConfigDict(extra="forbid")
    renamed: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in cls.renamed.items():
                if old in data:
                    raise ValueError(f"{old!r} was renamed: write {new}: {data[old]!r}")
        return data


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the source."""


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {key} is not a section")
        node = child
    node[path[-1]] = value


def env_overrides(prefix: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Nested overrides from variables named PREFIX__SECTION__KEY."""
    environ = dict(os.environ) if environ is None else environ
    out: dict[str, Any] = {}
    marker = prefix + "__"
    for name, raw in environ.items():
        if not name.startswith(marker):
            continue
        path = [p.lower() for p in name[len(marker) :].split("__") if p]
        if not path:
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name}: not a YAML value: {exc}") from exc
        _set_path(out, path, value)
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    model: type[M],
    path: str | Path | None = None,
    *,
    env_prefix: str,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> M:
    """Build `model` from a YAML file, environment variables and explicit overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: {exc.strerror}") from exc
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded or {}
    data = _merge(data, env_overrides(env_prefix, environ))
    data = _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid {model.__name__}: {problems}") from exc
