"""Model shapes the benchmarks share."""

from __future__ import annotations

from typing import Any

# ~100M parameters (100.1M, tied embeddings), Qwen3 architecture: GQA, q/k norm; applied over
# astra.engine.tiny.TINY_CONFIG. Used by the trainer and engine benchmarks alike.
M100_OVERRIDES: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "pad_token_id": 0,
    "bos_token_id": 1,
}
