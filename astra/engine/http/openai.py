"""`OpenAIEngine`: a policy served by any OpenAI-compatible `/v1/completions` endpoint.

For frozen policies (a reference or opponent model) or policies whose server
is hot-loaded by someone else. Request: `POST /v1/completions` with
`model`, `prompt` as a list of token ids, `max_tokens`, `temperature`,
`top_p`, `seed`, `stop` (strings), `logprobs: 1`, `n: 1`, `echo: false`.
With `extensions=True` (vLLM, SGLang) it also sends `top_k`,
`stop_token_ids`, `min_p: 0`, `repetition_penalty: 1` (so the server's
generation_config defaults do not change the distribution) and
`return_tokens_as_token_ids: true`.

Response fields required in `choices[0]`: `finish_reason` ("stop" or
"length"; "abort" is read as aborted), `logprobs.token_logprobs` (one float
per new token), and the new token ids, either as `token_ids` (vLLM's
`return_token_ids`) or as `logprobs.tokens` strings "token_id:<id>" (vLLM's
`return_tokens_as_token_ids`). An endpoint that returns neither gets
Unavailable(ENGINE_BAD_RESPONSE): text tokens cannot be mapped back to ids
reliably. `stop_reason` (vLLM: the matched string or token id) is read when
present.

Log-probs are whatever the server reports, and the trainer scores tokens by
log_softmax(logits / temperature). vLLM's default (`--logprobs-mode
raw_logprobs`) is log_softmax of the raw logits, which agrees only at
temperature 1 (or 0, counted as 1), so an engine told its server reports raw
log-probs (`logprobs_mode="raw_logprobs"`, the default for an attached server)
refuses any other temperature (InvalidArgument naming sampling.temperature,
reason LOGPROBS_BEFORE_TEMPERATURE) rather than hand the trainer importance
ratios that are off at every token. With `processed_logprobs` (what
`VLLMEngine.launch` starts vLLM with) they are taken after temperature (and
after top-k/top-p: the distribution actually sampled), so every temperature
is served. Versions: every
token carries the engine's label; `swap_weights` raises FailedPrecondition
(FROZEN_ENDPOINT) unless `hot_loaded=True`, where it only relabels.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from astra.engine.api import Sampling, Tokenizer
from astra.engine.http.base import HTTPEngine
from astra.engine.http.result import Segment
from astra.errors import FailedPrecondition, Unavailable, invalid_field

RAW_LOGPROBS = (
    "server log-probs as reported; for vLLM's default raw_logprobs: log_softmax(logits) of the "
    "sampled token before temperature, top-k and top-p (the built-in convention at temperature "
    "1 or 0 only)"
)
PROCESSED_LOGPROBS = (
    "server log-probs as reported; vLLM's processed_logprobs: log_softmax(logits / temperature) "
    "of the sampled token after top-k and top-p (the distribution sampled from)"
)
LOGPROBS_MODES = {"raw_logprobs": RAW_LOGPROBS, "processed_logprobs": PROCESSED_LOGPROBS}
TOKEN_ID_PREFIX = "token_id:"


def completion_body(
    model: str,
    context: list[int],
    sampling: Sampling,
    max_new: int,
    *,
    extensions: bool,
) -> dict[str, Any]:
    """The /v1/completions request for one continuation of `context`."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": context,
        "max_tokens": max_new,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "n": 1,
        "echo": False,
        "stream": False,
        "logprobs": 1,
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop_strings:
        body["stop"] = list(sampling.stop_strings)
    if extensions:
        body["top_k"] = sampling.top_k if sampling.top_k > 0 else -1
        body["min_p"] = 0.0
        body["repetition_penalty"] = 1.0
        body["return_tokens_as_token_ids"] = True
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
    return body


def _bad(msg: str) -> Unavailable:
    return Unavailable(f"completion response: {msg}", reason="ENGINE_BAD_RESPONSE")


def parse_completion(answer: Any) -> Segment:
    """Reads `choices[0]` of a /v1/completions response (see the module docstring)."""
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise _bad(f"no choices in {str(answer)[:200]}") from None
    finish = choice.get("finish_reason")
    lp = choice.get("logprobs") or {}
    token_logprobs = lp.get("token_logprobs")
    ids = choice.get("token_ids")
    if ids is None and isinstance(lp.get("tokens"), list):
        try:
            ids = [int(str(t).removeprefix(TOKEN_ID_PREFIX)) for t in lp["tokens"]]
        except ValueError:
            raise _bad(
                "logprobs.tokens are text, not token ids; the server must support "
                "return_tokens_as_token_ids or return_token_ids"
            ) from None
    if ids is None or token_logprobs is None:
        if finish == "abort":
            return Segment([], [], "abort")  # aborted before anything usable came back
        raise _bad("no token ids or no logprobs.token_logprobs in choices[0]")
    if len(ids) != len(token_logprobs) or any(x is None for x in token_logprobs):
        if finish == "abort":
            return Segment([], [], "abort")
        raise _bad(f"{len(ids)} token ids but {len(token_logprobs)} log-probs")
    stop = choice.get("stop_reason")
    return Segment(
        [int(t) for t in ids],
        [float(x) for x in token_logprobs],
        str(finish),
        stop if isinstance(stop, str | int) and not isinstance(stop, bool) else None,
    )


class CompletionsEngine(HTTPEngine):
    """Shared by OpenAIEngine and VLLMEngine: generation through /v1/completions."""

    extensions = True

    def __init__(
        self,
        base_url: str,
        model: str,
        policy_id: str,
        tokenizer: Tokenizer,
        *,
        logprobs_mode: str = "raw_logprobs",
        **kwargs: Any,
    ) -> None:
        """`logprobs_mode`: what the server's log-probs are (vLLM's `--logprobs-mode`:
        raw_logprobs or processed_logprobs); `kwargs` are HTTPEngine's (version, api_key,
        max_running, timeouts, process)."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode!r}: one of {sorted(LOGPROBS_MODES)}")
        super().__init__(base_url, policy_id, tokenizer, **kwargs)
        self.model = model
        self.logprobs_mode = logprobs_mode
        self.logprob_convention = LOGPROBS_MODES[logprobs_mode]

    async def _probe(self) -> None:
        await self.client.request("GET", "/v1/models", timeout_s=10.0)

    def _check_sampling(self, sampling: Sampling) -> None:
        if not self.extensions and sampling.top_k > 0:
            raise invalid_field(
                "sampling.top_k", f"not supported by the {self.name} endpoint (extensions off)"
            )
        if self.logprobs_mode == "raw_logprobs" and sampling.temperature not in (0.0, 1.0):
            raise invalid_field(
                "sampling.temperature",
                f"{sampling.temperature}: the {self.name} server reports log-probs before "
                "temperature (raw_logprobs), which the trainer's ratios take after it; sample at "
                "temperature 1, or run the server with --logprobs-mode processed_logprobs "
                "(astra's vLLM launch does) and say so (--engine-logprobs-mode)",
                reason="LOGPROBS_BEFORE_TEMPERATURE",
            )

    def _segment_request(
        self, context: list[int], sampling: Sampling, max_new: int, rid: str
    ) -> tuple[str, dict[str, Any]]:
        body = completion_body(self.model, context, sampling, max_new, extensions=self.extensions)
        return "/v1/completions", body

    def _parse_segment(self, answer: Any, sampling: Sampling) -> Segment:
        return parse_completion(answer)


class OpenAIEngine(CompletionsEngine):
    """A frozen (or externally hot-loaded) policy behind an OpenAI-compatible endpoint.

    `extensions=False` sends only the standard OpenAI fields: top_k > 0 is then
    refused (InvalidArgument naming sampling.top_k) and stop token ids are
    enforced on the client (the server may generate past them; the tokens
    after the stop are dropped). The endpoint must still return token ids.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        policy_id: str,
        tokenizer: Tokenizer,
        version: int = 0,
        *,
        hot_loaded: bool = False,
        extensions: bool = True,
        logprobs_mode: str = "raw_logprobs",
        api_key: str | None = None,
        max_seq_len: int | None = None,
        max_running: int = 256,
        request_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(
            base_url,
            model,
            policy_id,
            tokenizer,
            version=version,
            logprobs_mode=logprobs_mode,
            api_key=api_key,
            max_seq_len=max_seq_len,
            max_running=max_running,
            request_timeout_s=request_timeout_s,
        )
        self.hot_loaded = hot_loaded
        self.extensions = extensions

    async def swap_weights(
        self, versions: Mapping[str, int], state: Mapping[str, Mapping[str, object]]
    ) -> None:
        """Relabels the version when `hot_loaded`; a frozen endpoint refuses (FROZEN_ENDPOINT)."""
        for policy in (*versions, *state):
            self._policy(policy, "versions")
        if not self.hot_loaded:
            raise FailedPrecondition(
                f"policy {self._policy_id!r} is served by a frozen OpenAI-compatible endpoint "
                f"({self.client.base_url}, model {self.model!r}); it cannot load weights",
                reason="FROZEN_ENDPOINT",
                metadata={"policy_id": self._policy_id},
            )
        if any(not isinstance(v, int) or isinstance(v, bool) for v in versions.values()):
            raise invalid_field("versions", "versions must be integers")
        if self._policy_id in versions:
            self._version = int(versions[self._policy_id])  # weights were loaded externally

    async def _swap_from_disk(self, version: int, path: Path) -> None:  # pragma: no cover
        raise FailedPrecondition("frozen endpoint", reason="FROZEN_ENDPOINT")
