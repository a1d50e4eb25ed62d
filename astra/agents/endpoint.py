"""The agent endpoint's work: one OpenAI-style call of an episode, run on the RaaS's engine.

The key selects the episode (401 when none is open under it); the model names a policy the
engine serves (404 otherwise). A chat request is rendered with the policy's chat template
(generation prompt added) and tokenized by the policy's tokenizer; a text request is
tokenized as given. The engine generates at the policy's current version, and the episode
records the exact prompt ids and the generation (tokens, log-probs, versions) before the
answer goes out. With `tools`, the prompt is rendered with them (refused with 400 when the
template has no tool support) and the answer's tool calls are parsed by the template's
convention (astra.agents.tool_calls); the recorded tokens are the engine's, untouched. A
streamed answer is the same generation sent in pieces once it is done (the
engine API returns whole generations): the protocol streams, the latency does not.
Knows nothing of HTTP framing (servers/agent_http.py) or gRPC.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from astra.agents import openai_api as api
from astra.agents import tool_calls as tc
from astra.agents.recorder import EpisodeLimit, Episodes, check_room
from astra.engine.api import InferenceEngine, Sampling
from astra.engine.chat import render_chat
from astra.workflows.episode import generated_text


@dataclass(frozen=True)
class Gateway:
    """What the `agent` workflow is given: where agents call, and the episodes behind it."""

    base_url: str
    episodes: Episodes


class AgentEndpoint:
    def __init__(self, engine: InferenceEngine, episodes: Episodes | None = None) -> None:
        self.engine = engine
        self.episodes = episodes if episodes is not None else Episodes()
        self.served = tuple(engine.policy_ids)

    def models(self) -> dict[str, Any]:
        data = [{"id": p, "object": "model", "owned_by": "astra"} for p in self.served]
        return {"object": "list", "data": data}

    async def complete(self, key: str, raw: bytes, *, chat: bool) -> tuple[api.Request, Any]:
        """(the request, its body: a dict, or the list of stream events); raises ApiError."""
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
        gen = await self.engine.generate(req.model, prompt_ids, sampling)
        if not episode.open:
            raise api.ApiError(401, "the episode ended during the call", code="invalid_api_key")
        episode.record(prompt_ids, gen, req.model)
        out = generated_text(gen, tokenizer)
        content, calls = out, []
        if tool_format is not None:
            content, found = tool_format.parse(out)
            calls = tc.openai_calls(found)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if req.stream:
            if calls:
                pieces = [content] if content else []
            else:
                pieces = [tokenizer.decode([t]) for t in gen.token_ids] if out else []
                if "".join(pieces) != out:  # a multi-token character, or a stop string cut
                    pieces = [out] if out else []
            created = int(time.time())
            events = [api.chunk(req, rid, created)] if chat else []
            events += [api.chunk(req, rid, created, text=p) for p in pieces]
            if calls:
                events.append(api.chunk(req, rid, created, calls=calls))
            finish = api.finish_reason(gen.finish_reason, calls)
            events += [api.chunk(req, rid, created, finish=finish), api.DONE]
            return req, events
        tokens = api.usage(len(prompt_ids), len(gen.token_ids))
        return req, api.response(req, rid, content, gen.finish_reason, tokens, calls)

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
