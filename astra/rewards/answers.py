"""Answer-checking rewards for math-style and synthetic tasks: exact_match, numeric,
arithmetic, countdown.

Each reads the policy's answer from the completion (the last
`<answer>...</answer>` span when there is one, else the completion) and
compares it with the record: `answer` for the first three, `numbers` and
`target` for countdown (records as astra.raas.tasks writes them). A record
without the field it needs raises; a malformed completion scores 0. Numbers
are compared exactly, as decimals: no float rounding (2**53 + 1 is not
2**53) and no float overflow (an exact answer past 1e308 still matches).
"""

from __future__ import annotations

import decimal
import re
from collections import Counter
from decimal import Decimal
from typing import Any

from astra.rewards import safe_math
from astra.rewards.registry import Scored, register_reward

# A span may not hold another opening tag: each scan then stops at the next <answer>,
# so a completion of many unclosed tags takes linear time, not quadratic.
_ANSWER_TAG = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
DEFAULT_TOLERANCE = 1e-6
COUNTDOWN_OPS = frozenset({"+", "-", "*", "/"})
# Differences and tolerances: wide exponents, no traps (a NaN compares false).
_EXACT = decimal.Context(prec=64, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[])


def answer_span(completion: str) -> str:
    """The text holding the answer: the last <answer> tag's content, else the completion."""
    tags = _ANSWER_TAG.findall(completion)
    return tags[-1] if tags else completion


def normalize(text: str) -> str:
    """Lower case, surrounding whitespace removed, inner whitespace runs as one space."""
    return " ".join(text.split()).lower()


def numbers_in(text: str) -> list[Decimal]:
    """Every number in `text`, in order, exactly (thousands separators allowed: 1,000).

    The minus sign U+2212 counts as "-". An exponent too wide for a decimal
    reads as a float would (an infinity or 0).
    """
    out = []
    for match in _NUMBER.findall(text.replace("\u2212", "-")):
        literal = match.replace(",", "")
        try:
            out.append(Decimal(literal))
        except (decimal.InvalidOperation, ValueError):
            try:
                out.append(Decimal(float(literal)))
            except ValueError:
                continue
    return out


def _field(record: dict[str, Any], name: str) -> Any:
    if name not in record:
        raise KeyError(f"the record has no {name!r} field (fields: {sorted(record)})")
    return record[name]


def _reference_number(record: dict[str, Any]) -> Decimal:
    ref = _field(record, "answer")
    if isinstance(ref, int) and not isinstance(ref, bool):
        return Decimal(ref)
    if isinstance(ref, float):
        return Decimal(repr(float(ref)))  # 0.1 as written, not its binary expansion
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
    tol = Decimal(repr(float(record.get("tolerance", DEFAULT_TOLERANCE))))
    with decimal.localcontext(_EXACT):
        return float(abs(found[-1] - ref) <= tol * max(Decimal(1), abs(ref)))


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
    if isinstance(value, int) and not isinstance(value, bool):
        return value  # exact, however large
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
