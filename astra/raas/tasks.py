"""Synthetic datasets for the embedded default and tests: arithmetic and countdown.

`generate_records(kind, n, seed, **params)` returns `n` records, the same ones
for the same seed and params; `exclude` leaves out given prompts (the
supervised warm-up set of `astra run` is disjoint from the RL prompts this
way). `write_dataset(kind, path, n, seed, **params)` writes them as JSONL, the
format Dataflow's dataset loader reads. Every record has a `prompt` and an
`answer`, plus the fields its reward (astra.rewards.answers) checks:

- arithmetic: `{"prompt": "12+7=", "answer": "19", "task": "arithmetic"}`,
  operators from `ops` (default + - *), operands 0..`max_operand`; reward
  "exact_match" (or "arithmetic", "numeric").
- countdown: `{"prompt": ..., "numbers": [3, 5, 7, 2], "target": 24,
  "answer": "(5+7)*2", "task": "countdown"}`; the answer is one solution,
  reward "countdown" checks any expression.

No network, no model: plain Python.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Collection
from fractions import Fraction
from pathlib import Path
from typing import Any

from astra.durable import make_dirs, replace_durably
from astra.rewards import safe_math

COUNTDOWN_PROMPT = (
    "Using the numbers {numbers}, each at most once, and + - * / with parentheses, "
    "write an expression equal to {target}.\nExpression: "
)
MAX_TARGET = 999


def arithmetic_record(
    rng: random.Random, max_operand: int = 99, ops: str = "+-*"
) -> dict[str, Any]:
    """One `a op b` problem; products use smaller operands so answers stay short."""
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"ops must be a non-empty string of + - *, got {ops!r}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    op = rng.choice(ops)
    top = max_operand if op != "*" else max(2, int(max_operand**0.5) + 1)
    a, b = rng.randint(0, top), rng.randint(0, top)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": f"{a}{op}{b}=", "answer": str(answer), "task": "arithmetic"}


def _random_expression(rng: random.Random, numbers: list[int]) -> str:
    """A random binary tree over `numbers` (in order) with random operators."""
    if len(numbers) == 1:
        return str(numbers[0])
    split = rng.randint(1, len(numbers) - 1)
    left = _random_expression(rng, numbers[:split])
    right = _random_expression(rng, numbers[split:])
    return f"({left}{rng.choice('+-*/')}{right})"


def countdown_record(
    rng: random.Random, count: int = 4, max_number: int = 12, attempts: int = 1000
) -> dict[str, Any]:
    """`count` numbers in 1..max_number and a positive integer target that some
    subset of at least two of them reaches; the answer is that expression."""
    for _ in range(attempts):
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        used = rng.sample(numbers, rng.randint(2, count))
        expr = _random_expression(rng, used)
        try:
            value = safe_math.evaluate(expr, exact=True)
        except safe_math.UnsafeExpression:  # division by zero
            continue
        if isinstance(value, Fraction) and value.denominator == 1 and 0 < value <= MAX_TARGET:
            target = int(value)
            if target in numbers:
                continue  # "use nothing but the target" is too easy
            return {
                "prompt": COUNTDOWN_PROMPT.format(
                    numbers=", ".join(map(str, numbers)), target=target
                ),
                "numbers": numbers,
                "target": target,
                "answer": expr[1:-1] if expr.startswith("(") else expr,
                "task": "countdown",
            }
    raise RuntimeError(f"no countdown problem found in {attempts} attempts")


GENERATORS: dict[str, Callable[..., dict[str, Any]]] = {
    "arithmetic": arithmetic_record,
    "countdown": countdown_record,
}


def generate_records(
    kind: str,
    n: int,
    seed: int = 0,
    *,
    exclude: Collection[str] = (),
    max_attempts_per_record: int = 100,
    **params: Any,
) -> list[dict[str, Any]]:
    """`n` records of task `kind` ("arithmetic" or "countdown"), determined by `seed`
    and `params` (the generator's keyword arguments), none whose prompt is in `exclude`."""
    if kind not in GENERATORS:
        raise ValueError(f"unknown task kind {kind!r}; known: {', '.join(sorted(GENERATORS))}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(f"astra-tasks/{kind}/{seed}")
    out: list[dict[str, Any]] = []
    for _ in range(n * max_attempts_per_record):
        record = GENERATORS[kind](rng, **params)
        if record["prompt"] not in exclude:
            out.append(record)
            if len(out) == n:
                return out
    raise ValueError(
        f"only {len(out)} of {n} {kind} records found outside the {len(exclude)} excluded "
        "prompts: the task has too few distinct problems"
    )


def write_records(records: list[dict[str, Any]], path: str | Path) -> Path:
    """Writes `records` to `path` as JSONL (atomically: a reader sees all or nothing)."""
    out = Path(path)
    make_dirs(out.parent)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    replace_durably(tmp, out)  # a --resume after a power cut finds the same file
    return out


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL file."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_dataset(kind: str, path: str | Path, n: int, seed: int = 0, **params: Any) -> Path:
    """Writes `generate_records(kind, n, seed, **params)` to `path` as JSONL; returns the path."""
    return write_records(generate_records(kind, n, seed, **params), path)
