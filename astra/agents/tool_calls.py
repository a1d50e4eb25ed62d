"""Tool calls in OpenAI's format: the request's `tools` and `tool_choice` checked, the
conversation's tool turns made ready for a chat template, and the model's calls found in its
generated text by the convention its template writes them in.

A template supports tools when it reads the `tools` variable (as Hugging Face's
`apply_chat_template(..., tools=...)` passes it) and writes calls in a convention a
`ToolCallFormat` here parses; the format is chosen by the template's own text (Hermes/Qwen:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`). Only what can be honoured is
accepted: `tool_choice` "auto" or "none" (a call cannot be forced on the engine, so "required"
and a named function are refused). Generated text that is not a well-formed call stays text.
Pure functions: no I/O, no engine, no HTTP; errors are `ToolRequestError` naming the parameter.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("auto", "none")


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ToolCallFormat:
    """A convention for writing tool calls: `marker` in a template's text selects it."""

    name: str
    marker: str
    parse: Callable[[str], tuple[str | None, list[ToolCall]]]  # text -> (content, calls)


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """`<tool_call>{json}</tool_call>` blocks; the text before the first is the content.
    Any block that is not a JSON object with a string `name` leaves the whole text as content."""
    blocks = re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        args = call.get("arguments", {})
        calls.append(ToolCall(call["name"], args if isinstance(args, str) else json.dumps(args)))
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


HERMES = ToolCallFormat("hermes", "<tool_call>", _hermes)
FORMATS = (HERMES,)


def format_for(template: Any) -> ToolCallFormat:
    """The tool-call format of a chat template (astra.engine.chat.ChatTemplate); raises
    ToolRequestError (param `tools`) saying why a template cannot take tools."""
    if template is None:
        raise ToolRequestError("this model's tokenizer has no chat template", "tools")
    if "tools" not in template.variables:
        raise ToolRequestError(
            f"this model's chat template ({template.origin or 'given'}) has no tool support: "
            "it never reads `tools`",
            "tools",
        )
    for fmt in FORMATS:
        if fmt.marker in template.source:
            return fmt
    known = ", ".join(f"{f.name} ({f.marker})" for f in FORMATS)
    raise ToolRequestError(
        f"this model's chat template reads `tools` but writes calls in a form not parsed "
        f"here; known: {known}",
        "tools",
    )


def _function(spec: Any, where: str) -> None:
    if not isinstance(spec, dict) or spec.get("type") != "function":
        raise ToolRequestError(f'{where} must be {{"type": "function", ...}}', where)
    fn = spec.get("function")
    if not isinstance(fn, dict) or not NAME.match(str(fn.get("name", ""))):
        raise ToolRequestError(
            f"{where}.function.name must be 1-64 letters, digits, _ or -", f"{where}.function.name"
        )
    if not isinstance(fn.get("description", ""), str):
        raise ToolRequestError(f"{where}.function.description must be a string", where)
    if not isinstance(fn.get("parameters", {}), dict):
        raise ToolRequestError(
            f"{where}.function.parameters must be a JSON Schema object",
            f"{where}.function.parameters",
        )


def check_tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], str]:
    """(the tools as given, the tool choice: "auto" or "none"); raises ToolRequestError."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise ToolRequestError(f"{legacy} is not supported: use tools", legacy)
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolRequestError("tools must be a list of functions", "tools")
    for i, spec in enumerate(tools):
        _function(spec, f"tools[{i}]")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    if choice not in CHOICES:
        raise ToolRequestError(
            f"tool_choice {choice!r} cannot be honoured: the engine cannot force a call; "
            f"use one of {list(CHOICES)}",
            "tool_choice",
        )
    return tuple(tools), choice


def check_message(i: int, m: dict[str, Any]) -> None:
    """The tool parts of `messages[i]`: an assistant's `tool_calls`, a tool's `tool_call_id`."""
    if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise ToolRequestError(
            f"messages[{i}] (role tool) needs tool_call_id", f"messages[{i}].tool_call_id"
        )
    calls = m.get("tool_calls")
    if calls is None:
        return
    where = f"messages[{i}].tool_calls"
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise ToolRequestError(f"{where} must be a list, on an assistant message", where)
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolRequestError(f"{where}[{j}] needs function.name", f"{where}[{j}]")
        try:
            json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise ToolRequestError(
                f"{where}[{j}].function.arguments must be JSON text",
                f"{where}[{j}].function.arguments",
            ) from None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as chat templates expect them: a call's arguments as an object, not the
    JSON text OpenAI sends (templates write them with `tojson`), and a calling turn's null
    content as "" (templates test it as a string, Qwen3's among them); the rest as given."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call["function"])
                fn["arguments"] = json.loads(fn.get("arguments") or "{}")
                calls.append({**call, "function": fn})
            m = {**m, "content": m.get("content") or "", "tool_calls": calls}
        out.append(m)
    return out


def openai_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The calls as an answer's `message.tool_calls`, each with an id of its own."""
    return [
        {
            "id": "call_" + secrets.token_hex(12),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]
