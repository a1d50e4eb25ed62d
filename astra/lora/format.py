"""The adapter version format: what a LoRA version holds and how it names its base.

An adapter version is an ordinary WeightService version whose tensors are only
the adapter's, plus one version file, `adapter_config.json`:

- For every adapted linear layer at module path `M` (its base tensor is
  `M.weight`, shape `[out, in]`), two tensors: `M.lora_A.weight` `[rank, in]`
  and `M.lora_B.weight` `[out, rank]`. Nothing else.
- The layer computes `W x + (alpha / rank) * B (A x)`; the base `W` is never
  shipped and never changed.
- `adapter_config.json` names the rank, alpha, dropout, target module names
  (the last path component: `q_proj`, `up_proj`, ...) and the base's digest,
  so a receiver holding another base refuses the adapter instead of serving
  garbage.

`to_peft` / `from_peft` convert to and from the PEFT directory layout that
vLLM's LoRA API reads (`adapter_config.json` with `r`, `lora_alpha`,
`target_modules`; tensors named `base_model.model.M.lora_A.weight`); the
PEFT config keeps the base digest as `astra_base_digest`.

The base digest is BLAKE3 over the base's tensors in name order (name, shape
and float32 little-endian bytes of each), computed from the state dict as read
from its source, before any cast to a compute dtype: a trainer holding fp32
masters and an engine serving bf16 agree on it.

Knows nothing of gRPC, files on disk or engines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from astra.weights import digest

ADAPTER_FILE = "adapter_config.json"
FORMAT = 1
SUFFIX_A = ".lora_A.weight"
SUFFIX_B = ".lora_B.weight"
PEFT_PREFIX = "base_model.model."
PEFT_WEIGHTS = "adapter_model.safetensors"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class AdapterError(ValueError):
    """An adapter config or tensor set that breaks the format; names the field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_digest: str
    dropout: float = 0.0
    extra: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise AdapterError("rank", f"must be a whole number >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise AdapterError("alpha", f"must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise AdapterError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise AdapterError("target_modules", "must name at least one module, e.g. q_proj")
        for t in self.targets:
            if not _NAME.match(t):
                raise AdapterError("target_modules", f"{t!r} is not a module name like q_proj")
        if not self.base_digest:
            raise AdapterError("base_digest", "is empty; compute it with base_digest()")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> str:
        body = {
            "astra_adapter": FORMAT,
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": list(self.targets),
            "base_digest": self.base_digest,
            **dict(self.extra),
        }
        return json.dumps(body, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> AdapterConfig:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise AdapterError(ADAPTER_FILE, f"is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise AdapterError(ADAPTER_FILE, "must be a JSON object")
        if raw.get("astra_adapter") != FORMAT:
            raise AdapterError(
                "astra_adapter", f"must be {FORMAT}, got {raw.get('astra_adapter')!r}"
            )
        known = {"astra_adapter", "rank", "alpha", "dropout", "target_modules", "base_digest"}
        for key in ("rank", "alpha", "target_modules", "base_digest"):
            if key not in raw:
                raise AdapterError(key, f"missing from {ADAPTER_FILE}")
        targets = raw["target_modules"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise AdapterError("target_modules", "must be a list of module names")
        return cls(
            rank=raw["rank"],
            alpha=float(raw["alpha"]),
            dropout=float(raw.get("dropout", 0.0)),
            targets=tuple(targets),
            base_digest=str(raw["base_digest"]),
            extra={k: v for k, v in raw.items() if k not in known},
        )


def tensor_names(module: str) -> tuple[str, str]:
    """The two tensor names of the adapter on the linear layer at `module`."""
    return module + SUFFIX_A, module + SUFFIX_B


def is_adapter_tensor(name: str) -> bool:
    return name.endswith(SUFFIX_A) or name.endswith(SUFFIX_B)


def target_modules(base_names: Iterable[str], targets: Iterable[str]) -> list[str]:
    """Module paths of the base's linear weights whose last component is a target.

    Raises AdapterError naming `target_modules` for a target that matches nothing.
    """
    wanted = list(targets)
    found: dict[str, list[str]] = {t: [] for t in wanted}
    for name in sorted(base_names):
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        last = module.rsplit(".", 1)[-1]
        if last in found:
            found[last].append(module)
    missing = [t for t, mods in found.items() if not mods]
    if missing:
        raise AdapterError("target_modules", f"{missing} match no layer of the base model")
    return sorted(m for mods in found.values() for m in mods)


def pair_tensors(
    tensors: Mapping[str, torch.Tensor],
    base_shapes: Mapping[str, tuple[int, ...]],
    config: AdapterConfig,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Group an adapter version's tensors by module, checked against the base's shapes.

    Returns {module: (A, B)}. Every tensor must be an adapter tensor of a module
    the base has, with A `[rank, in]` and B `[out, rank]` for that module's `[out, in]`.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.endswith(SUFFIX_A):
            pairs.setdefault(name[: -len(SUFFIX_A)], {})["A"] = t
        elif name.endswith(SUFFIX_B):
            pairs.setdefault(name[: -len(SUFFIX_B)], {})["B"] = t
        else:
            raise AdapterError("tensors", f"{name!r} is not an adapter tensor (*{SUFFIX_A})")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError("tensors", f"{module} has only lora_{next(iter(ab))}")
        shape = base_shapes.get(module + ".weight")
        if shape is None or len(shape) != 2:
            raise AdapterError("tensors", f"{module} is not a linear layer of the base model")
        o, i = shape
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (config.rank, i):
            raise AdapterError(
                "tensors", f"{module}.lora_A is {list(a.shape)}, wants {[config.rank, i]}"
            )
        if tuple(b.shape) != (o, config.rank):
            raise AdapterError(
                "tensors", f"{module}.lora_B is {list(b.shape)}, wants {[o, config.rank]}"
            )
        out[module] = (a, b)
    if not out:
        raise AdapterError("tensors", "an adapter version holds no adapter tensors")
    return out


def base_digest(state: Mapping[str, torch.Tensor]) -> str:
    """BLAKE3 of the base's tensors (name order; name, shape, float32 bytes), tagged."""
    running = digest.hasher(digest.BLAKE3)
    for name in sorted(state):
        t = state[name].detach().to(device="cpu", dtype=torch.float32).contiguous()
        running.update(f"{name}:{list(t.shape)}\n".encode())
        running.update(t.numpy().astype("<f4", copy=False).tobytes())
    return digest.finish(digest.BLAKE3, running)


def check_base(config: AdapterConfig, held_digest: str) -> None:
    """Raise AdapterError naming `base_digest` when the adapter was trained on another base."""
    if digest.normalized(config.base_digest) != digest.normalized(held_digest):
        raise AdapterError(
            "base_digest",
            f"the adapter was trained on base {config.base_digest}, this engine holds {held_digest}",
        )


def to_peft(
    tensors: Mapping[str, torch.Tensor], config: AdapterConfig, base_name: str = ""
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(tensors named `base_model.model.M.lora_X.weight`, PEFT adapter_config.json body).

    Every name must be an adapter tensor (field `tensors`); `base_name` fills PEFT's
    `base_model_name_or_path` (informational: vLLM checks nothing against it).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not is_adapter_tensor(name):
            raise AdapterError("tensors", f"{name!r} is not an adapter tensor (*{SUFFIX_A})")
        out[PEFT_PREFIX + name] = t.contiguous()
    body: dict[str, object] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": list(config.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_name,
        "astra_base_digest": config.base_digest,
    }
    return out, body


def from_peft(
    tensors: Mapping[str, torch.Tensor], body: Mapping[str, object]
) -> tuple[dict[str, torch.Tensor], AdapterConfig]:
    """The inverse of `to_peft`: Astra's tensor names and config from a PEFT adapter."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not name.startswith(PEFT_PREFIX):
            raise AdapterError("tensors", f"{name!r} lacks the PEFT prefix {PEFT_PREFIX!r}")
        out[name[len(PEFT_PREFIX) :]] = t
    targets = body.get("target_modules")
    if not isinstance(targets, list):
        raise AdapterError("target_modules", "must be a list of module names")
    rank, alpha = body.get("r"), body.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError("alpha", f"lora_alpha must be a number, got {alpha!r}")
    config = AdapterConfig(
        rank=rank,  # type: ignore[arg-type]  # AdapterConfig checks it
        alpha=float(alpha),
        dropout=float(body.get("lora_dropout") or 0.0),  # type: ignore[arg-type]
        targets=tuple(str(t) for t in targets),
        base_digest=str(body.get("astra_base_digest") or ""),
    )
    return out, config
