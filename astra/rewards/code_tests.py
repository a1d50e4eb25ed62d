"""The `code_tests` reward: runs the completion's code against the record's tests in a sandbox.

The program is the last ```python fenced block of the completion (or the
whole completion when it has none). The record's `tests` (or MBPP's
`test_list`) is a list of Python snippets, usually `assert` statements; each
runs after the program in the program's namespace, inside one sandboxed
subprocess (astra.rewards.sandbox). Reward = fraction of tests passed. A
program that does not load, a timeout, a memory or output limit scores 0
with the reason in the metadata. Limits come from the record
(`time_limit_s`, `memory_limit_mb`) or the defaults below.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from astra.rewards.registry import Scored, register_reward
from astra.rewards.sandbox import SandboxLimits, run_python

DEFAULT_TIME_S = 5.0
DEFAULT_MEMORY_MB = 512
MAX_TESTS = 256

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs in the sandbox. The result goes to a file with an unguessable name, so the
# program's own output cannot pass for it by accident.
_HARNESS = """\
import json
_program, _tests, _result = {program!r}, {tests!r}, {result!r}
_ns = {{"__name__": "solution"}}
try:
    exec(compile(_program, "<program>", "exec"), _ns)
except BaseException as exc:
    _out = {{"loaded": False, "error": type(exc).__name__ + ": " + str(exc)[:200]}}
else:
    _passed, _failures = 0, []
    for _i, _test in enumerate(_tests):
        try:
            exec(compile(_test, "<test %d>" % _i, "exec"), _ns)
            _passed += 1
        except BaseException as exc:
            _failures.append("%d: %s" % (_i, type(exc).__name__))
    _out = {{"loaded": True, "passed": _passed, "failures": _failures[:8]}}
with open(_result, "w") as _f:
    json.dump(_out, _f)
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
    )
    result_name = f"result-{secrets.token_hex(8)}.json"
    harness = _HARNESS.format(program=extract_program(completion), tests=tests, result=result_name)
    run = run_python(harness, limits=limits, keep=(result_name,))
    total = len(tests)
    raw = run.files.get(result_name)
    if raw is None:
        reason = "no result" if run.ok else run.reason
        return Scored(0.0, reason=reason, tests=total, stderr=run.stderr[-500:])
    try:
        out = json.loads(raw)
    except json.JSONDecodeError:
        return Scored(0.0, reason="unreadable result", tests=total)
    if not out.get("loaded"):
        return Scored(0.0, reason="program failed to load", error=out.get("error", ""), tests=total)
    passed = int(out.get("passed", 0))
    return Scored(passed / total, reason="ok", passed=passed, tests=total, failures=out["failures"])
