"""The `code_tests` reward: runs the completion's code against the record's tests in a sandbox.

The program is the last ```python fenced block of the completion (or the
whole completion when it has none). The record's `tests` (or MBPP's
`test_list`) is a list of Python snippets, usually `assert` statements; each
runs after the program in the program's namespace, inside one sandboxed
subprocess (astra.rewards.sandbox). Reward = fraction of tests passed. A
program that does not load, a timeout, a memory or output limit scores 0
with the reason in the metadata. Limits come from the record
(`time_limit_s`, `memory_limit_mb`) or the defaults below.

Trust: the program and the tests run in one interpreter, as they must (the
tests call the program's functions), next to the harness that counts passes
and writes the verdict. The harness keeps what a program could use to forge
it out of reach of plain code: the result path and the tests are locals of
the harness function, not `__main__` globals; the harness deletes its own name
and its source file (which holds both) before the program runs; it binds the
builtins it needs beforehand (a program that replaces `builtins.exec` does not
skip the tests); and it refuses to write a result file that already exists.
The reward counts the verdict only when `passed + failed` equals the number of
tests, and clamps `passed` to [0, tests], so it is always a fraction in
[0, 1]. This is hardening, not isolation: code running in-process can still
reach the harness's frame and objects (`sys._getframe`, `gc`), patch the
modules it uses, or return values whose `__eq__` always holds, and so forge a
full pass. Only running the tests in a process separate from the program (the
program's functions reached over IPC, results crossing as plain data) rules
forging out entirely; that does not fit the exec-in-one-namespace design
here, so treat a high `code_tests` reward from an adversarial policy as a claim
to audit, not a proof.
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
# program's own output cannot pass for it by accident, and which exists only once the
# tests have run: the harness refuses a file the program made. `failed` counts every
# failure (`failures` lists at most 8), so the caller can check the counts add up.
_HARNESS = """\
def _harness():
    import json, os
    program, tests, result = {program!r}, {tests!r}, {result!r}
    run, build, opener, count, dumps = exec, compile, open, len, json.dumps
    del globals()["_harness"]
    os.remove(__file__)  # the source holds the result name and the tests
    ns = {{"__name__": "solution"}}
    try:
        run(build(program, "<program>", "exec"), ns)
    except BaseException as exc:
        out = {{"loaded": False, "error": type(exc).__name__ + ": " + str(exc)[:200]}}
    else:
        passed, failures = 0, []
        for i, test in enumerate(tests):
            try:
                run(build(test, "<test %d>" % i, "exec"), ns)
                passed += 1
            except BaseException as exc:
                failures.append("%d: %s" % (i, type(exc).__name__))
        out = {{"loaded": True, "passed": passed, "failed": count(failures)}}
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
    except (ValueError, RecursionError):
        out = None
    if not isinstance(out, dict):
        return Scored(0.0, reason="unreadable result", tests=total)
    if not out.get("loaded"):
        return Scored(0.0, reason="program failed to load", error=out.get("error", ""), tests=total)
    passed, failed = out.get("passed"), out.get("failed")
    if type(passed) is not int or type(failed) is not int or failed < 0 or passed + failed != total:
        return Scored(0.0, reason="inconsistent result", tests=total)
    passed = min(max(passed, 0), total)
    return Scored(
        passed / total, reason="ok", passed=passed, tests=total, failures=out.get("failures", [])
    )
