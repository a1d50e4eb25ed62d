"""`ModelConfig`: the architecture of a decoder, read from a Hugging Face config.json.

Covers the Qwen3 family (per-head q/k RMSNorm, explicit head_dim) and the Llama
family (no q/k norm, optional llama3/linear RoPE scaling, optional biases).
Both the transformers 4 spelling (`rope_theta`, `rope_scaling`) and the
transformers 5 one (`rope_parameters`) are read. Anything this engine cannot
run exactly (sliding windows, other RoPE types, other activations) is refused
here, by name, rather than run with different numerics. Plain Python: no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astra.errors import InvalidArgument

FAMILIES = ("qwen3", "llama")
ROPE_TYPES = ("default", "linear", "llama3")


def _refuse(what: str, detail: str) -> InvalidArgument:
    return InvalidArgument(
        f"config.json {what}: {detail}", reason="UNSUPPORTED_MODEL", metadata={"field": what}
    )


@dataclass(frozen=True)
class ModelConfig:
    """Everything the torch model needs to know about its shapes and numerics."""

    model_type: str  # "qwen3" or "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted items of the HF dict; () = none
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v/o projections
    mlp_bias: bool = False  # bias on gate/up/down (Llama only)
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises every query and key head before RoPE; Llama does not."""
        return self.model_type == "qwen3"

    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Reads a parsed config.json; raises InvalidArgument for what it cannot run exactly."""
        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise _refuse("model_type", f"{model_type!r} is not one of {FAMILIES}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse("hidden_act", f"{act!r}; only silu (SwiGLU) is implemented")
        if raw.get("use_sliding_window"):
            raise _refuse("use_sliding_window", "sliding-window attention is not implemented")
        rope = dict(raw.get("rope_parameters") or {})
        scaling = dict(raw.get("rope_scaling") or {}) or {
            k: v for k, v in rope.items() if k != "rope_theta"
        }
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") not in ROPE_TYPES:
            raise _refuse("rope_scaling", f"rope_type {scaling.get('rope_type')!r}")
        if scaling.get("rope_type", "default") == "default":
            scaling = {}
        heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=tuple(sorted(scaling.items())),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=tuple(int(i) for i in eos_ids),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> ModelConfig:
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise InvalidArgument(
                f"{path} is missing", reason="NO_MODEL_CONFIG", metadata={"path": str(path)}
            )
        return cls.from_hf(json.loads(path.read_text()))
