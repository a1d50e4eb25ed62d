"""LoRA adapter versions on a vLLM server: checked against the base it serves, written in PEFT
layout, loaded through vLLM's runtime LoRA API under one name per policy.

A server serves adapters when it runs with `--enable-lora` (and `--max-lora-rank`, vLLM's
default 16) and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, which mounts
`POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`. `VLLMEngine.launch` sets
both when its arguments enable LoRA.

`AdapterSlot` holds one policy's side of it: the base's digest and tensor shapes (read once
from the model directory the server was started on), the adapter in service, and a
directory of version directories. `prepare` checks an `AdapterVersion` as the built-in
engine does (astra.lora.serving: base digest, layers and shapes, the same rank, alpha and
layers as the adapter in service) plus vLLM's own limit (rank <= `--max-lora-rank`), and
writes it as `adapter_config.json` + `adapter_model.safetensors`, names prefixed
`base_model.model.` (astra.lora.format.to_peft), in a new directory per version. A refusal
raises AdapterError naming the field before anything is written or sent.

The engine loads each version under a name of its own (`<policy>-lora-v<N>-<tag>`, the
tag unique to this slot) and sends that policy's requests with `model=<that name>`, then
unloads the previous name. Not in place: vLLM keeps `load_inplace` on the adapter's
request, and every batch that names an in-place adapter reloads it from its directory.
A new directory and name per version also key vLLM's prefix cache afresh (it hashes the
adapter's name and path). vLLM may read a version's directory again while it is loaded
(an adapter its worker cache evicted, or one a late request still names), and a missing
directory there kills its engine core, so `committed` keeps the previous version's
directory and removes only the older ones.

Knows nothing of gRPC, of HTTP (VLLMEngine sends the requests) or of the weight loader.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from astra.errors import invalid_field

if TYPE_CHECKING:  # torch is imported when an adapter arrives, not with the HTTP engines
    import torch

    from astra.lora.format import AdapterConfig
    from astra.lora.serving import AdapterVersion

ENABLE_FLAG = "--enable-lora"
RANK_FLAG = "--max-lora-rank"
DEFAULT_MAX_RANK = 16  # vLLM 0.32's --max-lora-rank default
SERVER_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values --max-lora-rank accepts
RUNTIME_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
# 2-D base tensors that are no linear layer (the built-in engine sees the module's type;
# here only the base's tensors are known)
NOT_LINEAR = frozenset({"embed_tokens", "lm_head", "wte", "word_embeddings"})


def adapter_name(policy_id: str, path: Path) -> str:
    """The name the version at `path` (a directory `prepare` wrote) is served under."""
    return f"{policy_id}-lora-{path.name}"


@dataclass(frozen=True)
class _Base:
    digest: str
    shapes: dict[str, tuple[int, ...]]


class AdapterSlot:
    """One policy's adapters on one vLLM server (see the module docstring)."""

    def __init__(
        self, policy_id: str, base_dir: str | os.PathLike[str], root: str | Path, max_rank: int
    ) -> None:
        self.policy_id = policy_id
        self.base_dir = Path(base_dir)
        self.root = Path(root)
        self.max_rank = int(max_rank)
        self.serving: AdapterConfig | None = None  # the adapter in service, if any
        self.serving_dir: Path | None = None
        self._base: _Base | None = None
        self._seq = 0
        self._tag = uuid.uuid4().hex[:8]  # names stay unique on a server that outlives us
        self._previous: Path | None = None

    def base(self) -> _Base:
        """The digest and shapes of the base the server was started on (read once)."""
        from astra.engine.torch_weights import load_state
        from astra.lora.format import base_digest, is_adapter_tensor

        if self._base is None:
            state = {n: t for n, t in load_state(self.base_dir).items() if not is_adapter_tensor(n)}
            self._base = _Base(base_digest(state), {n: tuple(t.shape) for n, t in state.items()})
        return self._base

    def check(self, version: AdapterVersion) -> dict[str, torch.Tensor]:
        """The version's tensors, checked; raises AdapterError naming the field."""
        from astra.engine.torch_weights import as_torch_state
        from astra.lora.format import AdapterError, check_base, pair_tensors, target_modules

        config = version.config
        base = self.base()
        check_base(config, base.digest)
        if config.rank > self.max_rank:
            raise AdapterError(
                "rank",
                f"{config.rank} is above the server's {RANK_FLAG} {self.max_rank}; start vLLM "
                f"with {RANK_FLAG} >= {config.rank}",
            )
        target_modules(base.shapes, config.targets)  # every target names a layer of the base
        tensors = as_torch_state(version.tensors)
        pairs = pair_tensors(tensors, base.shapes, config)
        for module in pairs:
            if module.rsplit(".", 1)[-1] in NOT_LINEAR:
                raise AdapterError("target_modules", f"{module} is not a linear layer")
        served = self.serving
        if served is not None:
            if (served.rank, served.alpha) != (config.rank, config.alpha):
                raise AdapterError(
                    "rank",
                    f"rank {config.rank}, alpha {config.alpha}; the policy serves rank "
                    f"{served.rank}, alpha {served.alpha} (an adapter keeps its shape for a run)",
                )
            if set(served.targets) != set(config.targets):
                raise AdapterError(
                    "target_modules",
                    f"adapts {sorted(config.targets)}; the policy serves {sorted(served.targets)}",
                )
        out: dict[str, torch.Tensor] = {}
        for module, (a, b) in pairs.items():
            out[f"{module}.lora_A.weight"] = a
            out[f"{module}.lora_B.weight"] = b
        return out

    def prepare(self, version: AdapterVersion, number: int) -> Path:
        """Checks `version` and writes it in PEFT layout; returns its new directory."""
        from safetensors.torch import save_file

        from astra.lora.format import PEFT_WEIGHTS, to_peft

        tensors = self.check(version)
        peft, body = to_peft(tensors, version.config, base_name=str(self.base_dir))
        self._seq += 1
        target = self.root / self.policy_id / f"v{number}-{self._tag}{self._seq}"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        save_file(
            {n: t.detach().cpu().contiguous() for n, t in peft.items()}, target / PEFT_WEIGHTS
        )
        (target / "adapter_config.json").write_text(json.dumps(body, indent=1, sort_keys=True))
        return target

    def owns(self, path: Path) -> bool:
        """Whether `path` is a version directory `prepare` wrote (not a full version)."""
        return path.parent == self.root / self.policy_id

    def load_body(self, path: Path) -> dict[str, object]:
        """The /v1/load_lora_adapter request for the directory `prepare` wrote."""
        return {"lora_name": adapter_name(self.policy_id, path), "lora_path": str(path)}

    def committed(self, path: Path, config: AdapterConfig) -> str | None:
        """Records the version at `path` as served, removes the directories older than the
        previous one, and returns the previous version's name to unload (None: none)."""
        previous = self.serving_dir
        self.serving, self.serving_dir = config, path
        keep = {path, previous}
        for old in (self.root / self.policy_id).iterdir():
            if old not in keep and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        return adapter_name(self.policy_id, previous) if previous is not None else None

    def discard(self, path: Path) -> None:
        """Removes a prepared directory that never went into service."""
        if path != self.serving_dir:
            shutil.rmtree(path, ignore_errors=True)


def lora_enabled(extra_args: Sequence[str]) -> bool:
    return any(a == ENABLE_FLAG or a.startswith(ENABLE_FLAG + "=") for a in extra_args)


def max_rank_of(value: str | None) -> int:
    """The server's max LoRA rank from its `--max-lora-rank` value (None: vLLM's default)."""
    if value is None:
        return DEFAULT_MAX_RANK
    try:
        return int(value)
    except ValueError:
        raise invalid_field("engine_args", f"{RANK_FLAG} {value!r} is not a whole number") from None


def server_args(rank: int, extra_args: Sequence[str]) -> list[str]:
    """What a launch for a policy trained as a rank-`rank` adapter adds to `extra_args`:
    `--enable-lora`, the smallest `--max-lora-rank` vLLM accepts that holds `rank`, and
    `--max-loras 1` (one policy per server); the ones `extra_args` give are kept."""
    given = {a.split("=", 1)[0] for a in extra_args if a.startswith("--")}
    out: list[str] = []
    if ENABLE_FLAG not in given:
        out.append(ENABLE_FLAG)
    if RANK_FLAG not in given:
        fits = [r for r in SERVER_RANKS if r >= rank]
        if not fits:
            raise invalid_field(
                "trainer.lora.rank",
                f"{rank} is above vLLM's largest {RANK_FLAG} {SERVER_RANKS[-1]}",
            )
        out += [RANK_FLAG, str(fits[0])]
    if "--max-loras" not in given:
        out += ["--max-loras", "1"]
    return out
