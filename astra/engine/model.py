"""`CausalLM`: a Qwen3/Llama-architecture decoder in plain torch, named as Hugging Face names it.

Per layer: RMSNorm -> grouped-query attention (Qwen3: RMSNorm on every q and k
head; then RoPE) -> residual -> RMSNorm -> SwiGLU MLP -> residual; a final
RMSNorm and an lm_head that may share the embedding matrix. Parameter names are
those of transformers' Qwen3ForCausalLM / LlamaForCausalLM
(`model.layers.{i}.self_attn.q_proj.weight`, ...), so checkpoints load by
name, and the numerics follow them (RMSNorm and RoPE tables in fp32).

Three entry points: `forward_full` (no cache; checks and training),
`prefill` and `decode` (a `KVCache` shared by a batch of sequences, each at
its own position). Knows nothing of sampling, scheduling or files.

Legend: B batch, T positions, D hidden, H query heads, K kv heads, d head_dim,
F intermediate, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astra.engine.kv_cache import CacheStep, KVCache
from astra.engine.model_config import ModelConfig
from astra.errors import InvalidArgument


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def inv_frequencies(cfg: ModelConfig, device: torch.device) -> Tensor:
    """RoPE inverse frequencies [d/2] in fp32, with linear or llama3 scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    scaling = dict(cfg.rope_scaling)
    if cfg.rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if cfg.rope_type == "llama3":
        factor, old_len = (
            float(scaling["factor"]),
            float(scaling["original_max_position_embeddings"]),
        )
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(inv_freq: Tensor, pos_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [B, 1, T, d] (half-split layout) for the given positions."""
    freqs_BTh = pos_BT[..., None].float() * inv_freq
    emb_BTd = torch.cat((freqs_BTh, freqs_BTh), dim=-1)
    return emb_BTd.cos().to(dtype)[:, None], emb_BTd.sin().to(dtype)[:, None]


def apply_rope(x_BHTd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x_BHTd.shape[-1] // 2
    rotated = torch.cat((-x_BHTd[..., half:], x_BHTd[..., :half]), dim=-1)
    return x_BHTd * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        D, H, K, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, H, K, d
        self.q_proj = nn.Linear(D, H * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(D, K * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(D, K * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * d, D, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x_BTD: Tensor, rope: tuple[Tensor, Tensor], step: CacheStep | None) -> Tensor:
        B, T, _ = x_BTD.shape
        q_BTHd = self.q_proj(x_BTD).view(B, T, self.heads, self.head_dim)
        k_BTKd = self.k_proj(x_BTD).view(B, T, self.kv_heads, self.head_dim)
        v_BKTd = self.v_proj(x_BTD).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q_BTHd, k_BTKd = self.q_norm(q_BTHd), self.k_norm(k_BTKd)
        q_BHTd = apply_rope(q_BTHd.transpose(1, 2), *rope)
        k_BKTd = apply_rope(k_BTKd.transpose(1, 2), *rope)
        if step is None:
            out_BHTd = F.scaled_dot_product_attention(
                q_BHTd, k_BKTd, v_BKTd, is_causal=True, enable_gqa=True
            )
        else:
            out_BHTd = step.attend(self.layer, q_BHTd, k_BKTd, v_BKTd)
        return self.o_proj(out_BHTd.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, Fi, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(D, Fi, bias=bias)
        self.up_proj = nn.Linear(D, Fi, bias=bias)
        self.down_proj = nn.Linear(Fi, D, bias=bias)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h_BTD: Tensor, rope: tuple[Tensor, Tensor], step: CacheStep | None) -> Tensor:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), rope, step)
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))


class Backbone(nn.Module):
    """`model.*` in Hugging Face names: embedding, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._inv_freq: dict[torch.device, Tensor] = {}

    def forward(self, ids_BT: Tensor, pos_BT: Tensor, step: CacheStep | None) -> Tensor:
        h_BTD = self.embed_tokens(ids_BT)
        inv_freq = self._inv_freq.get(ids_BT.device)
        if inv_freq is None:
            with torch.inference_mode(False):  # a plain tensor, usable by training forwards too
                inv_freq = inv_frequencies(self.cfg, ids_BT.device)
            self._inv_freq[ids_BT.device] = inv_freq
        rope = rope_tables(inv_freq, pos_BT, h_BTD.dtype)
        for layer in self.layers:
            h_BTD = layer(h_BTD, rope, step)
        return self.norm(h_BTD)


class CausalLM(nn.Module):
    """The whole decoder; `lm_head.weight` is the embedding when the config ties them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie()

    def tie(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self) -> KVCache:
        c = self.cfg
        K, d = c.num_key_value_heads, c.head_dim
        return KVCache(c.num_hidden_layers, K, d, self.dtype, self.device)

    def forward_full(self, ids_BT: Tensor) -> Tensor:
        """logits [B, T, V] of every position, no cache: the reference the cached paths match."""
        B, T = ids_BT.shape
        pos_BT = torch.arange(T, device=ids_BT.device).expand(B, T)
        return self.lm_head(self.model(ids_BT, pos_BT, None))

    forward = forward_full

    def prefill(self, ids_BT: Tensor, last_B: Tensor, cache: KVCache, slot0: int) -> Tensor:
        """Writes right-padded prompts into cache rows slot0.. and returns logits [B, V] at last_B."""
        B, T = ids_BT.shape
        pos_BT = torch.arange(T, device=ids_BT.device).expand(B, T)
        h_BTD = self.model(ids_BT, pos_BT, CacheStep.prefill(cache, slot0, B, T))
        return self.lm_head(h_BTD[torch.arange(B, device=ids_BT.device), last_B])

    def decode(self, ids_B: Tensor, pos_B: Tensor, cache: KVCache) -> Tensor:
        """One new token per cache row 0..B-1 at its own position; returns logits [B, V]."""
        h_B1D = self.model(ids_B[:, None], pos_B[:, None], CacheStep.decode(cache, pos_B))
        return self.lm_head(h_B1D[:, 0])

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Parameters by Hugging Face name; a tied lm_head is left out, as HF saves it."""
        state = dict(self.state_dict())
        if self.cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def check_state(self, state: Mapping[str, Tensor], *, partial: bool) -> None:
        """Raises InvalidArgument for unknown names, wrong shapes or (unless partial) gaps."""
        own = dict(self.named_parameters(remove_duplicate=False))
        for name, value in state.items():
            if name not in own:
                raise InvalidArgument(
                    f"unknown tensor {name!r}", reason="UNKNOWN_TENSOR", metadata={"tensor": name}
                )
            if tuple(value.shape) != tuple(own[name].shape):
                raise InvalidArgument(
                    f"{name}: shape {tuple(value.shape)}, model has {tuple(own[name].shape)}",
                    reason="TENSOR_SHAPE_MISMATCH",
                    metadata={"tensor": name},
                )
        tied = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        missing = sorted(set(own) - set(state) - tied)
        if missing and not partial:
            raise InvalidArgument(
                f"{len(missing)} tensors missing, e.g. {missing[0]!r}",
                reason="MISSING_TENSORS",
                metadata={"tensor": missing[0]},
            )

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, Tensor], *, partial: bool = False) -> None:
        """Copies tensors into the parameters by name (dtype and device converted)."""
        self.check_state(state, partial=partial)
        own = dict(self.named_parameters(remove_duplicate=False))
        for name, value in state.items():
            own[name].copy_(value)
