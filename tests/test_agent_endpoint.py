"""The agent endpoint (astra.agents, servers/agent_http.py) through the official `openai`
client: every call recorded with the exact token ids the engine consumed and produced,
streaming equal to non-streaming, episodes apart, OpenAI-style errors."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest

from astra.agents.endpoint import AgentEndpoint
from astra.engine.chat import ChatTemplate
from astra.engine.tiny import load_model
from astra.engine.torch_engine import TorchEngine
from astra.servers.agent_http import AgentHTTPServer
from astra.workflows.agent import trajectories

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class Served:
    """The tiny engine and the endpoint on an event loop of their own (the client is sync)."""

    def __init__(self, prepare: Any = None) -> None:
        self.prepare = prepare  # (model, tokenizer) -> (model, tokenizer), before serving
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self._start())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self) -> None:
        model, tok = load_model("tiny")
        tok.chat_template = ChatTemplate(TEMPLATE, {}, "test")
        if self.prepare is not None:
            model, tok = self.prepare(model, tok)
        self.tok = tok
        self.engine = TorchEngine({"policy": (model, tok)})
        self.endpoint = AgentEndpoint(self.engine)
        self.server = await AgentHTTPServer(self.endpoint).start()

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.base_url, api_key=key, max_retries=0)

    def close(self) -> None:
        self.run(self.server.stop())
        self.run(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    try:
        yield s
    finally:
        s.close()


def test_a_completion_records_the_exact_tokens_and_streaming_agrees(served: Served) -> None:
    episode = served.endpoint.episodes.open("policy")
    client = served.client(episode.key)
    out = client.completions.create(model="policy", prompt="12+34=", max_tokens=6, temperature=0)
    streamed = client.completions.create(
        model="policy", prompt="12+34=", max_tokens=6, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in streamed)
    assert text == out.choices[0].text
    first, second = episode.calls
    assert list(first.prompt_ids) == served.tok.encode("12+34=")
    assert first.generation.token_ids == second.generation.token_ids  # greedy: the same
    assert out.usage.prompt_tokens == len(first.prompt_ids)
    assert out.usage.completion_tokens == len(first.generation.token_ids)
    assert served.tok.decode(first.generation.token_ids).startswith(out.choices[0].text)
    assert all(v == 0 for v in first.generation.versions)
    assert all(np.isfinite(first.generation.logprobs))


def test_chat_turns_merge_into_one_trajectory_with_the_new_turn_masked(served: Served) -> None:
    episode = served.endpoint.episodes.open("policy")
    client = served.client(episode.key)
    messages = [{"role": "user", "content": "1+2="}]
    first = client.chat.completions.create(
        model="policy", messages=messages, max_tokens=4, temperature=0, stop=["\n"]
    )
    answer = first.choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "2+2="}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=4, temperature=0)
    rendered = template_render(messages[:1])
    assert list(episode.calls[0].prompt_ids) == served.tok.encode(rendered)
    seqs = trajectories(served.endpoint.episodes.close(episode.key), reward=1.0)
    c0, c1 = episode.calls
    first_seq = list(c0.prompt_ids) + list(c0.generation.token_ids)
    n0, g0 = len(c0.prompt_ids), len(c0.generation.token_ids)
    if list(c1.prompt_ids[: n0 + g0]) == first_seq:  # its answer tokenized back to its tokens
        (seq,) = seqs
        ctx = len(c1.prompt_ids) - n0 - g0
        assert seq.loss_mask[:n0].sum() == 0 and seq.loss_mask[n0 : n0 + g0].all()
        assert seq.loss_mask[n0 + g0 : n0 + g0 + ctx].sum() == 0  # the next turn: context
        assert seq.loss_mask[n0 + g0 + ctx :].all() and seq.reward == 1.0
        assert list(seq.token_ids[: n0 + g0 + ctx]) == list(c1.prompt_ids)
    else:  # the text did not tokenize back to the generated tokens: two sequences
        assert len(seqs) == 2 and all(s.reward == 1.0 for s in seqs)


def template_render(messages: list[dict[str, str]]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def test_episodes_never_see_each_others_calls(served: Served) -> None:
    a = served.endpoint.episodes.open("policy")
    b = served.endpoint.episodes.open("policy")
    served.client(a.key).completions.create(model="policy", prompt="1+1=", max_tokens=2)
    for _ in range(2):
        served.client(b.key).completions.create(model="policy", prompt="3+3=", max_tokens=2)
    assert len(a.calls) == 1 and len(b.calls) == 2
    assert list(a.calls[0].prompt_ids) == served.tok.encode("1+1=")


def test_errors_are_openai_shaped_with_the_right_status(served: Served) -> None:
    episode = served.endpoint.episodes.open("policy")
    client = served.client(episode.key)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert "served: ['policy']" in str(e.value) and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="policy", prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="policy", prompt="x", max_tokens=2, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.AuthenticationError):
        served.client("astra-ep-nope").completions.create(model="policy", prompt="x", max_tokens=2)
    served.endpoint.episodes.close(episode.key)
    with pytest.raises(openai.AuthenticationError):  # a call after the episode ended
        client.completions.create(model="policy", prompt="x", max_tokens=2)
    assert episode.calls == []  # nothing refused was recorded
    models = served.client("any").models.list()
    assert [m.id for m in models.data] == ["policy"]


def test_an_episode_past_its_call_limit_is_refused(served: Served) -> None:
    episode = served.endpoint.episodes.open("policy", max_calls=2)
    client = served.client(episode.key)
    for _ in range(2):
        client.completions.create(model="policy", prompt="5+5=", max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="policy", prompt="5+5=", max_tokens=1)
    assert len(episode.calls) == 2


def test_trajectories_continue_a_prefix_and_split_otherwise() -> None:
    from astra.agents.recorder import Episode
    from astra.engine.api import Generation

    def gen(*ids: int) -> Generation:
        return Generation(list(ids), [-0.5] * len(ids), [3] * len(ids), "stop")

    ep = Episode("k", "policy", 8)
    ep.record([1, 2], gen(7, 8))  # prompt 1 2 -> 7 8
    ep.record([1, 2, 7, 8, 4, 5], gen(9))  # continues: 4 5 is the next turn (context)
    ep.record([6], gen(7))  # another conversation: a new sequence
    first, second = trajectories(ep, reward=0.5)
    assert first.token_ids.tolist() == [1, 2, 7, 8, 4, 5, 9]
    assert first.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert first.weight_versions.tolist() == [-1, -1, 3, 3, -1, -1, 3]
    assert first.prompt_length == 2 and first.reward == 0.5
    assert second.token_ids.tolist() == [6, 7] and second.loss_mask.tolist() == [0, 1]
