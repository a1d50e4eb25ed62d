"""LoRA for training: adapters injected into a model's linear layers, their state, the merge.

`LoraLinear` is an `nn.Linear` (same `weight` and `bias` parameters, so the
base keeps its Hugging Face names) with two more bias-free linears,
`lora_A` `[rank, in]` and `lora_B` `[out, rank]`, whose parameters are then
named exactly as astra.lora.format names an adapter version's tensors
(`M.lora_A.weight`, `M.lora_B.weight`). It computes
`W x + b + (alpha / rank) * B (A (dropout(x)))`.

`Adapter` says what to adapt (the format's AdapterConfig and the module
paths); `inject` swaps those modules for `LoraLinear`s and freezes every
parameter but the adapters' (on the meta device too, before FSDP wraps the
model). `initial_tensors` draws the starting adapter from a seed (A
kaiming-uniform as peft does, B zeros: the adapted model starts equal to the
base), so every rank of a run starts from the same bits. `adapter_state`,
`load_adapter` and `merge` work on plain state dicts.

Knows nothing of optimisers, FSDP, files or gRPC.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astra.lora.format import AdapterConfig, AdapterError, is_adapter_tensor, tensor_names


@dataclass(frozen=True)
class Adapter:
    """What a model is adapted with: the format's config and the adapted module paths."""

    config: AdapterConfig
    modules: tuple[str, ...]


class LoraLinear(nn.Linear):
    """A frozen linear layer plus a trainable low-rank update (see the module docstring)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.reset_adapter()

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A kaiming-uniform (a=sqrt(5), as peft draws it), B zeros: the base's output."""
        if self.lora_A.weight.is_meta:
            return
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
            self.lora_B.weight.zero_()

    @classmethod
    def around(cls, base: nn.Linear, rank: int, alpha: float, dropout: float) -> LoraLinear:
        """A LoraLinear sharing `base`'s weight and bias parameters (frozen here); its
        adapter on the base's device and dtype, freshly drawn (see `reset_adapter`)."""
        w = base.weight
        layer = cls(
            base.in_features,
            base.out_features,
            bias=base.bias is not None,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            device="meta",  # the base's own parameters replace these: nothing allocated
            dtype=w.dtype,
        )
        layer.weight, layer.bias = base.weight, base.bias
        layer.weight.requires_grad_(False)
        if layer.bias is not None:
            layer.bias.requires_grad_(False)
        if not w.is_meta:
            layer.lora_A.to_empty(device=w.device)
            layer.lora_B.to_empty(device=w.device)
            layer.reset_adapter()
        return layer

    def forward(self, x: Tensor) -> Tensor:
        update = self.lora_B(self.lora_A(self.lora_dropout(x)))
        return F.linear(x, self.weight, self.bias) + update * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def inject(model: nn.Module, adapter: Adapter) -> None:
    """Swaps each of `adapter.modules` for a LoraLinear and freezes all but the adapters.

    Raises AdapterError naming `target_modules` for a path that is not an nn.Linear.
    """
    c = adapter.config
    for path in adapter.modules:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        base = getattr(parent, attr, None)
        if isinstance(base, LoraLinear) or not isinstance(base, nn.Linear):
            kind = type(base).__name__
            raise AdapterError("target_modules", f"{path} is a {kind}, not a linear layer")
        setattr(parent, attr, LoraLinear.around(base, c.rank, c.alpha, c.dropout))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_tensor(name))


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def initial_tensors(
    adapter: Adapter, base_shapes: Mapping[str, tuple[int, ...]], seed: int
) -> dict[str, Tensor]:
    """The starting adapter, fp32 on the CPU: A kaiming-uniform (a=sqrt(5), as peft and
    nn.Linear draw it: U(-1/sqrt(in), 1/sqrt(in))) from `seed`, module by module in name
    order; B zeros."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Tensor] = {}
    for module in sorted(adapter.modules):
        out_f, in_f = base_shapes[module + ".weight"]
        a_name, b_name = tensor_names(module)
        a = torch.empty(adapter.config.rank, in_f)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        out[a_name] = a
        out[b_name] = torch.zeros(out_f, adapter.config.rank)
    return out


def adapter_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapter tensors of a model's state dict (the format's names), nothing else."""
    return {name: t for name, t in state.items() if is_adapter_tensor(name)}


@torch.no_grad()
def load_adapter(model: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copies adapter tensors into a plain (unsharded) model's LoraLinear layers."""
    own = dict(model.named_parameters())
    for name, value in tensors.items():
        if not is_adapter_tensor(name) or name not in own:
            raise AdapterError("tensors", f"{name!r} is not an adapter tensor of this model")
        if tuple(value.shape) != tuple(own[name].shape):
            raise AdapterError(
                "tensors", f"{name} is {list(value.shape)}, the model's {list(own[name].shape)}"
            )
        own[name].copy_(value)


def merge(state: Mapping[str, Tensor], config: AdapterConfig) -> dict[str, Tensor]:
    """A base-named state dict with every adapted `W` replaced by `W + scale * B @ A`
    (computed in fp32, cast back to W's dtype); the adapter tensors are dropped."""
    out = {name: t for name, t in state.items() if not is_adapter_tensor(name)}
    modules = {name[: -len(".lora_A.weight")] for name in state if name.endswith(".lora_A.weight")}
    for module in sorted(modules):
        a_name, b_name = tensor_names(module)
        w = out[module + ".weight"]
        delta = state[b_name].float() @ state[a_name].float()
        out[module + ".weight"] = (w.float() + config.scale * delta).to(w.dtype)
    return out
