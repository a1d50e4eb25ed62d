"""Answer-checking rewards for math-style and synthetic tasks: exact_match, numeric,
arithmetic, countdown.

Each reads the policy's answer from the completion (the last
`<answer>...</answer>` span when there is one, else the completion) and
compares it with the record: `answer` for the first three, `numbers` and
`target` for countdown (records as astra.raas.tasks writes them). A record
without the field it needs raises; a malformed completion scores 0.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from astra.rewards import safe_math
from astra.rewards.registry import Scored, register_reward

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
DEFAULT_TOLERANCE = 1e-6
COUNTDOWN_OPS = frozenset({"+", "-", "*", "/"})


def answer_span(completion: str) -> str:
    """The text holding the answer: the last <answer> tag's content, else the completion."""
    tags = _ANSWER_TAG.findall(completion)
    return tags[-1] if tags else completion


def normalize(text: str) -> str:
    """Lower case, surrounding whitespace removed, inner whitespace runs as one space."""
    return " ".join(text.split()).lower()


def numbers_in(text: str) -> list[float]:
    """Every number in `text`, in order (thousands separators allowed: 1,000)."""
    out = []
    for match in _NUMBER.findall(text):
        try:
            out.append(float(match.replace(",", "")))
        except ValueError:
            continue
    return out


def _field(record: dict[str, Any], name: str) -> Any:
    if name not in record:
        raise KeyError(f"the record has no {name!r} field (fields: {sorted(record)})")
    return record[name]


def _reference_number(record: dict[str, Any]) -> float:
    ref = _field(record, "answer")
    if isinstance(ref, int | float) and not isinstance(ref, bool):
        return float(ref)
    found = numbers_in(str(ref))
    if not found:
        raise ValueError(f"the record's answer {ref!r} holds no number")
    return found[-1]


@register_reward("exact_match")
def exact_match(record: dict[str, Any], completion: str, **context: Any) -> float:
    """1.0 when the answer equals the record's `answer` up to whitespace and case."""
    return float(normalize(answer_span(completion)) == normalize(str(_field(record, "answer"))))


@register_reward("numeric")
def numeric(record: dict[str, Any], completion: str, **context: Any) -> float:
    """1.0 when the last number of the answer is within tolerance of the record's answer.

    Tolerance: `record["tolerance"]` or 1e-6, relative to max(1, |reference|).
    """
    ref = _reference_number(record)
    found = numbers_in(answer_span(completion))
    if not found:
        return Scored(0.0, reason="no number in the completion")
    tol = float(record.get("tolerance", DEFAULT_TOLERANCE))
    return float(abs(found[-1] - ref) <= tol * max(1.0, abs(ref)))


@register_reward("arithmetic")
def arithmetic(record: dict[str, Any], completion: str, **context: Any) -> float:
    """1.0 when the first number of the answer equals the record's integer answer.

    The arithmetic task's prompt ends in "=", so the answer is what comes first.
    """
    ref = _reference_number(record)
    found = numbers_in(answer_span(completion))
    if not found:
        return Scored(0.0, reason="no number in the completion")
    return float(found[0] == ref)


def _as_int(value: Any) -> int:
    number = float(value)  # records that crossed a protobuf Struct hold floats
    if not number.is_integer():
        raise ValueError(f"countdown numbers and target must be integers, got {value!r}")
    return int(number)


@register_reward("countdown")
def countdown(record: dict[str, Any], completion: str, **context: Any) -> float:
    """1.0 when the answer is an arithmetic expression reaching `target` with `numbers`.

    Each given number may be used at most once; + - * / and parentheses only,
    evaluated exactly (fractions) and safely. The expression is the answer's
    first line, up to an "=" if it writes one.
    """
    numbers = Counter(_as_int(n) for n in _field(record, "numbers"))
    target = _as_int(_field(record, "target"))
    lines = [line for line in answer_span(completion).splitlines() if line.strip()]
    if not lines:
        return Scored(0.0, reason="empty answer")
    expr = lines[0].split("=")[0].strip()
    try:
        used = safe_math.literals(expr, COUNTDOWN_OPS)
        if any(not isinstance(n, int) for n in used):
            return Scored(0.0, reason="only the given integers may be used")
        if Counter(int(n) for n in used) - numbers:
            return Scored(0.0, reason="uses a number not given, or one more than once")
        value = safe_math.evaluate(expr, exact=True, ops=COUNTDOWN_OPS)
    except safe_math.UnsafeExpression as exc:
        return Scored(0.0, reason=f"invalid expression: {exc}")
    return float(value == target)
