"""Safe arithmetic: evaluates `+ - * / // % **` over number literals by walking the AST.

Used by the calculator tool and the countdown reward. Nothing is ever passed
to `eval`: names, calls, attributes, subscripts and every other node are
refused with `UnsafeExpression`, and sizes are bounded (expression length,
exponent, integer bits) so a short input cannot take long to evaluate.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any, cast

MAX_CHARS = 512
MAX_EXPONENT = 128
MAX_BITS = 1024
MAX_NODES = 256

Number = int | float | Fraction

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_SYMBOLS: dict[type, str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.UAdd: "unary +",
    ast.USub: "unary -",
}
ALL_OPS = frozenset(_SYMBOLS.values())


class UnsafeExpression(ValueError):
    """The text is not plain arithmetic, is too large, or cannot be evaluated."""


def parse(expr: str, ops: frozenset[str] = ALL_OPS) -> ast.expr:
    """Parses `expr` as arithmetic using only `ops` (symbols of ALL_OPS); else UnsafeExpression."""
    if len(expr) > MAX_CHARS:
        raise UnsafeExpression(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise UnsafeExpression(f"not an expression: {exc.msg}") from exc
    nodes = list(ast.walk(tree.body))
    if len(nodes) > MAX_NODES:
        raise UnsafeExpression(f"expression has more than {MAX_NODES} parts")
    for node in nodes:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise UnsafeExpression(f"only numbers are allowed, got {node.value!r}")
        elif isinstance(node, ast.BinOp | ast.UnaryOp):
            symbol = _SYMBOLS.get(type(node.op))
            if symbol not in ops:
                raise UnsafeExpression(
                    f"operator {symbol or type(node.op).__name__} is not allowed"
                )
        elif not isinstance(node, ast.operator | ast.unaryop):
            raise UnsafeExpression(f"{type(node).__name__} is not allowed in arithmetic")
    return tree.body


def literals(expr: str, ops: frozenset[str] = ALL_OPS) -> list[Number]:
    """The number literals of `expr` (the numbers an expression uses)."""
    return [
        cast(Number, n.value) for n in ast.walk(parse(expr, ops)) if isinstance(n, ast.Constant)
    ]


def evaluate(expr: str, *, exact: bool = False, ops: frozenset[str] = ALL_OPS) -> Number:
    """The value of `expr`; `exact` computes with Fractions (integer literals only)."""
    return _eval(parse(expr, ops), exact)


def _eval(node: ast.expr, exact: bool) -> Number:
    if isinstance(node, ast.Constant):
        if exact:
            if not isinstance(node.value, int):
                raise UnsafeExpression(f"only integers are allowed, got {node.value!r}")
            return Fraction(node.value)
        return cast(Number, node.value)
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand, exact))
    assert isinstance(node, ast.BinOp)  # parse() admitted nothing else
    left, right = _eval(node.left, exact), _eval(node.right, exact)
    if isinstance(node.op, ast.Pow):
        if not -MAX_EXPONENT <= right <= MAX_EXPONENT:
            raise UnsafeExpression(f"exponent {right} is larger than {MAX_EXPONENT}")
        if exact and getattr(right, "denominator", 1) != 1:
            raise UnsafeExpression("fractional exponents are not exact")
    try:
        value = _BINARY[type(node.op)](left, right)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as exc:
        raise UnsafeExpression(f"{type(exc).__name__}: {exc}") from exc
    if isinstance(value, complex):
        raise UnsafeExpression("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise UnsafeExpression(f"integer larger than {MAX_BITS} bits")
    if isinstance(value, Fraction) and (
        value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS
    ):
        raise UnsafeExpression(f"fraction larger than {MAX_BITS} bits")
    return value


def format_number(value: Number) -> str:
    """Short text of a result: integral values without a decimal point, else 12 digits."""
    if isinstance(value, Fraction):
        value = value.numerator if value.denominator == 1 else float(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)
