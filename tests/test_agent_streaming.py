"""Streaming from the agent endpoint as the engine samples: pieces reach the `openai` client
while the generation is still running, a client that leaves frees the engine's slot, and the
streamed text equals the non-streamed answer (stop strings and tool calls held back until
settled). `TextDeltas` unit cases: what is held and what is sent."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from astra.agents.streaming import TextDeltas
from astra.engine.tokenizer import CharTokenizer
from tests.test_agent_endpoint import Served
from tests.test_agent_tools import CALL, calling_model


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served(calling_model)  # greedy emits id 0, one whole tool-call text, forever
    try:
        yield s
    finally:
        s.close()


def test_pieces_arrive_while_the_engine_is_still_generating(served: Served) -> None:
    episode = served.endpoint.episodes.open("policy")
    stream = served.client(episode.key).completions.create(
        model="policy", prompt="go", max_tokens=200, temperature=0, stream=True
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].text == CALL  # the first token, sent on its own
    assert served.engine.stats()["running"] == 1 and episode.calls == []  # still generating
    rest = [c.choices[0].text for c in chunks]
    assert "".join([first.choices[0].text, *rest]) == CALL * 200
    assert len(rest) == 200  # a piece for each later token, then the finish
    (call,) = episode.calls
    assert call.generation.token_ids == [0] * 200


def test_a_client_that_leaves_frees_the_engine(served: Served) -> None:
    episode = served.endpoint.episodes.open("policy")
    stream = served.client(episode.key).completions.create(
        model="policy", prompt="go", max_tokens=1000, temperature=0, stream=True
    )
    next(iter(stream))
    assert served.engine.stats()["running"] == 1
    stream.close()
    deadline = time.monotonic() + 30
    while served.engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert served.engine.stats()["running"] == 0 and episode.calls == []


def test_streamed_chat_equals_the_answer_with_a_stop_string_and_tool_calls(served) -> None:
    episode = served.endpoint.episodes.open("policy")
    client = served.client(episode.key)
    ask = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    stop = {"max_tokens": 5, "stop": ['"b"']}
    whole = client.chat.completions.create(**ask, **stop).choices[0].message.content
    streamed = client.chat.completions.create(**ask, **stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole
    assert whole == CALL[: CALL.index('"b"') + 3]  # the engine's text ends at the stop string
    tools = [{"type": "function", "function": {"name": "add"}}]
    streamed = client.chat.completions.create(**ask, max_tokens=2, tools=tools, stream=True)
    chunks = list(streamed)
    assert not any(c.choices[0].delta.content for c in chunks)  # the calls were never text
    (calls,) = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert [c.function.name for c in calls] == ["add", "add"]


def test_text_deltas_hold_what_a_later_token_may_change() -> None:
    tok = CharTokenizer()
    deltas = TextDeltas(tok, stops=("END",), markers=("<tool_call>",))
    sent = [deltas.add(t) for t in tok.encode("ok <tool")]
    assert "".join(sent) == "ok "  # "<tool" may begin a call
    assert [deltas.add(t) for t in tok.encode("s>")] == ["<tools", ">"]  # it did not
    assert "".join(deltas.add(t) for t in tok.encode(" xEN")) == " xEN"  # the answer's either way
    assert "".join(deltas.add(t) for t in tok.encode("D tail")) == ""  # from the stop on: held
    assert deltas.rest("ok <tools> xEND") == "D"  # the engine's text ends at the stop string
    unknown = TextDeltas(tok)
    assert unknown.add(tok.unk_id) == ""  # U+FFFD at the end: a character not complete yet
    assert unknown.add(tok.encode("a")[0]) == "\ufffda" and unknown.rest("\ufffda") == ""
