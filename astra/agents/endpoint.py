"""The agent endpoint's work: one OpenAI-style call of an episode, run on the RaaS's engine.

The key selects the episode (401 when none is open under it); the model names a policy the
engine serves (404 otherwise). A chat request is rendered with the policy's chat template
(generation prompt added) and tokenized by the policy's tokenizer; a text request is
tokenized as given. The engine generates at the policy's current version, and the episode
records the exact prompt ids and the generation (tokens, log-probs, versions) before the
answer goes out. With `tools`, the prompt is rendered with them (refused with 400 when the
template has no tool support) and the answer's tool calls are parsed by the template's
convention (astra.agents.tool_calls); the recorded tokens are the engine's, untouched.
A streamed answer goes out as the engine samples it when the engine tells each token
(`streams_tokens`, the built-in engine), in pieces astra.agents.streaming holds back until
no later token can change them; it is recorded when the generation ends, before the finish
event. Another engine's answer is generated whole, then sent in the same pieces.
Knows nothing of HTTP framing (servers/agent_http.py) or gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from astra.agents import openai_api as api
from astra.agents import tool_calls as tc
from astra.agents.recorder import EpisodeLimit, Episodes, check_room
from astra.agents.streaming import TextDeltas
from astra.engine.api import Generation, InferenceEngine, Sampling
from astra.engine.chat import render_chat
from astra.workflows.episode import generated_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gateway:
    """What the `agent` workflow is given: where agents call, and the episodes behind it.
    `unix_path`: the same endpoint on a Unix socket, which an agent whose network is cut
    reaches through its sandbox (astra.rewards.sandbox_forward); "" when there is none."""

    base_url: str
    episodes: Episodes
    unix_path: str = ""


class AgentEndpoint:
    def __init__(self, engine: InferenceEngine, episodes: Episodes | None = None) -> None:
        self.engine = engine
        self.episodes = episodes if episodes is not None else Episodes()
        self.served = tuple(engine.policy_ids)

    def models(self) -> dict[str, Any]:
        data = [{"id": p, "object": "model", "owned_by": "astra"} for p in self.served]
        return {"object": "list", "data": data}

    async def complete(self, key: str, raw: bytes, *, chat: bool) -> tuple[api.Request, Any]:
        """(the request, its body: a dict, or an async iterator of stream events); raises
        ApiError."""
        episode = self.episodes.get(key)
        if episode is None:
            raise api.ApiError(
                401, "no episode is open under this API key (unknown, or the episode ended)",
                code="invalid_api_key",
            )  # fmt: skip
        req = api.parse(raw, chat=chat, served=self.served)
        try:
            check_room(episode)
        except EpisodeLimit as exc:
            raise api.ApiError(429, str(exc), code="episode_call_limit") from None
        tokenizer = self.engine.tokenizer(req.model)
        prompt_ids, tool_format = self._prompt(req, tokenizer)
        room = self.engine.max_seq_len(req.model) - len(prompt_ids)
        if room < 1:
            raise api.ApiError(
                400, f"the prompt is {len(prompt_ids)} tokens, the model's context is full",
                param="messages" if chat else "prompt", code="context_length_exceeded",
            )  # fmt: skip
        sampling = Sampling(
            max_new_tokens=min(req.max_tokens, room),
            temperature=req.temperature,
            top_p=req.top_p,
            stop_strings=req.stop,
            seed=req.seed,
        )
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        call = (episode, req, prompt_ids, sampling)
        if req.stream and getattr(self.engine, "streams_tokens", False):
            return req, self._stream(call, rid, tokenizer, tool_format, None)
        gen = await self.engine.generate(req.model, prompt_ids, sampling)
        self._record(call, gen)
        if req.stream:  # an engine that returns whole generations: sent in pieces once done
            return req, self._stream(call, rid, tokenizer, tool_format, gen)
        content, calls = _answer(generated_text(gen, tokenizer), tool_format)
        tokens = api.usage(len(prompt_ids), len(gen.token_ids))
        return req, api.response(req, rid, content, gen.finish_reason, tokens, calls)

    def _record(self, call: tuple, gen: Generation) -> None:
        episode, req, prompt_ids, _ = call
        if not episode.open:
            raise api.ApiError(401, "the episode ended during the call", code="invalid_api_key")
        episode.record(prompt_ids, gen, req.model)

    async def _stream(
        self, call: tuple, rid: str, tokenizer: Any, tool_format: Any, gen: Generation | None
    ) -> AsyncIterator[bytes]:
        """The events of a streamed answer: text as it is sampled (`gen` None), or the finished
        `gen` in pieces; an error after the stream began is an error event (no [DONE])."""
        _, req, prompt_ids, sampling = call
        created = int(time.time())
        markers: tuple[str, ...] = (tool_format.marker,) if tool_format is not None else ()
        deltas = TextDeltas(tokenizer, req.stop, markers)
        if req.messages is not None:
            yield api.chunk(req, rid, created)
        try:
            if gen is None:
                queue: asyncio.Queue[int | None] = asyncio.Queue()
                task = asyncio.ensure_future(
                    self.engine.generate(  # type: ignore[call-arg]
                        req.model, prompt_ids, sampling, on_token=queue.put_nowait
                    )
                )
                task.add_done_callback(lambda _: queue.put_nowait(None))
                try:
                    while (token := await queue.get()) is not None:
                        if piece := deltas.add(token):
                            yield api.chunk(req, rid, created, text=piece)
                    gen = task.result()
                finally:
                    task.cancel()  # the client left: the engine frees the slot
                self._record(call, gen)
            else:
                for token in gen.token_ids:
                    if piece := deltas.add(token):
                        yield api.chunk(req, rid, created, text=piece)
        except api.ApiError as exc:
            yield api.error_event(exc)
            return
        except Exception as exc:
            log.exception("agent endpoint: a streamed call failed")
            yield api.error_event(api.ApiError(500, f"the engine failed: {exc!r}"))
            return
        out = generated_text(gen, tokenizer)
        _, calls = _answer(out, tool_format)
        if rest := deltas.rest(out[: out.index(markers[0])] if calls else out):
            yield api.chunk(req, rid, created, text=rest)
        if calls:
            yield api.chunk(req, rid, created, calls=calls)
        yield api.chunk(req, rid, created, finish=api.finish_reason(gen.finish_reason, calls))
        yield api.DONE

    def _prompt(self, req: api.Request, tokenizer: Any) -> tuple[list[int], Any]:
        """(the prompt ids, the tool-call format to parse the answer by, or None)."""
        if req.messages is None:
            assert req.prompt is not None
            return tokenizer.encode(req.prompt), None
        template = getattr(tokenizer, "chat_template", None)
        tool_format, variables = None, {}
        if req.tools:
            try:
                tool_format = tc.format_for(template)
            except tc.ToolRequestError as exc:
                raise api.ApiError(400, exc.message, param=exc.param) from None
            variables["tools"] = list(req.tools)
        try:  # with the generation prompt
            text = render_chat(tokenizer, tc.template_messages(req.messages), **variables)
        except ValueError as exc:
            raise api.ApiError(400, str(exc), param="messages") from None
        return tokenizer.encode(text), tool_format if req.tool_choice == "auto" else None


def _answer(out: str, tool_format: Any) -> tuple[str | None, list[dict[str, Any]]]:
    """(the content, the tool calls in OpenAI's form) of the generated text."""
    if tool_format is None:
        return out, []
    content, found = tool_format.parse(out)
    return content, tc.openai_calls(found)
