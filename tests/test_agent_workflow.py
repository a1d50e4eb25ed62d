"""Workflow `agent`: a real agent program (Python, the official `openai` client) runs per
sample against the RaaS's endpoint; its calls become the trajectories, its answer is scored;
an agent that crashes, hangs, floods or never calls fails its sample in time."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from astra.agents.endpoint import AgentEndpoint, Gateway
from astra.engine.tiny import load_model
from astra.engine.torch_engine import TorchEngine
from astra.raas.backend import GroupSpec
from astra.raas.engine_backend import EngineBackend
from astra.servers.agent_http import AgentHTTPServer
from astra.workflows.agent import check_command, final_reward

AGENT = """
import os
from openai import OpenAI
client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"],
                max_retries=0)
model, prompt = os.environ["ASTRA_MODEL"], os.environ["ASTRA_PROMPT"]
first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
text = first.choices[0].text
# a second step that continues the first one's text (a multi-step agent)
client.completions.create(model=model, prompt=prompt + text, max_tokens=2, temperature=0)
print(text.strip())
"""
BEHAVIOURS = {
    "crash": "import sys; sys.exit(3)",
    "hang": "import time; time.sleep(60)",
    "silent": "print('42')",
    "flood": AGENT.replace(
        "print(text.strip())",
        "for _ in range(50):\n"
        "    client.completions.create(model=model, prompt=prompt, max_tokens=1)",
    ),
    "rewarded": AGENT.replace("print(text.strip())", "print('{\"reward\": 0.25}')"),
}


def group(n: int = 2) -> GroupSpec:
    return GroupSpec(
        group_id="g/1", workflow="agent", policy_ids=("policy",), num_samples=n,
        max_new_tokens=4, prompt_text="12+34=", data={"answer": "46"},
    )  # fmt: skip


def run_agent(tmp_path: Path, code: str, **options: Any) -> tuple[list, float]:
    script = tmp_path / "agent.py"
    script.write_text(code)

    async def body() -> tuple[list, float]:
        model, tok = load_model("tiny")
        engine = TorchEngine({"policy": (model, tok)})
        endpoint = AgentEndpoint(engine)
        server = await AgentHTTPServer(endpoint).start()
        opts = {"command": [sys.executable, str(script)], "timeout_s": 30.0, **options}
        backend = EngineBackend(
            engine, ["agent"],
            agents=Gateway(server.base_url, endpoint.episodes, server.unix_path),
            workflow_options={"agent": opts},
        )  # fmt: skip
        try:
            started = time.monotonic()
            out = await backend.generate(group(), {"policy": 0})
            assert len(endpoint.episodes) == 0  # every episode closed
            return out, time.monotonic() - started
        finally:
            await server.stop()
            await engine.close()

    return asyncio.run(asyncio.wait_for(body(), 120))


def test_an_agent_s_calls_become_its_trajectory_and_its_answer_is_scored(tmp_path) -> None:
    out, _ = run_agent(tmp_path, AGENT)
    assert [t.error for t in out] == [None, None]
    for t in out:
        assert t.metadata["calls"] == 2 and t.reward in (0.0, 1.0)
        seqs = t.sequences
        # the second call continues the first one's tokens when its text re-tokenizes to them
        assert 1 <= len(seqs) <= 2 and all(s.loss_mask.sum() > 0 for s in seqs)
        assert all(s.reward == t.reward and s.policy_id == "policy" for s in seqs)
        assert (seqs[0].weight_versions[seqs[0].loss_mask == 1] == 0).all()


def test_a_reward_the_agent_prints_is_taken() -> None:
    assert final_reward('thinking\n{"reward": 0.25}\n') == 0.25
    assert final_reward("46") is None and final_reward("") is None


def test_the_printed_reward_reaches_the_trajectory(tmp_path) -> None:
    out, _ = run_agent(tmp_path, BEHAVIOURS["rewarded"])
    assert [t.reward for t in out] == [0.25, 0.25] and all(t.error is None for t in out)


@pytest.mark.parametrize(
    ("behaviour", "says"),
    [("crash", "exit 3"), ("hang", "timeout"), ("silent", "no call"), ("flood", "exit 1")],
)
def test_a_failing_agent_fails_its_sample_in_time(tmp_path, behaviour, says) -> None:
    timeout_s = 3.0 if behaviour == "hang" else 10.0  # the others end by themselves
    out, took = run_agent(tmp_path, BEHAVIOURS[behaviour], timeout_s=timeout_s, max_calls=5)
    assert all(t.error and says in t.error for t in out), [t.error for t in out]
    assert took < 30


PROBE = AGENT.replace(
    "print(text.strip())",
    "import socket\n"
    "try:\n"
    "    socket.create_connection(('127.0.0.1', OTHER_PORT), timeout=2)\n"
    "    print('reached')\n"
    "except OSError as exc:\n"
    "    print('cut', exc.errno)",
)


@pytest.mark.parametrize(("network", "says"), [(False, "cut"), (True, "reached")])
def test_an_agent_reaches_the_endpoint_and_nothing_else_unless_allowed(
    tmp_path, network, says
) -> None:
    """The agent's calls reach the endpoint (same URL) where its network is cut; another server
    on this machine's loopback does not answer it, unless `network: true`."""
    from astra.rewards.sandbox import no_network_prefix

    if not network and not no_network_prefix():
        pytest.skip("this machine allows no network namespace: agents keep the network")
    other = socket.create_server(("127.0.0.1", 0))
    code = PROBE.replace("OTHER_PORT", str(other.getsockname()[1]))
    try:
        out, _ = run_agent(tmp_path, code, network=network, timeout_s=20.0)
    finally:
        other.close()
    assert [t.error for t in out] == [None, None]
    for t in out:
        assert t.metadata["calls"] == 2 and t.metadata["answer"].startswith(says)


def test_an_agent_command_that_does_not_exist_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="no-such-agent"):
        check_command(["no-such-agent", "--x"])


def test_the_agents_page_shows_the_agent_the_recipe_runs() -> None:
    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "agents.md").read_text()
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    assert block.strip() in (root / "examples" / "agents" / "arithmetic_agent.py").read_text()
    assert (
        '"examples/agents/arithmetic_agent.py"' in (root / "configs/recipes/agent.yaml").read_text()
    )


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"network": "yes"}, "workflow_options.agent.network: 'yes' is not a bool"),
        ({"max_calls": 0}, "workflow_options.agent.max_calls: 0 is not a int >= 1"),
        ({"timeout_s": 5}, "workflow_options.agent.timeout_s: unknown.*agent_timeout_s"),
    ],
)
def test_a_recipe_with_bad_agent_options_is_refused_naming_the_key(options, says) -> None:
    import json

    from astra.run.recipe import RecipeError, load_recipe

    root = Path(__file__).resolve().parent.parent
    with pytest.raises(RecipeError, match=says):
        load_recipe(
            root / "configs/recipes/agent.yaml",
            [f"raas.0.workflow_options={{agent: {json.dumps(options)}}}"],
        )
