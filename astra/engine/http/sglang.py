"""`SGLangEngine`: a policy served by an SGLang server through its native HTTP API.

Generation: `POST /generate` with `input_ids`, `rid`, `return_logprob: true`,
`logprob_start_len: -1` and `sampling_params` {max_new_tokens, temperature,
top_p, top_k (-1 = off), min_p: 0, repetition_penalty: 1, stop,
stop_token_ids} — every distribution setting is sent, because SGLang
otherwise takes defaults from the model's generation_config. The answer's
`meta_info.output_token_logprobs` ([logprob, token_id, text] per new token)
gives ids and log-probs; `meta_info.finish_reason` ({type: stop|length|abort,
matched}) the end; `meta_info.weight_version` is copied into
`Generation.meta["server_weight_version"]` as a cross-check only.

Log-probs: SGLang's default is log_softmax(logits / temperature) of the
sampled token before top-k/top-p (greedy: temperature 1), the built-in
engine's convention. Do not set SGLANG_RETURN_ORIGINAL_LOGPROB on the
server (it switches to pre-temperature log-probs). Seeds are sent as
`sampling_seed` only with `send_seed=True` (recent SGLang; honoured under
`--enable-deterministic-inference`).

Weight updates (the portable path of SGLang's "SGLang for RL" guide):
`POST /pause_generation {mode: "abort"}` (running requests come back with
finish type "abort" and their partial output) ->
`POST /update_weights_from_disk {model_path, weight_version, flush_cache:
true}` (400 with success false on failure) -> `POST /continue_generation`.
Cancelling a generate call closes its connection and sends
`POST /abort_request {rid}`. Launch: `python -m sglang.launch_server
--model-path PATH --host H --port P [extra args]`, ready when `GET /health`
answers 200.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from astra.engine.api import Sampling, Tokenizer
from astra.engine.http.base import HTTPEngine
from astra.engine.http.launch import start_server
from astra.engine.http.result import Segment
from astra.errors import AstraError, FailedPrecondition, Unavailable

SGLANG_LOGPROBS = (
    "log_softmax(logits / temperature) of the sampled token over the whole vocabulary, "
    "before top-k/top-p; temperature 0 counted as 1 (SGLang's default)"
)


def _bad(msg: str) -> Unavailable:
    return Unavailable(f"SGLang /generate response: {msg}", reason="ENGINE_BAD_RESPONSE")


class SGLangEngine(HTTPEngine):
    """One policy on one SGLang server (attached by URL or launched by `launch`)."""

    name = "sglang"
    swappable = True
    logprob_convention = SGLANG_LOGPROBS

    def __init__(
        self,
        base_url: str,
        policy_id: str,
        tokenizer: Tokenizer,
        *,
        update_timeout_s: float = 900.0,
        send_seed: bool = False,
        **kwargs: Any,
    ) -> None:
        """`kwargs` are HTTPEngine's (version, api_key, max_running, on_swap, timeouts, process)."""
        super().__init__(base_url, policy_id, tokenizer, **kwargs)
        self.update_timeout_s = update_timeout_s
        self.send_seed = send_seed

    @classmethod
    def launch(
        cls,
        model_path: str | os.PathLike[str],
        policy_id: str,
        tokenizer: Tokenizer,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] = "sglang-server.log",
        python: str = sys.executable,
        **kwargs: Any,
    ) -> SGLangEngine:
        """Starts `python -m sglang.launch_server` on `model_path`; await `wait_ready()` next."""
        proc = start_server(
            python,
            "sglang.launch_server",
            ["--model-path", str(model_path)],
            host=host,
            port=port,
            extra_args=extra_args,
            log_path=log_path,
        )
        return cls(proc.url, policy_id, tokenizer, process=proc, **kwargs)

    # -- generation --------------------------------------------------------------------

    def _segment_request(
        self, context: list[int], sampling: Sampling, max_new: int, rid: str
    ) -> tuple[str, dict[str, Any]]:
        params: dict[str, Any] = {
            "max_new_tokens": max_new,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
        }
        if sampling.stop_strings:
            params["stop"] = list(sampling.stop_strings)
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if self.send_seed and sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        body = {
            "input_ids": context,
            "rid": rid,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        return "/generate", body

    def _parse_segment(self, answer: Any, sampling: Sampling) -> Segment:
        if isinstance(answer, list) and len(answer) == 1:
            answer = answer[0]
        if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
            raise _bad(f"no meta_info in {str(answer)[:200]}")
        info = answer["meta_info"]
        reason = info.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        matched = reason.get("matched") if isinstance(reason, dict) else None
        rows = info.get("output_token_logprobs")
        if rows is None:
            if kind == "abort":
                return Segment([], [], "abort")
            raise _bad("no meta_info.output_token_logprobs (return_logprob ignored?)")
        try:
            ids = [int(r[1]) for r in rows]
            lps = [float(r[0]) for r in rows]
        except (TypeError, ValueError, IndexError):
            if kind == "abort":
                return Segment([], [], "abort")
            raise _bad(f"malformed output_token_logprobs {str(rows)[:200]}") from None
        out_ids = answer.get("output_ids")
        if isinstance(out_ids, list) and out_ids and [int(t) for t in out_ids] != ids:
            raise _bad("output_ids disagree with output_token_logprobs")
        meta: dict[str, Any] = {}
        if kind == "abort" and isinstance(reason, dict) and reason.get("message"):
            meta["abort_message"] = str(reason["message"])[:500]
        if info.get("weight_version") is not None:
            meta["server_weight_version"] = info["weight_version"]
        stop = matched if isinstance(matched, str | int) and not isinstance(matched, bool) else None
        return Segment(ids, lps, str(kind), stop, meta)

    async def _cancel_request(self, rid: str) -> None:
        with contextlib.suppress(AstraError):
            await self.client.request("POST", "/abort_request", {"rid": rid}, timeout_s=5.0,
                                      expect_json=False)  # fmt: skip

    # -- weight updates ------------------------------------------------------------------

    async def _pause(self) -> None:
        await self._control("/pause_generation", {"mode": "abort"})

    async def _load_from_disk(self, path: Path, version: int) -> None:
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        try:
            answer = await self.client.request(
                "POST", "/update_weights_from_disk", body, timeout_s=self.update_timeout_s
            )
        except AstraError as exc:
            raise FailedPrecondition(
                f"SGLang could not load {path} as version {version}: {exc.message}",
                reason="WEIGHT_UPDATE_FAILED",
                metadata={"path": str(path)},
            ) from exc
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise FailedPrecondition(
                f"SGLang could not load {path} as version {version}: {answer}",
                reason="WEIGHT_UPDATE_FAILED",
                metadata={"path": str(path)},
            )

    async def _resume(self) -> None:
        await self._control("/continue_generation", {})

    async def _control(self, path: str, body: dict[str, Any]) -> None:
        await self.client.request("POST", path, body, timeout_s=60.0, expect_json=False)

    async def server_weight_version(self) -> str | None:
        """What `GET /get_weight_version` says (recent SGLang); None when it is not offered."""
        with contextlib.suppress(AstraError):
            answer = await self.client.request("GET", "/get_weight_version", timeout_s=10.0)
            if isinstance(answer, dict):
                value = answer.get("weight_version")
                return None if value is None else str(value)
        return None
