"""One conversation through the agent endpoint twice: driven by the official Python `openai`
client, and by a Node.js agent using nothing but `fetch` (examples/agents/fetch_agent.mjs);
both episodes must record the same calls: prompt ids, output ids, log-probs, versions.

Chat and text completions, streamed and not, greedy with a fixed seed, on the built-in engine
and the embedded tiny model. Skipped where `node` is missing, never in CI (which has it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from astra.agents.recorder import Episode
from tests.test_agent_endpoint import Served

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "examples" / "agents" / "fetch_agent.mjs"
PROMPT = "12+34="
SETTINGS = {"temperature": 0, "seed": 7}

why = "" if shutil.which("node") else "node is not installed (the Node.js agent cannot run)"
if why and os.environ.get("CI") == "true":
    raise RuntimeError(f"tests/test_agent_node.py cannot run in CI: {why}")
pytestmark = pytest.mark.skipif(bool(why), reason=why)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    try:
        yield s
    finally:
        s.close()


def python_agent(client: openai.OpenAI, model: str, prompt: str) -> dict[str, str]:
    """The conversation of fetch_agent.mjs, call for call, through the `openai` client."""
    messages = [{"role": "user", "content": prompt}]
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, stop=["\n"], **SETTINGS
    )
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "user", "content": f"again: {prompt}"})
    second = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, stream=True, **SETTINGS
    )
    chat = "".join(c.choices[0].delta.content or "" for c in second)
    third = client.completions.create(model=model, prompt=prompt, max_tokens=6, **SETTINGS)
    context = f"{prompt}{third.choices[0].text}\n{prompt}"
    fourth = client.completions.create(
        model=model, prompt=context, max_tokens=6, stream=True, **SETTINGS
    )
    return {"chat": chat, "text": "".join(c.choices[0].text for c in fourth)}


def node_agent(served: Served, key: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "OPENAI_BASE_URL": served.server.base_url,
        "OPENAI_API_KEY": key,
        "ASTRA_MODEL": "policy",
        "ASTRA_PROMPT": PROMPT,
    }
    done = subprocess.run(
        ["node", str(AGENT)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[0])


def calls(episode: Episode) -> list[tuple]:
    return [
        (c.prompt_ids, tuple(c.generation.token_ids), tuple(c.generation.versions), c.policy_id)
        for c in episode.calls
    ]


def test_python_and_node_agents_record_identical_tokens(served: Served) -> None:
    py = served.endpoint.episodes.open("policy")
    js = served.endpoint.episodes.open("policy")
    py_answers = python_agent(served.client(py.key), "policy", PROMPT)
    js_answers = node_agent(served, js.key)
    assert js_answers == py_answers
    assert len(py.calls) == 4 and calls(js) == calls(py)
    for a, b in zip(py.calls, js.calls, strict=True):
        assert np.allclose(a.generation.logprobs, b.generation.logprobs, rtol=0, atol=1e-6)
    # the calls are the conversation: chat turns rendered by the template, text as given
    assert list(py.calls[2].prompt_ids) == served.tok.encode(PROMPT)
    n = len(py.calls[0].prompt_ids)
    assert py.calls[1].prompt_ids[:n] == py.calls[0].prompt_ids  # the history, rendered again
    assert all(c.generation.token_ids for c in py.calls) and py_answers["text"]
    assert [c.generation.meta["seed"] for c in py.calls] == [7] * 4


def test_a_node_agent_error_names_the_parameter(served: Served) -> None:
    episode = served.endpoint.episodes.open("policy")
    script = (
        "const r = await fetch(process.env.OPENAI_BASE_URL + '/completions', {method: 'POST',"
        " headers: {Authorization: 'Bearer ' + process.env.OPENAI_API_KEY},"
        " body: JSON.stringify({model: 'policy', prompt: 'x', max_tokens: 0})});"
        " console.log(r.status, JSON.stringify(await r.json()));"
    )
    env = {"OPENAI_BASE_URL": served.server.base_url, "OPENAI_API_KEY": episode.key}
    done = subprocess.run(
        ["node", "--input-type=module", "-e", script],
        env={**env, "PATH": os.environ.get("PATH", "")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    status, body = done.stdout.split(" ", 1)
    assert status == "400" and json.loads(body)["error"]["param"] == "max_tokens"
    assert episode.calls == []  # nothing refused was recorded
