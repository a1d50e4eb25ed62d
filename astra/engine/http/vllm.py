"""`VLLMEngine`: a policy served by vLLM's OpenAI-compatible server, with weight reloads from disk.

Generation goes through `/v1/completions` exactly as astra.engine.http.openai
describes (token-id prompts, `logprobs: 1`, `return_tokens_as_token_ids`,
vLLM's `top_k`, `stop_token_ids`, `min_p`, `repetition_penalty`, `seed`).
Log-probs are vLLM's `--logprobs-mode` output. `launch` starts the server
with processed_logprobs (log_softmax(logits / temperature), after top-k/top-p)
unless the extra arguments choose a mode; vLLM's default raw_logprobs
(before temperature) agrees with the trainer at temperature 1 (or 0) only, so
an engine on a raw_logprobs server refuses other temperatures (see
astra.engine.http.openai).

Weight reloads rely on vLLM's development endpoints, mounted only when the
server runs with `VLLM_SERVER_DEV_MODE=1` (`launch` sets it); their HTTP
shape changes between releases, so the update is one hook,
`reload_weights_from_disk`, that a later session can point at the
weight-transfer engine (`--weight-transfer-config`, `/init_weight_transfer_engine`,
`/update_weights`) instead. What this version calls:
- `POST /pause?mode=abort&wait_for_inflight_requests=false&clear_cache=true`
  (the query names of recent releases and of 0.14; running requests are
  aborted and come back with what they had; KV and prefix caches cleared);
- `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": PATH}}`:
  the GPU worker's `reload_weights(weights_path=...)` of recent releases, as
  NeMo-RL's remote vLLM synchronizer uses it (older releases only reload the
  launch path: their reload ignores or rejects `weights_path`);
- `POST /resume`.
A 404 on any of them means dev mode is off or the release lacks it:
FailedPrecondition(VLLM_DEV_ENDPOINT_MISSING). tools/gpu/run_engines.py
checks the whole path on a real server.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from astra.engine.api import Tokenizer
from astra.engine.http.launch import start_server
from astra.engine.http.openai import LOGPROBS_MODES, CompletionsEngine
from astra.errors import AstraError, FailedPrecondition, InvalidArgument

DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


class VLLMEngine(CompletionsEngine):
    """One policy on one vLLM server (attached by URL or launched by `launch`)."""

    name = "vllm"
    swappable = True
    reload_rpc_method = "reload_weights"

    def __init__(
        self,
        base_url: str,
        model: str,
        policy_id: str,
        tokenizer: Tokenizer,
        *,
        update_timeout_s: float = 900.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(base_url, model, policy_id, tokenizer, **kwargs)
        self.update_timeout_s = update_timeout_s

    @classmethod
    def launch(
        cls,
        model_path: str | os.PathLike[str],
        policy_id: str,
        tokenizer: Tokenizer,
        *,
        served_model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] = "vllm-server.log",
        python: str = sys.executable,
        **kwargs: Any,
    ) -> VLLMEngine:
        """Starts `python -m vllm.entrypoints.openai.api_server` in dev mode, with
        `--logprobs-mode processed_logprobs` unless `extra_args` name a mode; await
        `wait_ready()` next."""
        args = ["--model", str(model_path), "--served-model-name", served_model_name]
        mode = logprobs_mode_of(extra_args)
        if mode is None:
            mode = "processed_logprobs"
            args += ["--logprobs-mode", mode]
        elif mode not in LOGPROBS_MODES:
            raise InvalidArgument(
                f"--logprobs-mode {mode}: astra needs log-probs ({', '.join(LOGPROBS_MODES)})",
                reason="INVALID_FIELD",
                field_violations=[("engine_args", f"--logprobs-mode {mode}")],
            )
        proc = start_server(
            python,
            "vllm.entrypoints.openai.api_server",
            args,
            host=host,
            port=port,
            extra_args=extra_args,
            log_path=log_path,
            env=DEV_MODE_ENV,
        )
        kwargs["logprobs_mode"] = mode
        return cls(proc.url, served_model_name, policy_id, tokenizer, process=proc, **kwargs)

    async def _pause(self) -> None:
        query = {"mode": "abort", "wait_for_inflight_requests": False, "clear_cache": True}
        await self._dev_call("/pause", None, query=query, timeout_s=60.0)

    async def _load_from_disk(self, path: Path, version: int) -> None:
        await self.reload_weights_from_disk(path, version)

    async def reload_weights_from_disk(self, path: Path, version: int) -> None:
        """The weight-update hook: loads the checkpoint at `path` into the paused server.

        Replace this method to use another vLLM update path (weight-transfer
        engine, a worker extension); the pause/resume and version bookkeeping
        around it stay as they are. `version` is not sent: vLLM's reload has no
        version label, the adapter keeps it.
        """
        body = {"method": self.reload_rpc_method, "kwargs": {"weights_path": str(path)}}
        try:
            await self._dev_call("/collective_rpc", body, timeout_s=self.update_timeout_s)
        except FailedPrecondition:
            raise
        except AstraError as exc:
            raise FailedPrecondition(
                f"vLLM could not reload {path} as version {version}: {exc.message}",
                reason="WEIGHT_UPDATE_FAILED",
                metadata={"path": str(path)},
            ) from exc

    async def _resume(self) -> None:
        await self._dev_call("/resume", None, timeout_s=60.0)

    async def _dev_call(
        self,
        path: str,
        body: dict[str, Any] | None,
        *,
        query: dict[str, Any] | None = None,
        timeout_s: float,
    ) -> None:
        try:
            await self.client.request(
                "POST", path, body, query=query, timeout_s=timeout_s, expect_json=False
            )
        except AstraError as exc:
            if exc.metadata.get("http_status") in ("404", "405"):
                raise FailedPrecondition(
                    f"vLLM at {self.client.base_url} has no {path}: start it with "
                    f"VLLM_SERVER_DEV_MODE=1 on a release that has it ({exc.message})",
                    reason="VLLM_DEV_ENDPOINT_MISSING",
                ) from exc
            raise


def logprobs_mode_of(args: Sequence[str]) -> str | None:
    """The `--logprobs-mode` value in vLLM server arguments, or None."""
    for i, arg in enumerate(args):
        if arg.startswith("--logprobs-mode="):
            return arg.split("=", 1)[1]
        if arg == "--logprobs-mode" and i + 1 < len(args):
            return args[i + 1]
    return None
