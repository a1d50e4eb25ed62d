"""The `code_tests` reward: runs the completion's code against the record's tests in a sandbox.

The program is the last ```python fenced block of the completion (or the
whole completion when it has none). The record's `tests` (or MBPP's
`test_list`) is a list of Python snippets, usually `assert` statements; each
runs after the program in the program's namespace, inside one sandboxed
subprocess (astra.rewards.sandbox). Reward = fraction of tests passed. A
program that does not load, a timeout, a memory or output limit scores 0
with the reason in the metadata. Limits come from the record
(`time_limit_s`, `memory_limit_mb`) or the defaults below.

Judged outside (MBPP's tests are nearly all of this kind): a test that is one
`assert` whose expected values are literals (`EXPR == LITERAL`, `math.isclose(EXPR,
LITERAL, ...)`, `abs(EXPR - LITERAL) < EPS` and `and`-chains of them; see
astra.rewards.judged) is split. Only each EXPR enters the sandbox, which evaluates it in
the program's namespace and hands back its value as data: built-in numbers, strings, bytes,
None and containers of them (a subclass as its built-in base, a NumPy scalar as its Python
value, a bytearray as bytes, dict keys and items views as sets). This process rebuilds the
value from built-in types only and compares it with the literal, which never entered the
sandbox. Whatever the program does inside its interpreter (reach the harness, patch
modules, return an object whose `__eq__` always holds, write a verdict of its own), the
most it can produce is its own answer to each expression. A value of another type (a
Fraction, an array) or over `MAX_VALUE_CHARS` fails the test. The sandbox does not hide
the file system (astra.rewards.sandbox): a program that finds the records on disk can read
what they expect, so keep the dataset where the sandbox's user cannot read it if that
matters.

Run inside (the rest: tests of several statements, `assert EXPR`, `assert not EXPR`,
other comparisons): the program and the test run in one interpreter, as they must, next to
the harness that counts passes. The harness keeps what a program could use to forge that
count out of reach of plain code: the result path and the tests are locals of the harness
function, not `__main__` globals; the harness deletes its own name and its source file
(which holds both) before the program runs; it binds the builtins it needs beforehand (a
program that replaces `builtins.exec` does not skip the tests); and it refuses to write a
result file that already exists. The reward counts the verdict only when `passed + failed`
equals the number of these tests. This is hardening, not isolation: code running
in-process can still reach the harness's frame and objects (`sys._getframe`, `gc`) and forge
these tests' count. `metadata["judged_outside"]` says how many of a record's tests were
split; a reward from tests run inside is a claim to audit where the policy may be
adversarial.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from astra.rewards.judged import Check, checks_of, decode
from astra.rewards.registry import Scored, register_reward
from astra.rewards.sandbox import SandboxLimits, run_python

DEFAULT_TIME_S = 5.0
DEFAULT_MEMORY_MB = 512
MAX_TESTS = 256
MAX_VALUE_CHARS = 8192  # of one value handed back, encoded
RESULT_CHARS = 4 << 20  # read of the result file: 256 values at the limit, JSON-escaped

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs in the sandbox. The result goes to a file with an unguessable name, so the
# program's own output cannot pass for it by accident, and which exists only once the
# tests have run: the harness refuses a file the program made. `steps` are the tests in
# order: (i, "run", source) a test run inside, counted in `passed`/`failed` (`failures`
# lists at most 8), or (i, "ask", [EXPR, ...]) the expressions of a test judged outside,
# whose values go to `values[i]` as [encoded value or None, error name] each (the encoding
# is astra.rewards.judged's).
_HARNESS = """\
def _harness():
    import json, os
    program, steps, result = {program!r}, {steps!r}, {result!r}
    run, build, opener, count, dumps = exec, compile, open, len, json.dumps
    evaluate, instance, kind_of, text_of = eval, isinstance, type, repr
    bases = (bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict)
    tags = {{list: "l", tuple: "t", set: "S", frozenset: "F"}}
    del globals()["_harness"]
    os.remove(__file__)  # the source holds the result name and the tests

    def encode(v, depth=0):
        if depth > 100:
            raise ValueError("nested too deep")
        if v is None:
            return ["n"]
        t = kind_of(v)
        if t not in bases:
            name = t.__name__
            if name in ("dict_keys", "dict_items"):
                v, t = set(v), set
            elif instance(v, bytearray):
                v, t = bytes(v), bytes
            elif callable(getattr(v, "item", None)) and getattr(v, "shape", None) == ():
                return encode(v.item(), depth + 1)  # a NumPy scalar
            else:
                base = next((b for b in bases if instance(v, b)), None)
                if base is None:
                    raise TypeError("not plain data: " + name)
                v, t = base(v), base
        if t is bool:
            return ["b", v]
        if t is int:
            return ["i", text_of(v)]
        if t is float:
            return ["f", text_of(v)]
        if t is complex:
            return ["c", text_of(v.real), text_of(v.imag)]
        if t is str:
            return ["s", v]
        if t is bytes:
            return ["y", v.hex()]
        if t is dict:
            return ["d", [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]]
        return [tags[t], [encode(x, depth + 1) for x in v]]

    ns = {{"__name__": "solution"}}
    try:
        run(build(program, "<program>", "exec"), ns)
    except BaseException as exc:
        out = {{"loaded": False, "error": type(exc).__name__ + ": " + str(exc)[:200]}}
    else:
        passed, failures, values = 0, [], {{}}
        for i, mode, source in steps:  # in the record's order: a test may build on another
            if mode == "run":
                try:
                    run(build(source, "<test %d>" % i, "exec"), ns)
                    passed += 1
                except BaseException as exc:
                    failures.append("%d: %s" % (i, type(exc).__name__))
                continue
            answers = values[str(i)] = []
            for expr in source:
                try:
                    text = dumps(encode(evaluate(build(expr, "<test %d>" % i, "eval"), ns)))
                    if count(text) > {max_chars}:
                        raise ValueError("value over {max_chars} characters")
                    answers.append([text, ""])
                except BaseException as exc:
                    answers.append([None, type(exc).__name__])
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
        output_chars=RESULT_CHARS,
    )
    judged = {i: c for i, t in enumerate(tests) if (c := checks_of(t)) is not None}
    steps = [
        (i, "ask", [c.expr for c in judged[i]]) if i in judged else (i, "run", t)
        for i, t in enumerate(tests)
    ]
    result_name = f"result-{secrets.token_hex(8)}.json"
    harness = _HARNESS.format(
        program=extract_program(completion),
        steps=steps,
        result=result_name,
        max_chars=MAX_VALUE_CHARS,
    )
    run = run_python(harness, limits=limits, keep=(result_name,))
    total, inside = len(tests), len(tests) - len(judged)
    meta = {"tests": total, "judged_outside": len(judged)}
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
        return Scored(0.0, reason="program failed to load", error=_short(out.get("error")), **meta)
    passed, failed, values = out.get("passed"), out.get("failed"), out.get("values")
    if (
        type(passed) is not int
        or type(failed) is not int
        or failed < 0
        or passed + failed != inside
        or not isinstance(values, dict)
    ):
        return Scored(0.0, reason="inconsistent result", **meta)
    passed = min(max(passed, 0), inside)
    raw_failures = out.get("failures")
    failures = [_short(f) for f in raw_failures[:8]] if isinstance(raw_failures, list) else []
    for i, checks in judged.items():
        why = _verdict(checks, values.get(str(i)))
        if why is None:
            passed += 1
        elif len(failures) < 8:
            failures.append(f"{i}: {why}")
    return Scored(passed / total, reason="ok", passed=passed, failures=failures, **meta)


def _verdict(checks: list[Check], answers: Any) -> str | None:
    """None when every check holds on the values handed back, else why not (short)."""
    if not isinstance(answers, list) or len(answers) != len(checks):
        return "no value"
    for check, answer in zip(checks, answers, strict=True):
        if not (isinstance(answer, list) and len(answer) == 2):
            return "no value"
        text, error = answer
        if text is None:
            return _short(error) or "no value"
        if not isinstance(text, str) or len(text) > MAX_VALUE_CHARS:
            return "no value"
        try:
            got = decode(json.loads(text))
        except (ValueError, TypeError, RecursionError, MemoryError):
            return "unreadable value"
        if not check.holds(got):
            return "mismatch"
    return None


def _short(text: Any) -> str:
    """At most 80 characters of a string the sandbox wrote (anything else: empty)."""
    return text[:80] if isinstance(text, str) else ""
