"""Reward functions by name: built-ins, `astra.rewards` entry points, or a dotted path.

A reward is a plain callable `(record: dict, completion: str, **context) ->
float`: `record` is the dataset record (reference answer, tests), `completion`
the text the policy produced, `context` extra facts (prompt, group_id,
sample_index, workflow, policy_id) that a reward may ignore. It may return a
`Scored`, a float that carries metadata (why a code run scored 0). `score`
calls one, checks what came back and makes the metadata JSON-safe. Rewards
are synchronous and may block (subprocesses); workflows run them in a thread.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, Protocol

from astra.plugins import Registry, UnknownName


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
    return REWARDS.resolve(name)


def score(
    fn: Callable[..., float], record: dict[str, Any], completion: str, **context: Any
) -> tuple[float, dict[str, Any]]:
    """Calls a reward and returns (value, metadata); a non-finite or non-real value raises.

    The metadata comes back JSON-safe (see `json_safe`), so that a reward using
    numpy cannot make the trajectory's protobuf Struct, and with it the group, fail.
    """
    value = fn(record, completion, **context)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward returned {type(value).__name__}, expected a float")
    if not math.isfinite(value):
        raise ValueError(f"reward returned {value}, expected a finite float")
    metadata = dict(getattr(value, "metadata", {}) or {})
    return float(value), {str(k): json_safe(v) for k, v in metadata.items()}


def json_safe(value: Any, _depth: int = 0) -> Any:
    """`value` as plain JSON types that a protobuf Struct accepts.

    None, bool, str and finite numbers stay (as the built-in types); dicts (keys
    as str), lists and tuples are converted item by item; a numpy (or torch)
    scalar becomes its `.item()`; anything else, a NaN, an infinity or an int
    too large for a double becomes its str().
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:
            return str(value)
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    if _depth < 32:
        if isinstance(value, dict):
            return {str(k): json_safe(v, _depth + 1) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [json_safe(v, _depth + 1) for v in value]
        item = getattr(value, "item", None)
        if callable(item) and getattr(value, "shape", None) == ():
            try:
                return json_safe(item(), _depth + 1)
            except Exception:  # not a scalar after all: fall back to str()
                pass
    try:
        return str(value)
    except Exception:  # a broken __str__
        return f"<{type(value).__name__}>"
