"""The `tiny` model, seeded random models, and `load_model` for `tiny` or a local directory.

`tiny` is a 2-layer Qwen3-architecture decoder (hidden 64, 4 query heads and
2 kv heads of 32, tied embeddings) over the 100-id `CharTokenizer`. Its weights come
from a CPU `torch.Generator` seeded with `TINY_SEED`, drawn in sorted
parameter-name order in fp32, so every process on every machine builds the
same bits (cast afterwards to the dtype asked for). `save_tiny` writes it as
a Hugging Face directory through astra.weights, which the WeightService and
the trainer read like any other checkpoint. Never downloads anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from astra.engine.api import Tokenizer
from astra.engine.model import CausalLM
from astra.engine.model_config import ModelConfig
from astra.engine.tokenizer import CHAR_TOKENIZER, CharTokenizer, load_tokenizer
from astra.engine.torch_weights import load_state, save_state, torch_dtype

TINY = "tiny"
TINY_SEED = 0
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": CharTokenizer.vocab_size,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention runs head sizes 32, 64, 80, ... (not 16)
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "pad_token_id": CharTokenizer.pad_id,
    "bos_token_id": CharTokenizer.bos_id,
    "eos_token_id": CharTokenizer.eos_id,
    "torch_dtype": "float32",
    "astra_tokenizer": CHAR_TOKENIZER,
}
EMBED_STD = 0.25  # next-token entropy ~2.3 nats: varied samples, not uniform noise


@torch.no_grad()
def random_model(
    config: ModelConfig | dict[str, Any],
    seed: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
) -> CausalLM:
    """A model with seeded weights: norms 1 + N(0, 0.1), embeddings N(0, EMBED_STD), linears N(0, 1/fan_in)."""
    cfg = config if isinstance(config, ModelConfig) else ModelConfig.from_hf(config)
    gen = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        elif name.endswith("embed_tokens.weight"):
            param.copy_(EMBED_STD * noise)
        elif name.endswith("bias"):
            param.copy_(0.02 * noise)
        else:
            param.copy_(noise / param.shape[-1] ** 0.5)
    return model.to(device=device, dtype=torch_dtype(dtype)).eval()


def tiny_model(
    device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32
) -> CausalLM:
    return random_model(TINY_CONFIG, TINY_SEED, device=device, dtype=dtype)


def save_model(
    directory: str | os.PathLike[str],
    model: CausalLM,
    config: dict[str, Any],
    *,
    version: str | None = None,
) -> dict[str, Any]:
    """Writes a model as a full version directory; `directory` must not exist yet."""
    return save_state(directory, model.hf_state_dict(), config, version=version)


def save_tiny(directory: str | os.PathLike[str], *, version: str | None = None) -> Path:
    """Writes the tiny model (fp32) as a Hugging Face directory; returns its path."""
    save_model(directory, tiny_model(), TINY_CONFIG, version=version)
    return Path(directory)


def load_model(
    path_or_tiny: str | os.PathLike[str],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
) -> tuple[CausalLM, Tokenizer]:
    """(model in eval mode, tokenizer) from `tiny` or a local HF directory.

    `dtype` defaults to the directory's config dtype (fp32 for tiny). Weights
    load by Hugging Face parameter name; a missing tensor, an unknown one or a
    shape mismatch raises InvalidArgument.
    """
    if str(path_or_tiny) == TINY:
        return tiny_model(device, dtype or torch.float32), CharTokenizer()
    cfg = ModelConfig.from_dir(path_or_tiny)
    target = torch_dtype(dtype or cfg.torch_dtype)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(target)
    model.tie()
    model.load_weights(load_state(path_or_tiny))
    return model.eval(), load_tokenizer(path_or_tiny)
