"""Tests `code_tests` judges outside the sandbox: which ones, and how their values are read back.

A test qualifies when it is one `assert` whose every expected value is a
literal this process keeps: `EXPR == LITERAL` (either side), `math.isclose(EXPR,
LITERAL, rel_tol=..., abs_tol=...)`, `abs(EXPR - LITERAL) < EPS` (or `<=`), and
`and`-chains of those. Each becomes one `Check` per EXPR: only EXPR is sent into
the sandbox; the value comes back encoded as tagged JSON (the harness's
`encode`), is rebuilt here from built-in types only (`decode`), and is compared
here with the literal. `assert EXPR` / `assert not EXPR` do not qualify: their
expected values (a `math.isclose` argument, the right side of a comparison) sit
inside EXPR, in reach of the program.

The encoding: ["n"] None, ["b", bool], ["i", "digits"], ["f", "repr"] (inf and
nan too), ["c", "re", "im"], ["s", str], ["y", "hex"] bytes, and ["l" | "t" |
"S" | "F", [items]] list, tuple, set, frozenset, ["d", [[key, value], ...]].
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 100
_FLOAT = re.compile(r"-?(?:inf|nan|\d+(?:\.\d*)?(?:e[-+]?\d+)?)")


@dataclass(frozen=True, slots=True)
class Check:
    """One expression of a test judged outside, and what its value must be."""

    expr: str  # sent into the sandbox
    expected: Any  # never sent
    kind: str = "eq"  # "eq", "isclose", "abs<", "abs<="
    rel_tol: float = 1e-9
    abs_tol: float = 0.0

    def holds(self, got: Any) -> bool:
        try:
            if self.kind == "eq":
                return bool(got == self.expected)
            if not _is_number(got):
                return False
            if self.kind == "isclose":
                return math.isclose(got, self.expected, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
            gap = abs(got - self.expected)
            return gap < self.abs_tol if self.kind == "abs<" else gap <= self.abs_tol
        except (TypeError, ValueError, OverflowError, RecursionError):
            return False


def checks_of(test: str) -> list[Check] | None:
    """The checks of a test that qualifies (module doc); None runs it inside the sandbox."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    return _checks(tree.body[0].test)


def _checks(node: ast.expr) -> list[Check] | None:
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
        out: list[Check] = []
        for value in node.values:
            part = _checks(value)
            if part is None:
                return None
            out += part
        return out
    check = _equality(node) or _isclose(node) or _abs_bound(node)
    return [check] if check is not None else None


def _equality(node: ast.expr) -> Check | None:
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
        return None
    if not isinstance(node.ops[0], ast.Eq):
        return None
    return _against_literal(node.left, node.comparators[0], "eq")


def _isclose(node: ast.expr) -> Check | None:
    if not (isinstance(node, ast.Call) and len(node.args) == 2):
        return None
    f = node.func
    named = isinstance(f, ast.Name) and f.id == "isclose"
    dotted = (
        isinstance(f, ast.Attribute)
        and f.attr == "isclose"
        and isinstance(f.value, ast.Name)
        and f.value.id == "math"
    )
    if not (named or dotted):
        return None
    tolerances = {"rel_tol": 1e-9, "abs_tol": 0.0}
    for kw in node.keywords:
        value = _literal(kw.value)
        if kw.arg not in tolerances or not _is_number(value) or value < 0:
            return None
        tolerances[kw.arg] = float(value)
    check = _against_literal(node.args[0], node.args[1], "isclose", **tolerances)
    return check if check is not None and _is_number(check.expected) else None


def _abs_bound(node: ast.expr) -> Check | None:
    """abs(EXPR - LITERAL) < EPS (or <=, either order inside abs)."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
        return None
    kind = {ast.Lt: "abs<", ast.LtE: "abs<="}.get(type(node.ops[0]))
    bound = _literal(node.comparators[0])
    call = node.left
    if kind is None or not _is_number(bound) or bound < 0:
        return None
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "abs"
        and len(call.args) == 1
        and not call.keywords
        and isinstance(call.args[0], ast.BinOp)
        and isinstance(call.args[0].op, ast.Sub)
    ):
        return None
    diff = call.args[0]
    check = _against_literal(diff.left, diff.right, kind, abs_tol=float(bound))
    return check if check is not None and _is_number(check.expected) else None


def _against_literal(a: ast.expr, b: ast.expr, kind: str, **tol: float) -> Check | None:
    """The check of `a` against literal `b`, or of `b` against literal `a`; None when neither
    or both sides are literals (nothing of the program's to ask)."""
    for expr, other in ((a, b), (b, a)):
        expected = _literal(other)
        if expected is not _NOT_LITERAL and _literal(expr) is _NOT_LITERAL:
            return Check(ast.unparse(expr), expected, kind, **tol)
    return None


_NOT_LITERAL = object()


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def _is_number(value: Any) -> bool:
    return type(value) in (int, float, bool)


def decode(value: Any, depth: int = 0) -> Any:
    """A value of the harness's encoding, rebuilt from built-in types only; ValueError if it
    is not one (TypeError for an unhashable set member or key)."""
    if depth > MAX_DEPTH or not isinstance(value, list) or not value:
        raise ValueError("not an encoded value")
    tag, args = value[0], value[1:]
    if tag == "n" and not args:
        return None
    if len(args) == 1 and tag in _SCALARS:
        kind, parse = _SCALARS[tag]
        if type(args[0]) is not kind:
            raise ValueError(f"bad {tag!r} value")
        return parse(args[0])
    if tag == "c" and len(args) == 2:
        return complex(_float(args[0]), _float(args[1]))
    if tag in _CONTAINERS and len(args) == 1 and type(args[0]) is list:
        return _CONTAINERS[tag](decode(x, depth + 1) for x in args[0])
    if tag == "d" and len(args) == 1 and type(args[0]) is list:
        pairs = args[0]
        if not all(type(p) is list and len(p) == 2 for p in pairs):
            raise ValueError("bad dict entry")
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in pairs}
    raise ValueError(f"unknown encoding {str(tag)[:20]!r}")


def _float(text: Any) -> float:
    if type(text) is not str or not _FLOAT.fullmatch(text.lower()):
        raise ValueError("bad float")
    return float(text)


def _int(text: str) -> int:
    if not re.fullmatch(r"-?\d{1,4300}", text):
        raise ValueError("bad int")
    return int(text)


_SCALARS: dict[str, tuple[type, Any]] = {
    "b": (bool, bool),
    "i": (str, _int),
    "f": (str, _float),
    "s": (str, str),
    "y": (str, bytes.fromhex),
}
_CONTAINERS = {"l": list, "t": tuple, "S": set, "F": frozenset}
