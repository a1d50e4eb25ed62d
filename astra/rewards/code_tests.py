"""The `code_tests` reward: runs the completion's code against the record's tests in a sandbox.

The program is the last ```python fenced block of the completion (or the
whole completion when it has none). The record's `tests` (or MBPP's
`test_list`) is a list of Python snippets, usually `assert` statements; each
runs after the program in the program's namespace, inside one sandboxed
subprocess (astra.rewards.sandbox). Reward = fraction of tests passed. A
program that does not load, a timeout, a memory or output limit scores 0
with the reason in the metadata. Limits come from the record
(`time_limit_s`, `memory_limit_mb`) or the defaults below.

Judged outside (most tests): a test that is one `assert` of `EXPR == LITERAL` (either
side the literal), `assert EXPR` or `assert not EXPR` is split. Only EXPR reaches the
sandbox, which evaluates it in the program's namespace and hands back its value as plain
data (built-in numbers, strings, bytes, None and containers of them; a subclass as its
built-in base; a NumPy scalar as its Python value) or, for the truth tests, the value's
truth. This process reads that back with `ast.literal_eval`, so only real built-in values
come out, and compares it with the literal, which never entered the sandbox. Whatever the
program does inside its process (reach the harness, patch modules, return an object whose
`__eq__` always holds, write a verdict of its own), the most it can produce is its own
answer to each expression; without the expected values it cannot forge a pass. A value
that is not plain data (or is over `MAX_VALUE_CHARS`) fails the test.

Run inside (the rest: tests of several statements, other comparisons, a literal on neither
side): the program and the test run in one interpreter, as they must, next to the harness
that counts passes. The harness keeps what a program could use to forge that count out of
reach of plain code: the result path and the tests are locals of the harness function, not
`__main__` globals; the harness deletes its own name and its source file (which holds both)
before the program runs; it binds the builtins it needs beforehand (a program that replaces
`builtins.exec` does not skip the tests); and it refuses to write a result file that already
exists. The reward counts the verdict only when `passed + failed` equals the number of these
tests. This is hardening, not isolation: code running in-process can still reach the
harness's frame and objects (`sys._getframe`, `gc`) and forge these tests' count.
`metadata["judged_outside"]` says how many of a record's tests were split; a reward
from tests run inside is a claim to audit where the policy may be adversarial.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from astra.rewards.registry import Scored, register_reward
from astra.rewards.sandbox import SandboxLimits, run_python

DEFAULT_TIME_S = 5.0
DEFAULT_MEMORY_MB = 512
MAX_TESTS = 256
MAX_VALUE_CHARS = 8192  # of one value handed back (its repr); 256 of them fit the result file

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs in the sandbox. The result goes to a file with an unguessable name, so the
# program's own output cannot pass for it by accident, and which exists only once the
# tests have run: the harness refuses a file the program made. `failed` counts every
# failure of a test run inside (`failures` lists at most 8), so the caller can check the
# counts add up. `steps` are the tests in order: ("run") a test run inside, or ("value",
# "truth") the expression of a test judged outside; `values` maps each of those to [repr of
# its plain value or truth, or None, and the error].
_HARNESS = """\
def _harness():
    import json, os
    program, steps, result = {program!r}, {steps!r}, {result!r}
    run, build, opener, count, dumps = exec, compile, open, len, json.dumps
    evaluate, show, truth = eval, repr, bool
    kinds = (int, float, complex, str, bytes, bool, type(None), list, tuple, set, frozenset, dict)
    del globals()["_harness"]
    os.remove(__file__)  # the source holds the result name and the tests

    def plain(v, depth=0):
        if depth > 100:
            raise ValueError("nested too deep")
        t = type(v)
        if t not in kinds:
            base = next((k for k in kinds if isinstance(v, k)), None)
            if base is not None:
                v, t = base(v), base
            elif callable(getattr(v, "item", None)) and getattr(v, "shape", None) == ():
                return plain(v.item(), depth + 1)  # a NumPy scalar
            else:
                raise TypeError("not plain data: " + t.__name__)
        if t in (list, tuple, set, frozenset):
            return t(plain(x, depth + 1) for x in v)
        if t is dict:
            return {{plain(k, depth + 1): plain(x, depth + 1) for k, x in v.items()}}
        return v

    ns = {{"__name__": "solution"}}
    try:
        run(build(program, "<program>", "exec"), ns)
    except BaseException as exc:
        out = {{"loaded": False, "error": type(exc).__name__ + ": " + str(exc)[:200]}}
    else:
        passed, failures, values = 0, [], {{}}
        for i, source, mode in steps:  # in the record's order: a test may build on another
            if mode == "run":
                try:
                    run(build(source, "<test %d>" % i, "exec"), ns)
                    passed += 1
                except BaseException as exc:
                    failures.append("%d: %s" % (i, type(exc).__name__))
                continue
            try:
                v = evaluate(build(source, "<test %d>" % i, "eval"), ns)
                text = show(truth(v) if mode == "truth" else plain(v))
                if count(text) > {max_chars}:
                    raise ValueError("value over {max_chars} characters")
                values[str(i)] = [text, ""]
            except BaseException as exc:
                values[str(i)] = [None, type(exc).__name__]
        out = {{"loaded": True, "passed": passed, "failed": count(failures), "values": values}}
        out["failures"] = failures[:8]
    try:
        f = opener(result, "x")
    except FileExistsError:
        os.remove(result)
        raise SystemExit("the result file existed before the harness wrote it") from None
    with f:
        f.write(dumps(out))


_harness()
"""


@dataclass(frozen=True, slots=True)
class Probe:
    """A test judged outside the sandbox: the expression sent in, and what it must give."""

    index: int
    expr: str
    truth: bool  # compare the expression's truth (assert EXPR / assert not EXPR)
    expected: Any  # the literal, or the truth wanted

    def holds(self, text: Any) -> bool:
        """Whether the repr handed back is a plain value equal to what the test wants."""
        if not isinstance(text, str) or len(text) > MAX_VALUE_CHARS:
            return False
        try:
            got = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False
        if self.truth:
            return type(got) is bool and got is self.expected
        try:
            return bool(got == self.expected)
        except RecursionError:
            return False


def probe_of(index: int, test: str) -> Probe | None:
    """The probe of a test that is one `assert EXPR == LITERAL` (the literal on either side),
    `assert EXPR` or `assert not EXPR`; None for any other test (run inside)."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    node = tree.body[0].test
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        for expr, other in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
            try:
                expected = ast.literal_eval(other)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            if _is_literal(expr):  # literal == literal: nothing of the program's to ask
                return None
            return Probe(index, ast.unparse(expr), False, expected)
        return None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return Probe(index, ast.unparse(node.operand), True, False)
    if _is_literal(node):
        return None
    return Probe(index, ast.unparse(node), True, True)


def _mode(probe: Probe) -> str:
    return "truth" if probe.truth else "value"


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def extract_program(completion: str) -> str:
    """The last fenced Python block of `completion`, else the completion itself."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _tests(record: dict[str, Any]) -> list[str]:
    tests = record.get("tests", record.get("test_list"))
    if tests is None:
        raise KeyError(f"the record has no 'tests' field (fields: {sorted(record)})")
    if isinstance(tests, str):
        tests = [tests]
    if not tests or len(tests) > MAX_TESTS or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"'tests' must be 1..{MAX_TESTS} strings of Python")
    return list(tests)


@register_reward("code_tests")
def code_tests(record: dict[str, Any], completion: str, **context: Any) -> float:
    """Fraction of the record's tests the completion's program passes (see the module doc)."""
    tests = _tests(record)
    limits = SandboxLimits(
        time_s=float(record.get("time_limit_s", DEFAULT_TIME_S)),
        memory_bytes=int(float(record.get("memory_limit_mb", DEFAULT_MEMORY_MB))) << 20,
        output_chars=(MAX_VALUE_CHARS + 64) * (MAX_TESTS + 8),
    )
    probes = {i: p for i, t in enumerate(tests) if (p := probe_of(i, t)) is not None}
    inside = [(i, t) for i, t in enumerate(tests) if i not in probes]
    result_name = f"result-{secrets.token_hex(8)}.json"
    harness = _HARNESS.format(
        program=extract_program(completion),
        steps=[
            (i, t, "run") if i not in probes else (i, probes[i].expr, _mode(probes[i]))
            for i, t in enumerate(tests)
        ],
        result=result_name,
        max_chars=MAX_VALUE_CHARS,
    )
    run = run_python(harness, limits=limits, keep=(result_name,))
    total = len(tests)
    meta = {"tests": total, "judged_outside": len(probes)}
    raw = run.files.get(result_name)
    if raw is None:
        reason = "no result" if run.ok else run.reason
        return Scored(0.0, reason=reason, stderr=run.stderr[-500:], **meta)
    try:
        out = json.loads(raw)
    except (ValueError, RecursionError):
        out = None
    if not isinstance(out, dict):
        return Scored(0.0, reason="unreadable result", **meta)
    if not out.get("loaded"):
        return Scored(0.0, reason="program failed to load", error=out.get("error", ""), **meta)
    passed, failed, values = out.get("passed"), out.get("failed"), out.get("values")
    if (
        type(passed) is not int
        or type(failed) is not int
        or failed < 0
        or passed + failed != len(inside)
        or not isinstance(values, dict)
    ):
        return Scored(0.0, reason="inconsistent result", **meta)
    passed = min(max(passed, 0), len(inside))
    failures = list(out.get("failures", []))[:8] if isinstance(out.get("failures"), list) else []
    for i, probe in probes.items():
        got = values.get(str(i))
        if isinstance(got, list) and len(got) == 2 and probe.holds(got[0]):
            passed += 1
        elif len(failures) < 8:
            why = got[1] if isinstance(got, list) and len(got) == 2 and got[1] else "mismatch"
            failures.append(f"{i}: {str(why)[:40]}")
    return Scored(passed / total, reason="ok", passed=passed, failures=failures, **meta)
