"""Rewards on known inputs, the code sandbox's limits, lookup by name, dotted path and entry
point, and the synthetic task generators whose answers the rewards must accept."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import struct_pb2

import astra.rewards.code_tests as code_tests_module
from astra.dataflow.dataset import load_records
from astra.raas.tasks import generate_records, write_dataset
from astra.rewards import REWARDS, Scored, UnknownReward, get_reward, known_rewards, score
from astra.rewards.answers import arithmetic, countdown, exact_match, numeric
from astra.rewards.code_tests import code_tests, extract_program
from astra.rewards.safe_math import UnsafeExpression, evaluate, format_number
from astra.rewards.sandbox import SandboxResult
from tests.conftest import entry_point_package


def half_reward(record, completion, **context):
    return 0.5 + 0 * len(completion)


# ----- answer checking -----------------------------------------------------------------------


def test_exact_match_normalises_whitespace_and_case():
    assert exact_match({"answer": "New  York"}, "  new york\n") == 1.0
    assert exact_match({"answer": "Paris"}, "I think <answer> PARIS </answer>") == 1.0
    assert exact_match({"answer": "Paris"}, "Paris, France") == 0.0
    with pytest.raises(KeyError, match="no 'answer' field"):
        exact_match({}, "x")


def test_numeric_takes_the_last_number_with_tolerance():
    assert numeric({"answer": "72"}, "3 bags of 24 makes 72.") == 1.0
    assert numeric({"answer": "#### 1,000"}, "total: 1000.0000001") == 1.0
    assert numeric({"answer": 0.5}, "about 0.5000001") == 1.0
    assert numeric({"answer": 3.14, "tolerance": 0.01}, "pi is 3.1416") == 1.0
    assert numeric({"answer": "72"}, "72 no, 71") == 0.0
    assert numeric({"answer": "-4"}, "<answer>-4</answer> then 9") == 1.0
    nothing = numeric({"answer": "1"}, "no digits")
    assert nothing == 0.0 and nothing.metadata["reason"] == "no number in the completion"
    with pytest.raises(ValueError, match="holds no number"):
        numeric({"answer": "none"}, "1")


def test_arithmetic_takes_the_first_number():
    assert arithmetic({"answer": "19"}, "19 and then 12+7=19") == 1.0
    assert arithmetic({"answer": "-25"}, "-25") == 1.0
    assert arithmetic({"answer": "19"}, "18") == 0.0


def test_numbers_read_the_unicode_minus_sign():
    # U+2212, as typographic or LaTeX-ish output writes it, is a minus, not nothing.
    assert numeric({"answer": "-5"}, "The answer is \u22125") == 1.0
    assert numeric({"answer": "5"}, "The answer is \u22125") == 0.0
    assert arithmetic({"answer": "-25"}, "\u221225") == 1.0


def test_numbers_compare_exactly_past_float_range_and_precision():
    big = "1" + "0" * 400  # a float would be inf, and inf - inf is NaN
    assert numeric({"answer": big}, big) == 1.0
    assert numeric({"answer": int(big)}, f"<answer>{big}</answer>") == 1.0
    assert numeric({"answer": big}, big + "0") == 0.0
    # 2**53 + 1 == 2**53 as floats: a wrong answer must not pass.
    assert arithmetic({"answer": str(2**53)}, str(2**53 + 1)) == 0.0
    assert arithmetic({"answer": 2**53 + 1}, str(2**53 + 1)) == 1.0
    assert numeric({"answer": str(2**53), "tolerance": 0}, str(2**53 + 1)) == 0.0
    # Floats from a record (a protobuf Struct) still match what is written.
    assert arithmetic({"answer": 0.1}, "0.1") == 1.0 and arithmetic({"answer": 42.0}, "42") == 1.0


def test_answer_extraction_is_linear_on_unclosed_tags():
    # Many opening tags and no closing one (a collapsed, repetitive completion): the
    # quadratic pattern took over 20 s on 160k characters; linear takes milliseconds.
    for completion in ("<answer>" * 20_000, "<answer>" * 10_000 + "1" * 80_000):
        start = time.perf_counter()
        numeric({"answer": "1"}, completion)
        assert time.perf_counter() - start < 1.0
    assert numeric({"answer": "2"}, "<answer>1 <answer>2</answer>") == 1.0


def test_countdown_checks_numbers_and_target():
    rec = {"numbers": [3, 5, 7, 2], "target": 24}
    assert countdown(rec, "(5+7)*2") == 1.0
    assert countdown(rec, "(5+7)*2 = 24\nbecause...") == 1.0
    assert countdown({"numbers": [8.0, 3.0, 8, 3], "target": 24.0}, "8/(3-8/3)") == 1.0  # exact
    assert countdown(rec, "(5+7)*2*1") == 0.0  # 1 is not given
    assert countdown(rec, "(5+7+5)") == 0.0  # 5 twice
    assert countdown(rec, "5+7") == 0.0  # wrong target
    assert countdown(rec, "3**2").metadata["reason"].startswith("invalid expression")
    assert countdown(rec, "__import__('os')").metadata["reason"].startswith("invalid")
    assert countdown(rec, "") == 0.0
    big = 2**53  # an int record is exact: 2**53 + 1 is not 2**53 (a float would say it is)
    assert countdown({"numbers": [big, 1], "target": big + 1}, "9007199254740992+1") == 1.0
    assert countdown({"numbers": [big, 1], "target": big}, "9007199254740992+1") == 0.0


def test_safe_math_refuses_everything_but_arithmetic():
    assert evaluate("2*(3+4) - 10 // 3 % 2") == 13 and format_number(evaluate("1/4")) == "0.25"
    for bad in ("a", "f(1)", "[1]", "1 if 1 else 2", "'s'", "True+1", "9**9**9", "1 < 2", "x.y"):
        with pytest.raises(UnsafeExpression):
            evaluate(bad)
    with pytest.raises(UnsafeExpression):
        evaluate("1" * 600)
    with pytest.raises(UnsafeExpression, match="ZeroDivisionError"):
        evaluate("1/0")


# ----- code execution ------------------------------------------------------------------------

ADD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"


def test_code_tests_fraction_passed_and_program_extraction():
    rec = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0"]}
    r = code_tests(rec, ADD)
    assert r == pytest.approx(2 / 3) and r.metadata["passed"] == 2 and r.metadata["tests"] == 3
    assert extract_program("no fence: x = 1") == "no fence: x = 1"
    assert code_tests({"test_list": "assert add(1, 1) == 2"}, ADD) == 1.0  # MBPP field name


def test_code_tests_timeout_crash_and_load_failure_score_zero_with_reason():
    rec = {"tests": ["assert f() == 1"], "time_limit_s": 1}
    slow = code_tests(rec, "def f():\n    while True:\n        pass")
    assert slow == 0.0 and slow.metadata["reason"] == "timeout"
    hog = code_tests(
        {"tests": ["assert f()"], "memory_limit_mb": 200}, "def f():\n    return bytearray(1 << 30)"
    )
    assert hog == 0.0 and hog.metadata["passed"] == 0  # MemoryError in the test: a failure
    broken = code_tests(rec, "def f(:")
    assert broken == 0.0 and broken.metadata["reason"] == "program failed to load"
    exiting = code_tests(rec, "import os\nos._exit(0)")
    assert exiting == 0.0 and exiting.metadata["reason"] == "no result"
    with pytest.raises(KeyError, match="no 'tests'"):
        code_tests({}, ADD)


def test_code_tests_verdict_cannot_be_forged_through_main_globals():
    # The program runs in the harness's interpreter: it used to read the result path from
    # `__main__`, write its own verdict and exit, for a reward of 100 / 2 = 50.0.
    record = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    forged = (
        "```python\n"
        "import sys, json, os\n"
        "m = sys.modules['__main__']\n"
        "json.dump({'loaded': True, 'passed': 100, 'failures': []}, open(m._result, 'w'))\n"
        "os._exit(0)\n"
        "```"
    )
    value = code_tests(record, forged)
    assert value == 0.0


def test_code_tests_harness_hides_its_names_source_and_builtins():
    program = (
        "import builtins, os, sys\n"
        "leaked = [n for n in vars(sys.modules['__main__']) if not n.startswith('__')]\n"
        "assert not leaked, leaked\n"
        "assert sorted(os.listdir('.')) == ['stderr', 'stdin', 'stdout'], os.listdir('.')\n"
        "builtins.exec = lambda *a, **k: None  # must not make every test pass\n"
    )
    r = code_tests({"tests": ["assert True", "assert False"]}, program)
    assert r == 0.5 and r.metadata["passed"] == 1, r.metadata


def test_code_tests_refuses_a_result_file_the_program_wrote():
    # Reaching the harness frame is possible in-process (see the module doc); a verdict
    # the program writes before the tests run is still refused.
    program = (
        "import json, sys\n"
        "names = sys._getframe(1).f_locals.values()\n"
        "name = next(v for v in names if isinstance(v, str) and v.startswith('result-'))\n"
        "with open(name, 'w') as f:\n"
        "    json.dump({'loaded': True, 'passed': 2, 'failed': 0, 'failures': []}, f)\n"
    )
    r = code_tests({"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}, program)
    assert r == 0.0 and r.metadata["reason"] == "exit 1", r.metadata


def test_code_tests_judges_simple_asserts_outside_the_sandbox():
    rec = {
        "tests": [
            "assert add(1, 2) == 3",
            "assert [4] == add([1], [4])[1:]",  # the literal on the left
            "assert math.isclose(add(0.1, 0.2), 0.3, rel_tol=1e-9)",
            "assert abs(add(1.0, 1e-12) - 1.0) < 1e-9",
            "assert add(1, 1) == 2 and add(2, 3) == 5",
            "assert add(1, 1)",  # truth: run inside (its expectation is inside EXPR)
            "x = add(2, 2)\nassert x == 4",  # two statements: run inside
        ]
    }
    r = code_tests(rec, ADD + "import math\n")
    assert r == 1.0 and r.metadata["judged_outside"] == 5, r.metadata
    wrong = {"tests": ["assert add(1, 1) == 3", "assert add(1, 1) == 2 and add(2, 2) == 5"]}
    assert code_tests(wrong, ADD) == 0.0
    in_order = ["seen.append(1)\nassert seen", "assert seen == [1]", "seen.append(2)\nassert 1"]
    assert code_tests({"tests": in_order}, "seen = []") == 1.0


def test_values_handed_back_compare_as_they_would_in_process():
    program = (
        "import numpy as np, collections\n"
        "P = collections.namedtuple('P', 'x y')\n"
        "def f():\n    return np.int64(5)\n"
        "def g():\n    return P(1, 2)\n"
        "def h():\n    return {'a': [1.5, (2, None)], 'b': {3}, 'c': b'z', 'd': 1 + 2j}\n"
        "def k():\n    return frozenset({1, 2})\n"
        "def b():\n    return bytearray(b'ab')\n"
        "def keys():\n    return {1: 2, 3: 4}.keys()\n"
        "def big():\n    return float('inf')\n"
        "def huge():\n    return 10 ** 40\n"
        "def bad():\n    return object()\n"
    )
    tests = [
        "assert f() == 5",
        "assert g() == (1, 2)",
        "assert h() == {'a': [1.5, (2, None)], 'b': {3}, 'c': b'z', 'd': 1 + 2j}",
        "assert k() == {1, 2}",
        "assert b() == b'ab'",
        "assert keys() == {1, 3}",
        "assert big() == 1e309",
        "assert huge() == 10000000000000000000000000000000000000000",
        "assert bad() == 1",
    ]
    r = code_tests({"tests": tests}, program)
    assert r.metadata["judged_outside"] == len(tests)
    assert r.metadata["failures"] == ["8: TypeError"], r.metadata
    assert r == pytest.approx(8 / 9)


def test_an_always_equal_answer_forges_no_test_judged_outside():
    """An object whose __eq__ always holds passed every `assert f(x) == y` in-process."""
    program = (
        "class Yes(int):\n"
        "    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\n"
        "    def __bool__(self):\n        return True\n"
        "def add(a, b):\n    return Yes(0)\n"
    )
    rec = {
        "tests": [
            "assert add(1, 2) == 3",
            "assert add(2, 2) == 4 and add(0, 0) == 0",
            "assert math.isclose(add(1, 1), 2.5)",
        ]
    }
    r = code_tests(rec, program + "import math\n")
    assert r == 0.0 and r.metadata["judged_outside"] == 3, r.metadata
    inside = {"tests": ["x = add(1, 2)\nassert x == 3"]}  # the same object, run inside
    assert code_tests(inside, program) == 1.0


def test_a_patched_isclose_forges_no_test_judged_outside():
    """`assert math.isclose(EXPR, LITERAL)` is compared here: patching math.isclose in the
    sandbox made every such test pass when the whole assert ran there."""
    program = "import math\nmath.isclose = lambda *a, **k: True\ndef area(r):\n    return 0\n"
    tests = [
        "assert math.isclose(area(2), 12.566, rel_tol=1e-3)",
        "assert abs(area(1) - 3.14) < 0.01",
    ]
    r = code_tests({"tests": tests}, program)
    assert r == 0.0 and r.metadata["judged_outside"] == 2, r.metadata


def test_what_the_sandbox_writes_into_the_metadata_is_bounded():
    """A program that reaches the harness could write megabytes into the failures it
    reports, and from there into every trajectory's metadata."""
    program = (
        "import sys\n"
        "def grow():\n"
        "    frame = sys._getframe(1)\n"
        "    while frame is not None and 'failures' not in frame.f_locals:\n"
        "        frame = frame.f_back\n"
        "    frame.f_locals['failures'][0] = 'x' * 2_000_000  # counts unchanged\n"
        "    return 0\n"
    )
    tests = ["x = 1\nassert x == 2", "assert grow() == 1"]
    r = code_tests({"tests": tests}, program)
    assert r == 0.0 and len(json.dumps(r.metadata)) < 2000, len(json.dumps(r.metadata))


def test_a_program_that_reads_the_harness_cannot_learn_what_a_test_judged_outside_wants():
    """The program walks the harness's frame for the tests' text and answers with their
    expected values: that forges the test run inside, never the one judged outside, whose
    expected value never enters the sandbox."""
    program = (
        "import ast, re, sys\n"
        "WANT = {}\n"
        "for v in sys._getframe(1).f_locals.values():\n"
        "    for item in v if isinstance(v, list) else ():\n"
        "        for text in item if isinstance(item, tuple) else (item,):\n"
        "            if isinstance(text, str) and '==' in text:\n"
        "                call, want = text.rsplit('==', 1)\n"
        "                for name in re.findall(r'secret\\(\\d+\\)', call):\n"
        "                    WANT[name] = ast.literal_eval(want.strip())\n"
        "def secret(n):\n"
        "    return WANT.get('secret(%d)' % n)\n"
    )
    rec = {"tests": ["assert secret(1) == 'zebra'", "r = secret(2)\nassert r == 'lion'"]}
    r = code_tests(rec, program)
    assert r == 0.5 and r.metadata["judged_outside"] == 1, r.metadata
    assert r.metadata["failures"] == ["0: mismatch"], r.metadata


@pytest.mark.parametrize(
    ("verdict", "want", "reason"),
    [
        ({"loaded": True, "passed": 2, "failed": 0, "values": {}}, 1.0, "ok"),
        ({"loaded": True, "passed": -1, "failed": 3, "values": {}}, 0.0, "ok"),  # clamped
        ({"loaded": True, "passed": 100, "values": {}}, 0.0, "inconsistent result"),
        ({"loaded": True, "passed": 100, "failed": -98, "values": {}}, 0.0, "inconsistent result"),
        ({"loaded": True, "passed": 3, "failed": 0, "values": {}}, 0.0, "inconsistent result"),
        ({"loaded": True, "passed": 1.5, "failed": 0.5, "values": {}}, 0.0, "inconsistent result"),
        ({"loaded": True, "passed": 2, "failed": 0}, 0.0, "inconsistent result"),  # no values
        ([1, 2], 0.0, "unreadable result"),
        ("[" * 5000, 0.0, "unreadable result"),
    ],
)
def test_code_tests_reward_is_a_fraction_of_consistent_counts(monkeypatch, verdict, want, reason):
    def fake_run(harness, *, limits, keep):
        raw = verdict if isinstance(verdict, str) else json.dumps(verdict)
        return SandboxResult("", "", 0, "ok", 0.0, files={keep[0]: raw})

    monkeypatch.setattr(code_tests_module, "run_python", fake_run)
    # Two statements each: run inside, counted by the harness.
    r = code_tests({"tests": ["x = f()\nassert x", "y = g()\nassert y"]}, "")
    assert 0.0 <= r <= 1.0
    assert r == want and r.metadata["reason"] == reason


# ----- lookup --------------------------------------------------------------------------------


def test_lookup_by_name_dotted_path_and_unknown():
    assert {"exact_match", "numeric", "arithmetic", "countdown", "code_tests"} <= set(
        known_rewards()
    )
    assert get_reward("numeric") is numeric
    # pytest imports this file under another module name: compare by behaviour.
    for path in ("tests.test_rewards:half_reward", "tests.test_rewards.half_reward"):
        fn = get_reward(path)
        assert fn.__name__ == "half_reward" and fn({}, "abc") == 0.5
    for name, why in [
        ("nope", "known: arithmetic"),
        ("no_such_pkg.mod:f", "cannot import no_such_pkg.mod"),
        ("tests.test_rewards:missing", "has no callable 'missing'"),
        ("tests.test_rewards:json", "has no callable 'json'"),
    ]:
        with pytest.raises(UnknownReward, match=why):
            get_reward(name)


def test_score_checks_the_value():
    assert score(half_reward, {}, "x") == (0.5, {})
    assert score(lambda r, c, **k: True, {}, "x") == (1.0, {})
    assert score(lambda r, c, **k: Scored(0.0, reason="r"), {}, "x") == (0.0, {"reason": "r"})
    with pytest.raises(ValueError, match="finite"):
        score(lambda r, c, **k: math.nan, {}, "x")
    with pytest.raises(TypeError, match="expected a float"):
        score(lambda r, c, **k: "1.0", {}, "x")


def test_score_makes_metadata_json_safe():
    # A reward using numpy used to make the trajectory's Struct.update raise, and with it
    # the whole group.
    def numpy_reward(record, completion, **context):
        return Scored(
            1.0,
            passed=np.int64(3),
            score=np.float32(0.5),
            ok=np.bool_(True),
            nested={1: [np.float64(0.25), (np.int32(2),)]},
            odd={1, 2},
            big=10**400,
            bad=math.nan,
        )

    value, meta = score(numpy_reward, {}, "x")
    assert value == 1.0
    assert meta == {
        "passed": 3,
        "score": 0.5,
        "ok": True,
        "nested": {"1": [0.25, [2]]},
        "odd": "{1, 2}",
        "big": str(10**400),
        "bad": "nan",
    }
    assert type(meta["passed"]) is int and type(meta["ok"]) is bool
    struct_pb2.Struct().update(meta)
    json.dumps(meta, allow_nan=False)


def test_reward_plugin_from_an_entry_point(tmp_path: Path, monkeypatch):
    entry_point_package(
        tmp_path,
        "astra-reward-plugin",
        "astra_reward_plugin_mod",
        "def always_quarter(record, completion, **context):\n    return 0.25\n",
        "astra.rewards",
        {"quarter_plugin": "astra_reward_plugin_mod:always_quarter"},
    )
    with pytest.raises(UnknownReward):
        get_reward("quarter_plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert get_reward("quarter_plugin")({}, "") == 0.25
        assert "quarter_plugin" in known_rewards()
    finally:
        REWARDS.remove("quarter_plugin")


# ----- synthetic tasks -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["arithmetic", "countdown"])
def test_tasks_are_seeded_and_their_answers_score_one(kind, tmp_path: Path):
    records = generate_records(kind, 200, seed=3)
    assert records == generate_records(kind, 200, seed=3) != generate_records(kind, 200, seed=4)
    reward = get_reward(kind)
    assert all(reward(r, r["answer"]) == 1.0 for r in records)
    assert all(isinstance(r["prompt"], str) and r["prompt"] for r in records)
    path = write_dataset(kind, tmp_path / "d" / f"{kind}.jsonl", 50, seed=1)
    loaded = load_records(path)
    assert loaded == generate_records(kind, 50, seed=1)
    # Records cross the wire as a protobuf Struct: numbers come back as floats.
    as_floats = json.loads(json.dumps(loaded[0]), parse_int=float)
    assert reward(as_floats, loaded[0]["answer"]) == 1.0


def test_task_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown task kind"):
        generate_records("sudoku", 1)
    with pytest.raises(ValueError, match="n must be"):
        generate_records("arithmetic", 0)


def test_which_tests_are_judged_outside_and_how_values_are_read_back():
    from astra.rewards.judged import checks_of, decode

    assert [c.expr for c in checks_of("assert f(1) == 2 and 3 == g()")] == ["f(1)", "g()"]
    (close,) = checks_of("assert math.isclose(area(2), 12.566, rel_tol=0.001)")
    assert (close.kind, close.expected, close.rel_tol) == ("isclose", 12.566, 0.001)
    assert close.holds(12.57) and not close.holds(13) and not close.holds("12.566")
    (bound,) = checks_of("assert abs(3.14 - pi_of(1)) <= 0.01")
    assert bound.kind == "abs<=" and bound.holds(3.145) and not bound.holds(3.2)
    for inside in (
        "assert f(1)",
        "assert not f(1)",
        "assert f(1) != 2",
        "assert f(1) == g(2)",
        "assert 1 == 1",
        "assert f(1) == 2 or f(2) == 3",
        "x = f(1)\nassert x == 2",
        "assert math.isclose(f(1), g(2))",
        "assert abs(f(1) - 2) < eps",
        "assert (",
    ):
        assert checks_of(inside) is None, inside
    good = ["d", [[["s", "k"], ["t", [["i", "-12"], ["f", "-inf"], ["y", "00ff"], ["n"]]]]]]
    assert decode(good) == {"k": (-12, float("-inf"), b"\x00\xff", None)}
    assert decode(["F", [["b", True]]]) == frozenset({True})
    deep = ["l", []]
    for _ in range(200):
        deep = ["l", [deep]]
    for bad in (
        ["x", 1],
        ["i", 5],
        ["i", "1.5"],
        ["f", "1e5;"],
        ["s", 1],
        ["y", "zz"],
        ["l", "ab"],
        ["d", [[["s", "a"]]]],
        [],
        "s",
        deep,
    ):
        with pytest.raises(ValueError):
            decode(bad)
    with pytest.raises(TypeError):
        decode(["S", [["l", []]]])  # an unhashable member


def test_sandboxed_code_cannot_reach_the_machines_services():
    """A policy's program could call a service of the machine it runs on (loopback) to
    fetch answers or do harm: it runs in a network namespace of its own."""
    import socket

    from astra.rewards.sandbox import SandboxLimits, no_network_prefix, run_python

    if not no_network_prefix():
        pytest.skip("this machine allows no network namespace (unshare refused)")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), 2).close()\n"
            "    print('reached')\n"
            "except OSError as exc:\n"
            "    print('cut off:', type(exc).__name__)\n"
        )
        cut = run_python(code)
        assert cut.ok and cut.network_isolated and cut.stdout.startswith("cut off"), cut
        allowed = run_python(code, limits=SandboxLimits(network=True))
        assert allowed.ok and not allowed.network_isolated and allowed.stdout == "reached\n"


def test_sandboxed_code_sees_only_its_directory_python_and_the_system(tmp_path):
    """A policy's program could read the dataset's answers, or the service's own code, or
    write into the Python every later sample runs on: it sees none of the machine's files but
    its own directory, a private /tmp and the Python installation, read-only; changing root
    again leads nowhere. `files=True` shows it the machine."""
    import shutil
    import subprocess
    import sys

    from astra.rewards.sandbox import SandboxLimits, own_files_prefix, run_python

    unshare = shutil.which("unshare")
    namespaces = [unshare, "--user", "--map-root-user", "--mount", "--net", "true"]
    if unshare is None or subprocess.run(namespaces, capture_output=True).returncode != 0:
        pytest.skip("this machine refuses user and mount namespaces (unshare)")
    # The machine allows them: the sandbox must use them (a failing view is no reason to skip).
    assert own_files_prefix(), "namespaces allowed, yet the sandbox could not build its view"
    secret = tmp_path / "answers.jsonl"
    secret.write_text('{"answer": "42"}\n')
    probe = f"astra-sandbox-probe-{os.getpid()}-{time.time_ns()}"  # never left in the venv
    code = (
        "import os, sys, json\n"
        "def can(f):\n"
        "    try:\n"
        "        f()\n"
        "        return True\n"
        "    except OSError:\n"
        "        return False\n"
        "seen = {\n"
        f"    'secret': can(lambda: open({str(secret)!r}).read()),\n"
        f"    'code': can(lambda: open({str(Path(__file__).resolve())!r}).read()),\n"
        "    'own': can(lambda: open('main.py').read()),\n"
        f"    'python_written': can(lambda: open(os.path.join(sys.prefix, {probe!r}), 'w').close()),\n"
        "    'tmp': can(lambda: open('/tmp/t', 'w').write('x')),\n"
        "    'proc': os.path.exists('/proc/self'),\n"
        "}\n"
        "import numpy\n"  # the Python installation's packages still import
        "home = os.getcwd()\n"
        "os.mkdir('x'); os.chroot('x')\n"
        "for _ in range(32): os.chdir('..')\n"
        "os.chroot('.')\n"
        f"seen['secret_after_chroot'] = os.path.exists({str(secret)!r})\n"
        "os.chdir(home)\n"
        "open('out.json', 'w').write(json.dumps(seen))\n"
    )
    try:
        hidden = run_python(code, keep=("out.json",))
    finally:
        written = Path(sys.prefix) / probe
        leaked = written.exists()
        written.unlink(missing_ok=True)
    assert hidden.ok and hidden.files_isolated and hidden.network_isolated and not leaked, hidden
    assert json.loads(hidden.files["out.json"]) == {
        "secret": False,
        "code": False,
        "own": True,
        "python_written": False,
        "tmp": True,
        "proc": False,
        "secret_after_chroot": False,
    }
    shown = run_python(f"print(open({str(secret)!r}).read())", limits=SandboxLimits(files=True))
    assert shown.ok and not shown.files_isolated and shown.stdout.startswith('{"answer"'), shown


def test_root_without_cap_sys_admin_still_cuts_the_network(tmp_path):
    """Root in a container usually lacks CAP_SYS_ADMIN: `unshare --net` is refused there, a
    user namespace of its own is not."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop CAP_SYS_ADMIN")
    probe = (
        "from astra.rewards.sandbox import no_network_prefix, run_python\n"
        "r = run_python('import socket\\nsocket.create_connection((\"127.0.0.1\", 9), 1)')\n"
        "print(no_network_prefix()[1:], r.network_isolated, 'unreachable' in r.stderr)\n"
    )
    drop = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin"]
    out = subprocess.run([*drop, sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["('--user',", "'--map-root-user',", "'--net')", "True", "True"]


def test_a_sandbox_that_cannot_start_raises_instead_of_scoring_the_code(monkeypatch):
    """A refused namespace at run time (user namespaces exhausted, say) is no failure of the
    policy's program: it must not score 0. Code that fails on its own still scores."""
    import astra.rewards.sandbox as sandbox

    monkeypatch.setattr(sandbox, "isolation", lambda limits: (("/bin/false",), True, True))
    with pytest.raises(sandbox.SandboxUnavailable, match="did not start"):
        sandbox.run_python("print(1)")
    with pytest.raises(sandbox.SandboxUnavailable):
        code_tests({"tests": ["assert add(1, 2) == 3"]}, ADD)
    monkeypatch.setattr(sandbox, "isolation", lambda limits: ((), False, False))
    own = sandbox.run_python("import sys\nsys.stderr.write('unshare: no\\n')\nsys.exit(1)")
    assert own.reason == "exit 1"  # it ran: its own failure, whatever it prints


def test_the_sandbox_runs_in_a_process_whose_standard_streams_are_closed():
    """The launcher's pipe once landed on fd 0/1 there, under the code's stdout: every run
    then looked like a sandbox that could not start."""
    import subprocess
    import sys

    probe = (
        "import os\n"
        "from astra.rewards.sandbox import run_python\n"
        "os.close(0)\nos.close(1)\n"
        "r = run_python(\"print('hi')\")\n"
        "os.write(2, f'{r.reason} {r.stdout!r}'.encode())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr.endswith("ok 'hi\\n'"), out.stderr


def test_the_python_tool_fails_the_sample_when_the_sandbox_cannot_start(monkeypatch):
    import asyncio

    import astra.rewards.sandbox as sandbox
    from astra.workflows.tools import run_tool

    assert asyncio.run(run_tool("python", "print(2 + 2)")).output == "4\n"
    monkeypatch.setattr(sandbox, "isolation", lambda limits: (("/bin/false",), True, True))
    with pytest.raises(sandbox.SandboxUnavailable):
        asyncio.run(run_tool("python", "print(2 + 2)"))
