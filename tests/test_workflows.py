"""Workflows against `ScriptedTestEngine`: sequence arrays, masks and versions; tool use;
tools and their limits; multi-agent tagging and rewards; failures reported, never dropped;
registry and entry-point plugins."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest

from astra.engine.api import Generation, Sampling
from astra.engine.validate import check_request
from astra.raas.backend import GroupSpec, TrajectorySpec
from astra.rewards import get_reward
from astra.rewards.safe_math import UnsafeExpression
from astra.rewards.sandbox import SandboxLimits
from astra.workflows import (
    WORKFLOWS,
    WorkflowContext,
    get_workflow,
    known_workflows,
    register_workflow,
    run_episode,
    run_tool,
    sample_seed,
)
from astra.workflows.registry import UnknownWorkflow
from astra.workflows.tools import PythonTool, ToolError, calculator, parse_tool_call
from tests.conftest import entry_point_package


def run(coro, timeout_s: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


class ByteTokenizer:
    """Token id = UTF-8 byte + 1; 0 is end-of-sequence."""

    eos_id = 0
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 1 for i in ids if i > 0).decode(errors="replace")


Script = Callable[[str, str, Sampling], str]


class ScriptedTestEngine:
    """An `InferenceEngine` that answers from a script, to steer workflow logic. Not a model.

    `script(policy_id, prompt_text, sampling)` gives the continuation; stop strings
    (kept in the text, as the proto says) and max_new_tokens cut it like an engine
    would. Every token gets log-prob -0.5 and the policy's current version.
    `keep_stop=False` imitates engines that drop the stop string. `delay(sampling)`
    sleeps before answering; `fail_finish=True` reports finish_reason "error".
    `max_seq_len` is the context it reports and enforces as engines do (check_request).
    """

    name = "scripted-test"

    def __init__(
        self,
        script: Script,
        policy_ids: tuple[str, ...] = ("policy",),
        *,
        versions: Mapping[str, int] | None = None,
        keep_stop: bool = True,
        delay: Callable[[Sampling], float] | None = None,
        fail_finish: bool = False,
        max_seq_len: int = 2**31 - 1,
    ) -> None:
        self.script = script
        self.limit = max_seq_len
        self.policy_ids = policy_ids
        self._tok = ByteTokenizer()
        self._versions = {p: 0 for p in policy_ids} | dict(versions or {})
        self.keep_stop = keep_stop
        self.delay = delay
        self.fail_finish = fail_finish
        self.calls: list[tuple[str, str, Sampling]] = []
        self.swaps: list[tuple[dict, dict]] = []
        self.in_flight = self.max_in_flight = 0
        self.closed = False

    def tokenizer(self, policy_id: str) -> ByteTokenizer:
        return self._tok

    def version(self, policy_id: str) -> int:
        return self._versions[policy_id]

    def max_seq_len(self, policy_id: str) -> int:
        return self.limit

    async def generate(self, policy_id: str, prompt_ids: list[int], sampling: Sampling):
        check_request(prompt_ids, sampling, vocab_size=self._tok.vocab_size, max_seq_len=self.limit)
        prompt = self._tok.decode(prompt_ids)
        self.calls.append((policy_id, prompt, sampling))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay is not None:
                await asyncio.sleep(self.delay(sampling))
            text = self.script(policy_id, prompt, sampling)
        finally:
            self.in_flight -= 1
        finish = "stop"
        ends = [text.find(s) + len(s) for s in sampling.stop_strings if s in text]
        if ends:
            end = min(ends)
            stop = next(s for s in sampling.stop_strings if text[:end].endswith(s))
            text = text[:end] if self.keep_stop else text[: end - len(stop)]
        ids = self._tok.encode(text)
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        if self.fail_finish:
            finish = "error"
        n = len(ids)
        version = self._versions[policy_id]
        return Generation(ids, [-0.5] * n, [version] * n, finish, text=self._tok.decode(ids))

    async def swap_weights(self, versions, state) -> None:
        self.swaps.append((dict(versions), {p: dict(s) for p, s in state.items()}))
        self._versions.update(versions)

    async def close(self) -> None:
        self.closed = True


def make_group(prompt="1+1=", *, n=1, tokens=32, policies=("policy",), **kw) -> GroupSpec:
    data = kw.pop("data", {"answer": "2"})
    return GroupSpec(
        group_id=kw.pop("group_id", "g"),
        workflow=kw.pop("workflow", "single_turn"),
        policy_ids=policies,
        num_samples=n,
        max_new_tokens=tokens,
        prompt_text=prompt,
        data=data,
        **kw,
    )


def context(engine, group: GroupSpec, *, reward="numeric", i=0, **options) -> WorkflowContext:
    return WorkflowContext(
        group=group,
        sample_index=i,
        engine=engine,
        reward_fn=get_reward(reward),
        reward_name=reward,
        workflow=group.workflow,
        options=options,
    )


def episode(engine, group, **kw) -> TrajectorySpec:
    return run(run_episode(get_workflow(group.workflow), context(engine, group, **kw)))


# ----- single turn ---------------------------------------------------------------------------


def test_single_turn_arrays_masks_versions_and_reward():
    engine = ScriptedTestEngine(lambda p, prompt, s: "2", versions={"policy": 3})
    t = episode(engine, make_group(temperature=0.7, top_p=0.0, seed=5, stop_strings=("\n",)))
    assert t.error is None and t.reward == 1.0 and len(t.sequences) == 1
    s = t.sequences[0]
    assert s.policy_id == "policy" and s.agent_id == "" and s.prompt_length == 4
    assert s.token_ids.dtype == np.int32 and s.token_ids.tolist() == ByteTokenizer().encode("1+1=2")
    assert s.loss_mask.dtype == np.uint8 and s.loss_mask.tolist() == [0, 0, 0, 0, 1]
    assert s.logprobs.dtype == np.float32 and s.logprobs.tolist() == [0, 0, 0, 0, -0.5]
    assert s.weight_versions.dtype == np.int64
    assert s.weight_versions.tolist() == [-1, -1, -1, -1, 3]
    assert s.finish_reason == "stop" and s.reward == 1.0
    sampling = engine.calls[0][2]
    assert (
        sampling.temperature == 0.7 and sampling.top_p == 1.0 and sampling.stop_strings == ("\n",)
    )
    assert sampling.seed == sample_seed(make_group(seed=5), 0) and sampling.seed is not None


def test_single_turn_length_finish_pretokenised_prompt_and_wrong_answer():
    engine = ScriptedTestEngine(lambda p, prompt, s: "345")
    ids = np.asarray(ByteTokenizer().encode("9+9="), dtype=np.int32)
    t = episode(engine, make_group("", tokens=2, prompt_token_ids=ids, data={"answer": 18}))
    s = t.sequences[0]
    assert engine.calls[0][1] == "9+9=" and s.prompt_length == 4
    assert s.finish_reason == "length" and s.loss_mask.sum() == 2 and t.reward == 0.0


def test_sample_seeds_differ_per_sample_and_none_when_unseeded():
    g = make_group(seed=11)
    seeds = {sample_seed(g, i) for i in range(64)}
    assert len(seeds) == 64 and all(0 < s < 2**31 for s in seeds)
    assert sample_seed(g, 3) == sample_seed(make_group(seed=11), 3)
    assert sample_seed(make_group(seed=0), 3) is None


# ----- multi-turn tools ----------------------------------------------------------------------


def tool_script(call: str, answer: str = "So the answer is 14.") -> Script:
    def script(policy_id: str, prompt: str, sampling: Sampling) -> str:
        return answer if "<result>" in prompt else f"Let me compute. {call} and more"

    return script


@pytest.mark.parametrize("keep_stop", [True, False])
def test_multi_turn_masks_observation_and_feeds_result_back(keep_stop):
    engine = ScriptedTestEngine(
        tool_script('<tool name="calculator">2*(3+4)</tool>'), keep_stop=keep_stop
    )
    g = make_group(
        "Q: 2*(3+4)? ", workflow="multi_turn_tools", data={"answer": "14"}, seed=1, tokens=256
    )
    t = episode(engine, g)
    assert t.error is None and t.reward == 1.0
    assert t.metadata["tool_calls"] == ["calculator"] and t.metadata["turns"] == 2
    assert "</tool>" in engine.calls[0][2].stop_strings
    second_prompt = engine.calls[1][1]
    assert second_prompt.endswith('<tool name="calculator">2*(3+4)</tool><result>14</result>')
    assert engine.calls[0][2].seed != engine.calls[1][2].seed
    s = t.sequences[0]
    tok = ByteTokenizer()
    text = tok.decode(s.token_ids.tolist())
    assert text == second_prompt + "So the answer is 14."
    obs = "<result>14</result>" if keep_stop else "</tool><result>14</result>"
    start = text.index(obs)
    span = slice(start, start + len(obs))  # one byte per token
    assert s.loss_mask[span].tolist() == [0] * len(obs)
    assert s.weight_versions[span].tolist() == [-1] * len(obs)
    assert s.logprobs[span].tolist() == [0.0] * len(obs)
    generated = len(text) - s.prompt_length - len(obs)
    assert int(s.loss_mask.sum()) == generated
    assert s.loss_mask[: s.prompt_length].sum() == 0 and s.loss_mask[-1] == 1
    assert (s.weight_versions[s.loss_mask == 1] == 0).all()


def test_multi_turn_tool_errors_are_observations_and_max_turns_bounds():
    engine = ScriptedTestEngine(lambda p, prompt, s: '<tool name="nope">x</tool>')
    g = make_group("Q ", workflow="multi_turn_tools", data={"answer": "1"}, tokens=256)
    t = episode(engine, g, max_turns=3)
    assert t.error is None and len(engine.calls) == 3 and t.metadata["ended"] == "max_turns"
    assert "<result>error: unknown tool 'nope' (known: calculator, python" in engine.calls[1][1]
    assert t.metadata["tool_errors"] == 2 and t.reward == 0.0


def test_multi_turn_token_budget_covers_the_whole_episode():
    engine = ScriptedTestEngine(lambda p, prompt, s: '<tool name="calculator">1+1</tool>')
    g = make_group("Q ", workflow="multi_turn_tools", tokens=60)
    t = episode(engine, g, max_turns=10)
    budgets = [c[2].max_new_tokens for c in engine.calls]
    assert budgets[0] == 60 and all(b > 0 for b in budgets) and sorted(budgets, reverse=True)
    assert int(t.sequences[0].loss_mask.sum()) <= 60


CALL = '<tool name="calculator">1+1</tool>'  # 34 tokens; its observation <result>2</result>: 18


def test_multi_turn_later_turns_fit_the_engine_context():
    """Turn 2 asked for the whole remaining budget on top of prompt + turn 1 + observation, past
    the engine's max_seq_len: refused, and the whole episode (turn 1 too) became an error."""

    def script(policy_id: str, prompt: str, sampling: Sampling) -> str:
        return "So 2." if "<result>" in prompt else CALL

    engine = ScriptedTestEngine(script, max_seq_len=80)
    g = make_group("Q: 1+1? ", workflow="multi_turn_tools", tokens=72)  # 8 + 72 = 80 fits
    t = episode(engine, g)
    assert t.error is None and t.reward == 1.0 and t.metadata["ended"] == "answer"
    assert [c[2].max_new_tokens for c in engine.calls] == [72, 80 - (8 + 34 + 18)]
    assert len(t.sequences[0].token_ids) == 8 + 34 + 18 + 5 <= 80

    # An observation that would leave no room for a model token is not appended: "length".
    engine = ScriptedTestEngine(script, max_seq_len=8 + 34 + 18)
    t = episode(engine, make_group("Q: 1+1? ", workflow="multi_turn_tools", tokens=52))
    assert t.error is None and t.metadata["ended"] == "length" and len(engine.calls) == 1
    assert t.metadata["tool_calls"] == [] and t.metadata["turns"] == 1
    assert ByteTokenizer().decode(t.sequences[0].token_ids.tolist()) == "Q: 1+1? " + CALL


def test_multi_turn_near_the_torch_engine_context_is_not_an_error():
    """The same through the built-in engine's own checks (turn 1 is scripted: the tiny random
    model cannot be steered into a tool call)."""
    from astra.engine.tiny import load_model
    from astra.engine.torch_engine import TorchEngine

    class FirstTurnScripted:
        name = "first-turn-scripted"

        def __init__(self, inner: TorchEngine) -> None:
            self.inner, self.policy_ids, self.calls = inner, inner.policy_ids, 0
            self.tokenizer, self.version = inner.tokenizer, inner.version
            self.max_seq_len = inner.max_seq_len

        async def generate(self, policy_id, prompt_ids, sampling):
            self.calls += 1
            if self.calls > 1:
                return await self.inner.generate(policy_id, prompt_ids, sampling)
            ids = self.tokenizer(policy_id).encode(CALL)
            n = len(ids)
            return Generation(ids, [-0.1] * n, [0] * n, "stop", text=CALL, meta={"stop": "</tool>"})

    async def main() -> TrajectorySpec:
        model, tok = load_model("tiny")
        inner = TorchEngine({"p": (model, tok)}, max_seq_len=64)
        engine = FirstTurnScripted(inner)
        g = make_group(
            "Q: 1+1? ", workflow="multi_turn_tools", policies=("p",), tokens=56, temperature=0.0
        )
        try:
            return await run_episode(get_workflow(g.workflow), context(engine, g))
        finally:
            await inner.close()

    t = run(main(), 60.0)
    assert t.error is None, t.error
    assert t.metadata["tool_calls"] == ["calculator"] and t.metadata["turns"] == 2
    assert len(t.sequences[0].token_ids) <= 64


class EosEngine:
    """Answers turn 1 with `first` then eos, as the torch engine reports an eos stop: the eos
    id kept as the last token, the text without it, meta["stop"] the eos id."""

    name = "eos-test"
    policy_ids = ("policy",)

    def __init__(self, first: str) -> None:
        self.first = first
        self.calls: list[list[int]] = []
        self._tok = ByteTokenizer()

    def tokenizer(self, policy_id: str) -> ByteTokenizer:
        return self._tok

    def version(self, policy_id: str) -> int:
        return 0

    async def generate(self, policy_id: str, prompt_ids: list[int], sampling: Sampling):
        self.calls.append(list(prompt_ids))
        text = self.first if len(self.calls) == 1 else "2"
        ids = [*self._tok.encode(text), self._tok.eos_id]
        n = len(ids)
        meta = {"stop": self._tok.eos_id}
        return Generation(ids, [-0.1] * n, [0] * n, "stop", text=text, meta=meta)


@pytest.mark.parametrize("first", ['<tool name="calculator">1+1', CALL])
def test_multi_turn_a_turn_ended_by_eos_ends_the_episode(first):
    """A call (left open, or closed by an engine that ignored the stop string) in a turn the
    model ended with eos was run, its observation appended after the eos, and generation went
    on past the model's own end."""
    engine = EosEngine(first)
    t = episode(engine, make_group("Q: ", workflow="multi_turn_tools", tokens=100))
    assert t.error is None and len(engine.calls) == 1
    assert t.metadata["tool_calls"] == [] and t.metadata["ended"] == "answer"
    ids = t.sequences[0].token_ids.tolist()
    assert ids.index(ByteTokenizer.eos_id) == len(ids) - 1


def test_parse_tool_call():
    call = parse_tool_call('x <tool name="python">print(1)</tool> y', stopped=False)
    assert call is not None and call.name == "python" and call.argument == "print(1)"
    assert parse_tool_call('<tool name="calculator">1+', stopped=False) is None
    open_call = parse_tool_call('<tool name="calculator">1+', stopped=True)
    assert open_call is not None and not open_call.closed and open_call.argument == "1+"
    assert parse_tool_call("no call here", stopped=True) is None


def test_calculator_computes_arithmetic_and_refuses_everything_else():
    assert (
        calculator("2*(3+4)") == "14" and calculator("7/2") == "3.5" and calculator("-2**3") == "-8"
    )
    for bad in ("__import__('os').system('true')", "x+1", "len('ab')", "2**10**10", "(1).real"):
        with pytest.raises(UnsafeExpression):
            calculator(bad)
    result = run(run_tool("calculator", "open('/etc/passwd')"))
    assert not result.ok and result.output.startswith("error: UnsafeExpression")
    assert run(run_tool("calculator", "1/0")).output.startswith("error: ")


def test_python_tool_output_and_time_and_memory_limits():
    tool = PythonTool(SandboxLimits(time_s=1.0, memory_bytes=256 << 20, output_chars=64))
    assert run(tool("print(6*7)")) == "42\n"
    start = time.monotonic()
    with pytest.raises(ToolError, match="timeout"):
        run(tool("while True:\n    pass"))
    assert time.monotonic() - start < 3.0
    with pytest.raises(ToolError, match="memory"):
        run(tool("x = bytearray(1 << 30)\nprint(len(x))"))
    assert len(run(tool("print('x' * 10000)"))) == 64
    failed = run(run_tool("python", "raise ValueError('boom')"))
    assert not failed.ok and "ValueError: boom" in failed.output


# ----- multi-agent ---------------------------------------------------------------------------


def agents_script(answer: str, verdict: str) -> Script:
    def script(policy_id: str, prompt: str, sampling: Sampling) -> str:
        return verdict if policy_id == "checker" else answer

    return script


@pytest.mark.parametrize(
    ("answer", "verdict", "team", "verifier"),
    [
        ("It is 14", "correct", 1.0, 1.0),
        ("It is 13", "correct", 0.0, 0.0),
        ("It is 13", "Incorrect.", 0.0, 1.0),
        ("It is 14", "maybe", 1.0, 0.0),
    ],
)
def test_multi_agent_tags_sequences_and_scores_team_and_agents(answer, verdict, team, verifier):
    engine = ScriptedTestEngine(
        agents_script(answer, verdict), ("solver_p", "checker"), versions={"checker": 7}
    )
    g = make_group(
        "What is 2*7?",
        workflow="multi_agent",
        policies=("solver_p", "checker"),
        data={"answer": 14},
    )
    t = episode(engine, g)
    assert t.error is None and t.reward == team
    solver, checker = t.sequences
    assert (solver.policy_id, solver.agent_id) == ("solver_p", "solver")
    assert (checker.policy_id, checker.agent_id) == ("checker", "verifier")
    assert solver.reward == team and checker.reward == verifier
    assert t.agent_rewards["solver"] == team and t.agent_rewards["verifier"] == verifier
    assert t.agent_rewards["solver_p"] == team and t.agent_rewards["checker"] == verifier
    verifier_prompt = engine.calls[1][1]
    assert "What is 2*7?" in verifier_prompt and answer in verifier_prompt
    assert checker.loss_mask[: checker.prompt_length].sum() == 0
    assert set(checker.weight_versions[checker.loss_mask == 1].tolist()) == {7}


def test_multi_agent_with_one_policy_plays_both_roles():
    engine = ScriptedTestEngine(lambda p, prompt, s: "correct" if "Verdict" in prompt else "14")
    g = make_group("2*7?", workflow="multi_agent", data={"answer": "14"})
    t = episode(engine, g)
    assert [s.agent_id for s in t.sequences] == ["solver", "verifier"]
    assert {s.policy_id for s in t.sequences} == {"policy"}
    assert t.agent_rewards == {"solver": 1.0, "verifier": 1.0}


# ----- failures are reported -----------------------------------------------------------------


def raising_reward(record, completion, **context):
    raise ValueError("bad record")


def test_raising_reward_engine_error_and_workflow_bug_set_error():
    engine = ScriptedTestEngine(lambda p, prompt, s: "2")
    t = episode(engine, make_group(), reward="tests.test_workflows:raising_reward")
    assert t.error is not None and t.error.startswith("RewardFailed:")
    assert "ValueError: bad record" in t.error and t.sequences == [] and t.reward == 0.0
    broken = ScriptedTestEngine(lambda p, prompt, s: "2", fail_finish=True)
    assert episode(broken, make_group()).error.startswith("GenerationFailed:")
    crashing = ScriptedTestEngine(lambda p, prompt, s: str(1 / 0))
    t = episode(crashing, make_group(), i=0)
    assert t.error is not None and t.error.startswith("ZeroDivisionError") and t.sample_index == 0


def test_workflow_returning_junk_is_an_error():
    @register_workflow("test_junk")
    async def junk(ctx):
        return {"not": "a trajectory"}

    try:
        engine = ScriptedTestEngine(lambda p, prompt, s: "")
        t = episode(engine, make_group(workflow="test_junk"))
        assert t.error is not None and "TypeError" in t.error
    finally:
        WORKFLOWS.remove("test_junk")


# ----- registry ------------------------------------------------------------------------------


def test_registry_lookup_lists_known_names_and_refuses_duplicates():
    assert {"single_turn", "multi_turn_tools", "multi_agent"} <= set(known_workflows())
    with pytest.raises(UnknownWorkflow, match=re.escape("known: ")) as info:
        get_workflow("nope")
    assert "single_turn" in str(info.value) and "'nope'" in str(info.value)
    with pytest.raises(ValueError, match="already registered"):
        register_workflow("single_turn")(object())


def test_workflow_plugin_from_an_entry_point(tmp_path: Path, monkeypatch):
    source = (
        "from astra.raas.backend import TrajectorySpec\n"
        "class Echo:\n"
        "    default_reward = 'exact_match'\n"
        "    async def run(self, ctx):\n"
        "        return TrajectorySpec(ctx.sample_index, [], 0.5)\n"
    )
    entries = {
        "echo_plugin": "astra_wf_plugin_mod:Echo",
        "broken_plugin": "astra_wf_plugin_mod:Missing",
    }
    entry_point_package(
        tmp_path, "astra-wf-plugin", "astra_wf_plugin_mod", source, "astra.workflows", entries
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        wf = get_workflow("echo_plugin")
        assert wf.default_reward == "exact_match" and "echo_plugin" in known_workflows()
        t = episode(ScriptedTestEngine(lambda *a: ""), make_group(workflow="echo_plugin"))
        assert t.error is None and t.reward == 0.5
        with pytest.raises(UnknownWorkflow, match="failed to load: AttributeError"):
            get_workflow("broken_plugin")
    finally:
        WORKFLOWS.remove("echo_plugin")


def test_verifier_warmup_records_judge_right_answers_and_near_misses() -> None:
    from astra.workflows.multi_agent import VERIFIER_TEMPLATE, SolverVerifier, parse_verdict

    records = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(200)]
    assert SolverVerifier.warmup_records(records, 0, 1) is records  # the solver: the task's own
    out = SolverVerifier.warmup_records(records, 1, 1)
    assert out == SolverVerifier.warmup_records(records, 1, 1)  # seeded
    verdicts = []
    for r, v in zip(records, out, strict=True):
        worked, verdict = v["answer"].split(" ")
        assert worked == r["answer"]  # the verifier works the problem out first
        proposed = v["prompt"].split("Proposed answer:\n")[1].split("\n")[0]
        assert v["prompt"] == VERIFIER_TEMPLATE.format(problem=r["prompt"], answer=proposed)
        assert parse_verdict(v["answer"]) == (proposed == r["answer"])
        verdicts.append(verdict)
    assert 60 < verdicts.count("correct") < 140


def test_multi_agent_verifier_turn_fits_the_context_whatever_the_answer():
    # The verifier's prompt carries the solver's answer: a long answer pushed it past the
    # engine's context, the engine refused, and the whole episode (the solver's turn too)
    # became an error.
    from astra.workflows.multi_agent import VERIFIER_TEMPLATE

    answer = "14" + " and so on" * 6  # 62 bytes: within max_new_tokens
    verifier_prompt = VERIFIER_TEMPLATE.format(problem="2*7?", answer=answer)

    def script(p, prompt, s):
        return "correct" if "Verdict" in prompt or prompt == verifier_prompt else answer

    g = make_group("2*7?", workflow="multi_agent", data={"answer": "14"}, tokens=64)
    tight = ScriptedTestEngine(script, max_seq_len=len(verifier_prompt.encode()) + 3)
    t = episode(tight, g)
    assert t.error is None and t.agent_rewards["solver"] == 1.0  # the solver's turn is kept
    assert tight.calls[1][2].max_new_tokens == 3  # clamped to the room left
    no_room = ScriptedTestEngine(script, max_seq_len=len(verifier_prompt.encode()))
    t = episode(no_room, g)
    assert t.error is None and len(no_room.calls) == 1  # no verifier call at all
    assert t.metadata["verdict"] == "none" and "no room" in t.metadata["verifier"]
    assert t.agent_rewards["verifier"] == 0.0 and len(t.sequences) == 2
