"""Tools a model can call in the `multi_turn_tools` workflow, and the call syntax.

Syntax: the model writes `<tool name="calculator">2*(3+4)</tool>`; generation
stops at `</tool>`; the workflow runs the tool and appends
`<result>14</result>` as context. A tool is a callable `(argument: str) ->
str` (sync or async), registered by name with `register_tool` or through
the entry-point group `astra.tools`. Built-ins: `calculator` (safe
arithmetic, no eval) and `python` (runs the argument as a script in the
sandbox, returns its stdout). A failing tool yields an "error: ..."
observation, never an exception.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from astra.plugins import Registry, UnknownName
from astra.rewards import safe_math
from astra.rewards.sandbox import SandboxLimits, SandboxUnavailable, run_python_async

CLOSE_TAG = "</tool>"
MAX_OBSERVATION_CHARS = 1024
_CALL = re.compile(r'<tool\s+name\s*=\s*"([\w.-]+)"\s*>(.*?)</tool>', re.DOTALL)
_OPEN_CALL = re.compile(r'<tool\s+name\s*=\s*"([\w.-]+)"\s*>((?:(?!<tool\b).)*)$', re.DOTALL)


class ToolError(Exception):
    """A tool's own failure; its message is the observation, after "error: "."""


class UnknownTool(UnknownName):
    """No tool of that name is registered or installed as a plugin."""


TOOLS: Registry[Callable[[str], Any]] = Registry("tool", "astra.tools", UnknownTool)


def register_tool(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Decorator registering a tool `(argument: str) -> str` (sync or async) under `name`."""
    return TOOLS.register(name, replace=replace)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    argument: str
    closed: bool  # False when the engine stopped at `</tool>` but left it out of the text


def parse_tool_call(text: str, stopped: bool) -> ToolCall | None:
    """The first complete tool call in `text`; or, when generation `stopped` at a stop
    string, a call left open at the very end (engines that drop the stop string)."""
    match = _CALL.search(text)
    if match:
        return ToolCall(match.group(1), match.group(2), closed=True)
    match = _OPEN_CALL.search(text) if stopped else None
    if match:
        return ToolCall(match.group(1), match.group(2), closed=False)
    return None


@dataclass(frozen=True, slots=True)
class ToolResult:
    output: str
    ok: bool


def observation(result: ToolResult, call: ToolCall) -> str:
    """The text appended after a call: the closing tag if missing, then `<result>...</result>`."""
    body = result.output.replace("</result>", "<\\/result>")
    return ("" if call.closed else CLOSE_TAG) + f"<result>{body}</result>"


async def run_tool(name: str, argument: str) -> ToolResult:
    """Runs one tool; an unknown tool or any exception becomes an "error: ..." result (a
    sandbox that could not start is raised: the sample fails instead)."""
    tool = TOOLS.find(name)
    if tool is None:
        known = ", ".join(TOOLS.names())
        return ToolResult(f"error: unknown tool {name!r} (known: {known})", ok=False)
    try:
        out = tool(argument)
        if inspect.isawaitable(out):
            out = await out
        text, ok = str(out), True
    except (asyncio.CancelledError, SandboxUnavailable):
        raise  # the machine's failure, not the policy's: the sample fails, it is not scored
    except ToolError as exc:
        text, ok = f"error: {exc}", False
    except Exception as exc:
        text, ok = f"error: {type(exc).__name__}: {exc}", False
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[:MAX_OBSERVATION_CHARS] + "...[truncated]"
    return ToolResult(text, ok)


@register_tool("calculator")
def calculator(expression: str) -> str:
    """Arithmetic on number literals: + - * / // % ** and parentheses. Nothing else."""
    return safe_math.format_number(safe_math.evaluate(expression))


class PythonTool:
    """Runs the argument as a Python script in the sandbox; returns stdout (and the failure)."""

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits(time_s=5.0, memory_bytes=512 << 20, output_chars=2048)

    async def __call__(self, code: str) -> str:
        result = await run_python_async(code, limits=self.limits)
        if result.ok:
            return result.stdout
        last = result.stderr.strip().splitlines()[-1:] or [""]
        detail = f" {last[0]}" if last[0] else ""
        raise ToolError(f"{result.reason}:{detail}\n{result.stdout}".rstrip())


TOOLS.add("python", PythonTool())
