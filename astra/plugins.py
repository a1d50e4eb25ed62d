"""`Registry`: objects registered by name, plus plugins found through an entry-point group.

Rewards, workflows, tools and Dataflow buffer filters each keep one. Built-ins register with a
decorator at import; third-party packages declare an entry point in the
registry's group (`astra.rewards`, `astra.workflows`, `astra.tools`, `astra.filters`) and are
loaded the first time their name is asked for. `resolve` also takes a dotted path,
`package.module:attribute` (or `package.module.attribute`), imported on first use: a
module on PYTHONPATH is enough, nothing to install. A name that is none of these raises
the registry's lookup error listing every known name. This module imports no
plugin by itself and never touches the network.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class UnknownName(LookupError):
    """A name that no registration, plugin or path resolves; the message lists known names."""

    def __str__(self) -> str:  # LookupError would quote the message like a key
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Named objects of one kind (`kind` is used in messages), with entry-point plugins.

    Plugins are scanned again on every miss, so a package installed while the
    process runs is found; a plugin that loads is kept. A built-in name wins
    over a plugin of the same name.
    """

    def __init__(self, kind: str, group: str, error: type[UnknownName] = UnknownName) -> None:
        self.kind = kind
        self.group = group
        self.error = error
        self._items: dict[str, T] = {}
        self._broken: dict[str, str] = {}
        self._by_path: dict[str, T] = {}  # dotted paths already imported

    def register(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        """Decorator registering its target under `name`; a second, different target raises."""
        if not name or not name.strip() or name != name.strip():
            raise ValueError(f"invalid {self.kind} name {name!r}")

        def decorate(obj: T) -> T:
            self.add(name, obj, replace=replace)
            return obj

        return decorate

    def add(self, name: str, obj: T, *, replace: bool = False) -> None:
        held = self._items.get(name)
        if held is not None and held is not obj and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered ({held!r})")
        self._items[name] = obj
        self._broken.pop(name, None)

    def remove(self, name: str) -> None:
        """Forgets `name` (tests and plugin reloads); unknown names are ignored."""
        self._items.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def find(self, name: str) -> T | None:
        """The object registered as `name`, loading plugins on a miss; None when unknown."""
        if name not in self._items:
            self._load_plugins()
        return self._items.get(name)

    def get(self, name: str) -> T:
        obj = self.find(name)
        if obj is None:
            raise self.missing(name)
        return obj

    def resolve(self, name: str) -> T:
        """`name` registered, from a plugin, else imported as a dotted path `pkg.mod:attr` or
        `pkg.mod.attr`; the lookup error says why a path did not resolve (the module does not
        import, has no such attribute) and lists the known names."""
        obj = self._by_path.get(name) or self.find(name)
        if obj is not None:
            return obj
        if "." not in name and ":" not in name:
            raise self.missing(name)
        module_name, sep, attr = name.partition(":")
        if not sep:
            module_name, _, attr = name.rpartition(".")
        if not module_name or not attr:
            raise self.missing(name, " (not a valid dotted path)")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # a user module may fail in any way while importing
            why = f" (cannot import {module_name}: {type(exc).__name__}: {exc})"
            raise self.missing(name, why) from exc
        obj = getattr(module, attr, None)
        if obj is None or not callable(obj):
            raise self.missing(name, f" ({module_name} has no callable {attr!r})")
        self._by_path[name] = obj
        return obj

    def missing(self, name: str, extra: str = "") -> UnknownName:
        """The lookup error for `name`: the cause when its plugin broke, and the known names."""
        if name in self._broken:
            return self.error(f"{self.kind} {name!r}: {self._broken[name]}")
        known = ", ".join(self.names()) or "none"
        return self.error(f"unknown {self.kind} {name!r}{extra}; known: {known}")

    def names(self) -> tuple[str, ...]:
        """Every registered name, plugins included, sorted."""
        self._load_plugins()
        return tuple(sorted(self._items))

    def _load_plugins(self) -> None:
        for ep in entry_points(group=self.group):
            if ep.name in self._items:
                continue
            try:
                obj = ep.load()
            except Exception as exc:
                self._broken[ep.name] = (
                    f"plugin {ep.value} (entry point group {self.group}) failed to load: "
                    f"{type(exc).__name__}: {exc}"
                )
                log.warning("%s", self._broken[ep.name])
                continue
            self.add(ep.name, obj)
