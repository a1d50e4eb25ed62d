"""Tool calls in OpenAI's format through the agent endpoint and the official `openai` client:
tools rendered by a chat template that supports them, the model's `<tool_call>` text answered
as `message.tool_calls`, the recorded tokens the engine's own, a multi-step tool episode merged
into one trajectory (tool results masked, the model's calls trained); and the refusals.

The model is the embedded tiny one with its final norm zeroed: every logit is 0, so greedy
decoding picks id 0, which the tokenizer built here spells as one whole tool call (a model that
calls a tool on every turn, without training one)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest

from astra.agents import tool_calls as tc
from astra.engine.chat import ChatTemplate
from astra.engine.tokenizer import CharTokenizer
from astra.workflows.agent import trajectories
from tests.test_agent_endpoint import TEMPLATE, Served

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "the sum of two numbers",
            "parameters": {"type": "object", "properties": {"a": {}, "b": {}}},
        },
    }
]
TOOL_TEMPLATE = """\
{% if tools %}<|im_start|>system
{% for t in tools %}{{ t.function | tojson }}
{% endfor %}Call: <tool_call>{json}</tool_call><|im_end|>
{% endif %}
{% for m in messages %}
{% if m.role == 'assistant' and m.tool_calls %}
<|im_start|>assistant
{{ m.content or '' }}{% for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% else %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class ToolTokenizer(CharTokenizer):
    """Characters, with three whole-string tokens in the special ids: 0 is a tool call."""

    words = {0: CALL, 1: "<|im_start|>", 3: "<|im_end|>"}

    def encode(self, text: str) -> list[int]:
        ids = {w: i for i, w in self.words.items()}
        parts = re.split("(" + "|".join(map(re.escape, ids)) + ")", text)
        return [t for p in parts for t in ([ids[p]] if p in ids else CharTokenizer.encode(self, p))]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.words.get(i) or CharTokenizer.decode(self, [i]) for i in ids)


def calling_model(model, _tok):  # type: ignore[no-untyped-def]
    model.model.norm.weight.data.zero_()
    tok = ToolTokenizer()
    tok.chat_template = ChatTemplate(TOOL_TEMPLATE, {}, "test-tools")
    return model, tok


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served(calling_model)
    try:
        yield s
    finally:
        s.close()


def ask(served: Served, key: str, messages: list, **kw):  # type: ignore[no-untyped-def]
    return served.client(key).chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=1, temperature=0, **kw
    )


def test_a_tool_call_is_answered_in_openai_form_and_recorded_as_generated(served) -> None:
    episode = served.endpoint.episodes.open("policy")
    out = ask(served, episode.key, [{"role": "user", "content": "2+3?"}])
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    (recorded,) = episode.calls
    assert recorded.generation.token_ids == [0]  # the engine's token, not re-encoded text
    prompt = served.tok.decode(list(recorded.prompt_ids))
    assert prompt.startswith("<|im_start|>system\n" + json.dumps(TOOLS[0]["function"]))
    assert prompt.endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")

    streamed = ask(served, episode.key, [{"role": "user", "content": "2+3?"}], stream=True)
    chunks = list(streamed)
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].function.name == "add"
    assert json.loads(deltas[0][0].function.arguments) == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert episode.calls[1].prompt_ids == recorded.prompt_ids


def test_a_multi_step_tool_episode_trains_the_calls_and_masks_the_results(served) -> None:
    episode = served.endpoint.episodes.open("policy")
    messages: list = [{"role": "user", "content": "2+3?"}]
    for result in ("5", "5 again"):
        out = ask(served, episode.key, messages)
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    first, second = episode.calls
    (seq,) = trajectories(served.endpoint.episodes.close(episode.key), reward=1.0)
    n = len(first.prompt_ids)
    assert list(seq.token_ids[: n + 1]) == [*first.prompt_ids, 0]
    assert list(seq.token_ids[:-1]) == list(second.prompt_ids) and seq.token_ids[-1] == 0
    trained = [i for i, m in enumerate(seq.loss_mask) if m]
    assert trained == [n, len(seq.token_ids) - 1]  # the two calls, nothing else
    between = served.tok.decode(list(seq.token_ids[n + 1 : -1]))
    assert between == "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_tool_choice_none_answers_text_and_unhonourable_choices_are_refused(served) -> None:
    episode = served.endpoint.episodes.open("policy")
    out = ask(served, episode.key, [{"role": "user", "content": "hi"}], tool_choice="none")
    assert out.choices[0].message.content == CALL and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "length"
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        with pytest.raises(openai.BadRequestError) as e:
            ask(served, episode.key, [{"role": "user", "content": "hi"}], tool_choice=choice)
        assert e.value.body["param"] == "tool_choice"
    bad = [{"role": "tool", "content": "5"}]  # no tool_call_id
    with pytest.raises(openai.BadRequestError) as e:
        ask(served, episode.key, bad)
    assert e.value.body["param"] == "messages[0].tool_call_id"
    with pytest.raises(openai.BadRequestError) as e:
        served.client(episode.key).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=1,
            tools=[{"type": "function", "function": {"name": "no spaces"}}],
        )  # fmt: skip
    assert e.value.body["param"] == "tools[0].function.name"
    assert len(episode.calls) == 1  # nothing refused was recorded


def test_tools_on_a_template_without_tool_support_are_refused_naming_why() -> None:
    s = Served()  # the endpoint tests' template: it never reads `tools`
    try:
        episode = s.endpoint.episodes.open("policy")
        with pytest.raises(openai.BadRequestError) as e:
            ask(s, episode.key, [{"role": "user", "content": "2+3?"}])
        assert e.value.body["param"] == "tools" and "no tool support" in str(e.value)
        assert episode.calls == []
    finally:
        s.close()


def test_the_format_is_chosen_by_the_template() -> None:
    assert tc.format_for(ChatTemplate(TOOL_TEMPLATE, {}, "t")) is tc.HERMES
    with pytest.raises(tc.ToolRequestError, match="never reads `tools`"):
        tc.format_for(ChatTemplate(TEMPLATE, {}, "t"))
    with pytest.raises(tc.ToolRequestError, match="not parsed here; known: hermes"):
        tc.format_for(ChatTemplate("{{ tools | tojson }}{{ messages }}", {}, "t"))


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CALL, None, [("add", {"a": 2, "b": 3})]),
        ("Let me add.\n" + CALL + CALL, "Let me add.", [("add", {"a": 2, "b": 3})] * 2),
        ('<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>', None, [("f", {})]),
        ("no call here", "no call here", []),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
        ("<tool_call>" + CALL[11:-12], "<tool_call>" + CALL[11:-12], []),  # cut short
    ],
)
def test_hermes_parsing(text: str, content: str | None, calls: list) -> None:
    got_content, got = tc.HERMES.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_a_calling_turn_is_given_to_the_template_as_templates_expect() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    (given,) = tc.template_messages([turn])
    assert given["content"] == "" and given["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the request untouched
    qwen_like = "{% for m in messages %}{% if '</think>' in m.content %}!{% endif %}{% endfor %}"
    assert ChatTemplate(qwen_like, {}, "t").render([given]) == ""
