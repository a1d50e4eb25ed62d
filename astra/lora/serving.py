"""Serving adapters in the built-in engine: an adapter version as it arrives, checked against
the model it would adapt, then installed between two decode steps.

A policy's model holds its base once and the adapter unmerged (`LoraLinear`,
astra.lora.layer): a new adapter version copies A and B in place, which is as
atomic as any weight swap (the engine's worker installs it between decode steps).
The first adapter version turns the policy's targeted linears into LoraLinears;
from then on the base is frozen: a full version for that policy is refused, and
so is an adapter of another rank, alpha or module set (a run keeps its adapter's
shape). An adapter trained on another base (`base_digest`) is refused before
anything changes, naming the field, and the version in service stays.

`AdapterVersion` is what the weight loader hands the engine when a fetched
version carries `adapter_config.json` (a mapping of its tensors, with the parsed
config). Knows nothing of gRPC, receivers or the scheduler's threads.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from astra.engine.model import CausalLM
from astra.engine.torch_weights import as_torch_state
from astra.errors import AstraError, FailedPrecondition, InvalidArgument
from astra.lora.format import (
    AdapterConfig,
    AdapterError,
    base_digest,
    check_base,
    is_adapter_tensor,
    pair_tensors,
    tensor_names,
)
from astra.lora.layer import Adapter, inject, load_adapter, lora_layers


@dataclass(frozen=True)
class AdapterVersion(Mapping[str, Any]):
    """A fetched adapter version: its tensors (read as the mapping) and its config."""

    config: AdapterConfig
    tensors: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __hash__(self) -> int:
        return id(self)


def as_version(tensors: Mapping[str, Any], config_text: bytes | str | None) -> Mapping[str, Any]:
    """An AdapterVersion when the version carried adapter_config.json, else the tensors."""
    if config_text is None:
        return tensors
    try:
        return AdapterVersion(AdapterConfig.from_json(config_text), tensors)
    except AdapterError as exc:
        raise refusal(exc) from None


def refusal(exc: AdapterError) -> AstraError:
    """The error a LoadWeights caller gets: the field named, the engine unchanged."""
    if exc.field == "base_digest":
        return FailedPrecondition(
            str(exc), reason="ADAPTER_BASE_MISMATCH", metadata={"field": exc.field}
        )
    return InvalidArgument(
        str(exc),
        reason="ADAPTER_INVALID",
        metadata={"field": exc.field},
        field_violations=[(exc.field, str(exc))],
    )


def served_base_digest(model: CausalLM) -> str:
    """The digest of the base the model holds (its adapter tensors left out)."""
    return base_digest({n: t for n, t in model.hf_state_dict().items() if not is_adapter_tensor(n)})


@dataclass(frozen=True)
class PlannedAdapter:
    """An adapter checked against one model: what to inject, and its tensors converted."""

    adapter: Adapter
    tensors: dict[str, Tensor]


def plan(
    model: CausalLM,
    version: AdapterVersion,
    held_digest: str,
    served: tuple[int, float, frozenset[str]] | None = None,
) -> PlannedAdapter:
    """Checks `version` against the model (its base, modules, shapes, the adapter already
    served: `served` (rank, alpha, modules) if given, else the model's LoraLinears); raises
    AdapterError naming the field. Converts the tensors to the model's device and dtype;
    changes nothing."""
    config = version.config
    check_base(config, held_digest)
    own = dict(model.named_parameters(remove_duplicate=False))
    base_shapes = {n: tuple(p.shape) for n, p in own.items() if not is_adapter_tensor(n)}
    pairs = pair_tensors(as_torch_state(version.tensors), base_shapes, config)
    for module in pairs:
        if not isinstance(model.get_submodule(module), nn.Linear):
            raise AdapterError("target_modules", f"{module} is not a linear layer")
    if served is None and (layers := lora_layers(model)):
        first = next(iter(layers.values()))
        served = (first.rank, first.alpha, frozenset(layers))
    if served is not None:
        rank, alpha, modules = served
        if (rank, alpha) != (config.rank, config.alpha):
            raise AdapterError(
                "rank",
                f"rank {config.rank}, alpha {config.alpha}; the policy serves rank "
                f"{rank}, alpha {alpha} (an adapter keeps its shape for a run)",
            )
        if modules != set(pairs):
            raise AdapterError(
                "target_modules", f"adapts {sorted(pairs)}; the policy serves {sorted(modules)}"
            )
    like = next(p for n, p in own.items() if not is_adapter_tensor(n))
    out: dict[str, Tensor] = {}
    for module, (a, b) in pairs.items():
        name_a, name_b = tensor_names(module)
        out[name_a] = a.to(device=like.device, dtype=like.dtype)
        out[name_b] = b.to(device=like.device, dtype=like.dtype)
    return PlannedAdapter(Adapter(config, tuple(sorted(pairs))), out)


@torch.no_grad()
def install(model: CausalLM, planned: PlannedAdapter) -> None:
    """Copies the adapter in (injecting the LoraLinears on the first one). Called by the
    engine's worker between two decode steps, or on a model no sequence uses yet."""
    if not lora_layers(model):
        inject(model, planned.adapter)
        model.eval()  # new modules start in training mode: no dropout when serving
    load_adapter(model, planned.tensors)


def serves_adapters(model: CausalLM) -> bool:
    return bool(lora_layers(model))
