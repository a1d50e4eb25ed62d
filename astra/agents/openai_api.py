"""The OpenAI wire shapes the agent endpoint speaks: requests checked, responses built.

`/v1/chat/completions` and `/v1/completions`, non-streaming and streaming (server-sent
events: one `data: {chunk}` per piece, then `data: [DONE]`). A malformed request raises
`ApiError` with OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`) and
the HTTP status it goes with: 400 naming the parameter, 401 for a key that opens no
episode, 404 for a model the RaaS does not serve (listing those it does), 429 for an
episode past its call limit. Only what the endpoint honours is accepted: an unknown
parameter is ignored as OpenAI's own servers do, a value it cannot honour (n > 1, logprobs
of alternatives) is refused. Tool calls (`tools`, `tool_choice`, the conversation's tool
turns) are checked by astra.agents.tool_calls; an answer that calls tools carries
`message.tool_calls` and finish_reason "tool_calls". Pure functions: no I/O, no engine.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from astra.agents import tool_calls as tc

MAX_TOKENS_DEFAULT = 256


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            429: "rate_limit_error",
        }.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class Request:
    """A checked completion request: chat (`messages`) or text (`prompt`)."""

    model: str
    messages: list[dict[str, Any]] | None
    prompt: str | None
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    tools: tuple[dict[str, Any], ...] = ()  # chat only: the functions the model may call
    tool_choice: str = "auto"  # "auto" or "none"


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a number", param=name, code="invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be in [{low}, {high}], got {value}", param=name)
    return float(value)


def parse(raw: bytes, *, chat: bool, served: tuple[str, ...]) -> Request:
    """The request body checked; raises ApiError (400, or 404 for an unknown model)."""
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required", param="model")
    if model not in served:
        raise ApiError(
            404, f"the model {model!r} is not served here; served: {list(served)}",
            param="model", code="model_not_found",
        )  # fmt: skip
    messages = prompt = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice = "auto"
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] needs a role", param=f"messages[{i}].role")
            if not isinstance(m.get("content"), str) and m.get("content") is not None:
                raise ApiError(
                    400, f"messages[{i}].content must be a string (text only)",
                    param=f"messages[{i}].content",
                )  # fmt: skip
        try:
            for i, m in enumerate(messages):
                tc.check_message(i, m)
            tools, tool_choice = tc.check_tools(body)
        except tc.ToolRequestError as exc:
            raise ApiError(400, exc.message, param=exc.param) from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", param="prompt")
    if body.get("n", 1) not in (1, None):
        raise ApiError(400, "n must be 1 (one completion per call)", param="n")
    limit = body.get("max_completion_tokens", body.get("max_tokens", MAX_TOKENS_DEFAULT))
    if limit is None:
        limit = MAX_TOKENS_DEFAULT
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ApiError(400, "max_tokens must be a whole number >= 1", param="max_tokens")
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "seed must be a whole number", param="seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    return Request(
        model=model,
        messages=messages,
        prompt=prompt,
        max_tokens=limit,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        stop=tuple(stop),
        seed=seed,
        stream=stream,
        tools=tools,
        tool_choice=tool_choice,
    )


def finish_reason(engine_reason: str, calls: list[dict[str, Any]] | None = None) -> str:
    if calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(
    req: Request,
    rid: str,
    text: str | None,
    reason: str,
    tokens: dict[str, int],
    calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The non-streaming body of a chat or text completion (`tokens`: its usage); `calls`:
    the tool calls found in a chat answer (`text` is then the content before them, or None)."""
    created = int(time.time())
    if req.messages is not None:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "finish_reason": finish_reason(reason, calls)}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason(reason)}
        kind = "text_completion"
    return {
        "id": rid, "object": kind, "created": created, "model": req.model,
        "choices": [choice], "usage": tokens,
    }  # fmt: skip


def chunk(
    req: Request,
    rid: str,
    created: int,
    *,
    text: str | None = None,
    calls: list[dict[str, Any]] | None = None,
    finish: str | None = None,
) -> bytes:
    """One server-sent event of a streamed completion: a piece of text, the tool calls (chat),
    or the finish (`finish` set: an empty delta). A chat stream opens with the role: `text`
    None and nothing else given."""
    chat = req.messages is not None
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if not chat:
        choice["text"] = text or ""
    elif calls:
        choice["delta"] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
    elif text is not None:
        choice["delta"] = {"content": text}
    else:
        choice["delta"] = {} if finish else {"role": "assistant"}
    kind = "chat.completion.chunk" if chat else "text_completion"
    body = {"id": rid, "object": kind, "created": created, "model": req.model}
    body["choices"] = [choice]
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def error_event(err: ApiError) -> bytes:
    """An error after a stream began (its status already sent): OpenAI's error body."""
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"
