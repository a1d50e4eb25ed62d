"""Reward functions by name: built-ins, `astra.rewards` entry points, or a dotted path.

A reward is a plain callable `(record: dict, completion: str, **context) ->
float`: `record` is the dataset record (reference answer, tests), `completion`
the text the policy produced, `context` extra facts (prompt, group_id,
sample_index, workflow, policy_id) that a reward may ignore. It may return a
`Scored`, a float that carries metadata (why a code run scored 0). `score`
calls one and checks what came back. Rewards are synchronous and may block
(subprocesses); workflows run them in a thread.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable
from typing import Any, Protocol

from astra.rewards.plugins import Registry, UnknownName


class RewardFn(Protocol):
    def __call__(self, record: dict[str, Any], completion: str, /, **context: Any) -> float: ...


class UnknownReward(UnknownName):
    """No reward of that name, entry point or importable dotted path."""


class Scored(float):
    """A reward value with metadata (JSON-compatible values) saying how it was reached."""

    metadata: dict[str, Any]

    def __new__(cls, value: float, **metadata: Any) -> Scored:
        obj = super().__new__(cls, value)
        obj.metadata = metadata
        return obj


REWARDS: Registry[Callable[..., float]] = Registry("reward", "astra.rewards", UnknownReward)
_BY_PATH: dict[str, Callable[..., float]] = {}  # dotted paths already imported


def register_reward(name: str, *, replace: bool = False) -> Callable[[Callable], Callable]:
    """Decorator registering a reward function under `name`."""
    return REWARDS.register(name, replace=replace)


def known_rewards() -> tuple[str, ...]:
    return REWARDS.names()


def get_reward(name: str) -> Callable[..., float]:
    """Resolves `name`: registered, then plugin, then `pkg.mod:fn` or `pkg.mod.fn`.

    Raises UnknownReward with the reason (module not importable, attribute
    missing, not callable) and the known names.
    """
    fn = _BY_PATH.get(name) or REWARDS.find(name)
    if fn is not None:
        return fn
    if "." not in name and ":" not in name:
        raise REWARDS.missing(name)
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise REWARDS.missing(name, " (not a valid dotted path)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user module may fail in any way while importing
        why = f" (cannot import {module_name}: {type(exc).__name__}: {exc})"
        raise REWARDS.missing(name, why) from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise REWARDS.missing(name, f" ({module_name} has no callable {attr!r})")
    _BY_PATH[name] = fn
    return fn


def score(
    fn: Callable[..., float], record: dict[str, Any], completion: str, **context: Any
) -> tuple[float, dict[str, Any]]:
    """Calls a reward and returns (value, metadata); a non-finite or non-real value raises."""
    value = fn(record, completion, **context)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward returned {type(value).__name__}, expected a float")
    if not math.isfinite(value):
        raise ValueError(f"reward returned {value}, expected a finite float")
    return float(value), dict(getattr(value, "metadata", {}) or {})
