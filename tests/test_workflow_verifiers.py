"""Workflow `verifiers`: environments built here with `verifiers.v1` (a taskset from rows in
memory, its rewards, a chat harness, a multi-turn env answering the model's turn) play through
the RaaS's agent endpoint on the tiny engine; the recorded tokens are the trajectory, the
environment's rewards its reward, and a short `astra run` trains on them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "verifiers.v1", reason="verifiers 0.4 is not here: it runs in .venv-verifiers (make verifiers)"
)

from astra.agents.endpoint import AgentEndpoint, Gateway
from astra.agents.recorder import Episode, Episodes
from astra.engine.chat import ChatTemplate
from astra.engine.tiny import load_model
from astra.engine.torch_engine import TorchEngine
from astra.raas.backend import GroupSpec
from astra.raas.engine_backend import EngineBackend
from astra.servers.agent_http import AgentHTTPServer
from astra.workflows.episode import generated_text
from astra.workflows.verifiers_env import task_records, write_task_records

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# A taskset from rows in memory, two rewards, and a harness that chats in-process (verifiers'
# own harnesses install programs with uv, which this machine cannot fetch).
TASKSET = """
from openai import AsyncOpenAI
import verifiers.v1 as vf

ROWS = [(12, 34), (5, 6), (40, 2)]


class AddData(vf.TaskData):
    answer: str


class AddTask(vf.Task[AddData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward
    async def brevity(self, trace: vf.Trace) -> float:
        return len(trace.last_reply) / 100


class AddTaskset(vf.Taskset[AddTask, vf.TasksetConfig]):
    def load(self):
        return [AddTask(AddData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
                for a, b in ROWS]


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    SUPPORTS_RESUME = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                     tool_interception_url=None):
        _, prompt = self.resolve_prompt(data)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True)
                        for m in prompt]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(0, reply.choices[0].message.content or "", "")
"""
SINGLE = TASKSET + '\n__all__ = ["AddTaskset", "ChatHarness"]\n'
MULTI = (
    TASKSET
    + """

class GuessConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessConfig]):  # answers the model's first turn; the model tries again
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            first = await chat.turn()
            await chat.turn(f"not {first.last_reply!r}; again")


__all__ = ["AddTaskset", "ChatHarness", "GuessEnv"]
"""
)


def env_config(module: str) -> dict[str, Any]:  # the agent on this machine, no sandbox
    return {"taskset": {"id": module}, "agent": {"runtime": {"type": "subprocess"}}}


@pytest.fixture
def modules(tmp_path, monkeypatch) -> Path:
    (tmp_path / "astra_vf_single.py").write_text(SINGLE)
    (tmp_path / "astra_vf_multi.py").write_text(MULTI)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def play(module: str, task: int, n: int = 2) -> tuple[list, list[Episode], Any]:
    async def body() -> tuple[list, list[Episode], Any]:
        model, tok = load_model("tiny")
        tok.chat_template = ChatTemplate(TEMPLATE, {}, "test")
        engine = TorchEngine({"policy": (model, tok)})
        kept, opened, open_one = Episodes(), [], Episodes.open  # each episode kept once closed
        kept.open = lambda *a, **k: opened.append(open_one(kept, *a, **k)) or opened[-1]
        server = await AgentHTTPServer(AgentEndpoint(engine, kept)).start()
        backend = EngineBackend(
            engine, ["verifiers"], agents=Gateway(server.base_url, kept),
            workflow_options={"verifiers": {"env": env_config(module)}},
        )  # fmt: skip
        group = GroupSpec(
            group_id="g/1", workflow="verifiers", policy_ids=("policy",), num_samples=n,
            max_new_tokens=5, temperature=1.0, seed=7, prompt_text="12+34=",
            data={"prompt": "12+34=", "task": task},
        )  # fmt: skip
        try:
            out = await backend.generate(group, {"policy": 0})
            assert len(kept) == 0  # every episode closed
            return out, opened, tok
        finally:
            await server.stop()
            await engine.close()

    return asyncio.run(asyncio.wait_for(body(), 120))


def test_a_single_turn_env_s_call_is_the_trajectory_and_its_rewards_the_reward(modules) -> None:
    out, episodes, tok = play("astra_vf_single", task=1, n=4)
    # four samples at once, one env (its serving resources shared: `Loaded.serving`)
    assert [t.error for t in out] == [None] * 4 and len(episodes) == 4
    assert [len(e.calls) for e in episodes] == [1] * 4
    recorded = {(*c.prompt_ids, *c.generation.token_ids): c for e in episodes for c in e.calls}
    for t in out:
        assert t.metadata["calls"] == 1 and t.metadata["task"] == 1
        (seq,) = t.sequences
        call = recorded[tuple(seq.token_ids.tolist())]  # exact: a recorded call, token for token
        gen = call.generation
        assert seq.token_ids.tolist() == [*call.prompt_ids, *gen.token_ids]  # exact, recorded
        assert seq.loss_mask.tolist() == [0] * len(call.prompt_ids) + [1] * len(gen.token_ids)
        assert np.allclose(seq.logprobs[seq.prompt_length :], gen.logprobs)
        assert tok.decode(list(call.prompt_ids)) == "user: 5+6=\nassistant: "
        reply = generated_text(gen, tok).strip()
        assert t.reward == pytest.approx(float(reply == "11") + len(reply) / 100)
        assert seq.reward == t.reward


def test_a_multi_turn_env_s_answer_is_masked_and_both_model_turns_trained(modules) -> None:
    out, episodes, tok = play("astra_vf_multi", task=0, n=1)
    ((t,), (episode,)) = out, episodes
    assert t.error is None and t.metadata["calls"] == 2
    first, second = episode.calls
    (seq,) = t.sequences  # the second call continues the first: one sequence
    assert seq.token_ids.tolist() == [*second.prompt_ids, *second.generation.token_ids]
    head = [*first.prompt_ids, *first.generation.token_ids]
    assert list(second.prompt_ids[: len(head)]) == head
    between = len(second.prompt_ids) - len(head)
    assert "user: not " in tok.decode(list(second.prompt_ids[len(head) :]))  # the env's turn
    n1, n2 = len(first.generation.token_ids), len(second.generation.token_ids)
    mask = [0] * len(first.prompt_ids) + [1] * n1 + [0] * between + [1] * n2
    assert seq.loss_mask.tolist() == mask
    reply = generated_text(second.generation, tok).strip()
    assert t.reward == pytest.approx(float(reply == "46") + len(reply) / 100)


def test_an_env_that_cannot_load_fails_the_sample_naming_the_recipe_key(modules) -> None:
    out, _, _ = play("astra_vf_no_such_module", task=0, n=1)
    assert "verifiers_env" in out[0].error and "astra_vf_no_such_module" in out[0].error


def test_a_raas_refuses_at_start_up_an_env_that_cannot_load(modules) -> None:
    from click.testing import CliRunner

    from astra.cli import main
    from astra.servers.raas_serve import RaasOptions, start_agents

    opts = RaasOptions(dataflow="", workflows=["verifiers"], verifiers_env={})
    with pytest.raises(ValueError, match="verifiers_env: set it"):
        asyncio.run(start_agents(opts, engine=None))
    opts.verifiers_env = env_config("astra_vf_missing")
    with pytest.raises(ValueError, match=r"verifiers_env: .*astra_vf_missing"):
        asyncio.run(start_agents(opts, engine=None))
    args = ["serve", "raas", "--dataflow", "x", "--workflow", "verifiers", "--verifiers-env"]
    got = CliRunner().invoke(main, [*args, "[1]"])  # the option is a JSON object, or refused
    assert got.exit_code == 2 and "--verifiers-env: must be a JSON object" in got.output


def test_the_env_s_tasks_become_dataset_records(modules, tmp_path) -> None:
    records = task_records(env_config("astra_vf_single"))
    assert records[1] == {"prompt": "5+6=", "task": 1, "answer": "11"} and len(records) == 3
    path = write_task_records(env_config("astra_vf_single"), tmp_path / "d.jsonl")
    assert [json.loads(x) for x in path.read_text().splitlines()] == records


RECIPE = """
name: verifiers-test
policies: [{{id: policy, model: {model}, buffer: {{drop_equal_rewards: false}}}}]
streams: [{{workflow: verifiers, group_size: 2, sampling: {{max_new_tokens: 4}}}}]
dataset: {{kind: file, path: {data}}}
raas: [{{capacity: 4, verifiers_env: {env}}}]
trainer: {{num_steps: 2, batch_groups: 2}}
warmup: {{steps: 0}}
eval: {{every_steps: 0}}
env: {{PYTHONPATH: {path}}}
"""


@pytest.mark.slow
@pytest.mark.timeout(320)  # five processes; ~45 s alone, ~95 s on a loaded 2-core machine
def test_a_recipe_trains_on_a_verifiers_environment(modules, tmp_path) -> None:
    from astra.testing.toy_hf import make_toy_model

    model = make_toy_model(tmp_path / "qwen3")
    data = write_task_records(env_config("astra_vf_multi"), tmp_path / "tasks.jsonl")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(
        model=model, data=data, env=json.dumps(env_config("astra_vf_multi")), path=modules,
    ))  # fmt: skip
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "astra.run", str(recipe), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["groups_lost"] == 0, s
    assert s["steps_per_policy"] == {"policy": 2} and s["counters"]["failed_groups"] == 0
    assert s["groups_trained"] == 2 * 2
