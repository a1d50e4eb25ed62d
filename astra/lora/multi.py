"""Many policies' LoRA adapters on one shared base model in the built-in engine.

Policies whose adapters are trained on the same base (the same base digest)
share one `CausalLM`: `SharedBase` turns the adapted linears into
`MultiLoraLinear`s, which keep one adapter (A, B, scale) per policy and add,
to each row of a forward, the update of the row's own policy (`Rows` says
which: one policy for the whole batch, or one per row; rows are grouped by
policy and each group gets its own A/B). The base's parameters exist once.

`BasePool` is the engine's register: it takes each policy's base digest once
(before its first adapter), checks an incoming adapter against it
(astra.lora.serving.plan; refusals name the field), and returns a
`SharedPlan` whose `install`, run by the engine's worker between two decode
steps, adopts the policy's model as the shared base when none with that
digest exists yet (else the policy's own model is dropped) and replaces only
that policy's adapter: the other policies' tensors are never touched, so
their outputs stay bit-identical. A policy then serves through a
`PolicyModel`, which routes the batch's rows to its adapter.

Knows nothing of gRPC, the scheduler's threads or version numbers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astra.engine.kv_cache import KVCache
from astra.engine.model import CausalLM
from astra.lora import serving
from astra.lora.format import AdapterError

log = logging.getLogger(__name__)


class Rows:
    """Which policy's adapter the next forward applies: one for all rows, one per row, none."""

    def __init__(self) -> None:
        self.current: str | tuple[str, ...] | None = None


@dataclass(frozen=True)
class Slot:
    """One policy's adapter at one layer."""

    a: Tensor  # [rank, in]
    b: Tensor  # [out, rank]
    scale: float

    def update(self, x: Tensor) -> Tensor:
        return F.linear(F.linear(x, self.a), self.b) * self.scale


class MultiLoraLinear(nn.Linear):
    """A frozen linear layer (the base's own parameters) plus one adapter per policy."""

    def __init__(self, base: nn.Linear, rows: Rows) -> None:
        super().__init__(
            base.in_features, base.out_features, bias=base.bias is not None, device="meta"
        )
        self.weight, self.bias = base.weight, base.bias  # shared, nothing allocated here
        self.weight.requires_grad_(False)
        self.rows = rows
        self.slots: dict[str, Slot] = {}  # policy -> its adapter here

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        rows = self.rows.current
        if rows is None:
            return y
        if isinstance(rows, str):
            slot = self.slots.get(rows)
            return y if slot is None else y + slot.update(x)
        for policy in dict.fromkeys(rows):
            slot = self.slots.get(policy)
            if slot is not None:
                idx = torch.tensor([i for i, p in enumerate(rows) if p == policy], device=x.device)
                y = y.index_add(0, idx, slot.update(x.index_select(0, idx)))
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, policies={sorted(self.slots)}"


class SharedBase:
    """One base model and the adapters of every policy served on it."""

    def __init__(self, model: CausalLM, digest: str) -> None:
        self.model, self.digest, self.rows = model, digest, Rows()
        self.layers: dict[str, MultiLoraLinear] = {}
        self.served: dict[str, tuple[int, float, frozenset[str]]] = {}  # rank, alpha, modules

    @torch.no_grad()
    def install(self, policy: str, planned: serving.PlannedAdapter) -> None:
        """Replaces `policy`'s adapter (copies: nothing keeps the caller's buffers)."""
        c = planned.adapter.config
        for path in planned.adapter.modules:
            if path not in self.layers:
                parent_path, _, attr = path.rpartition(".")
                parent = self.model.get_submodule(parent_path) if parent_path else self.model
                self.layers[path] = MultiLoraLinear(getattr(parent, attr), self.rows)
                setattr(parent, attr, self.layers[path])
            a_name, b_name = f"{path}.lora_A.weight", f"{path}.lora_B.weight"
            a, b = planned.tensors[a_name].clone(), planned.tensors[b_name].clone()
            self.layers[path].slots[policy] = Slot(a, b, c.scale)
        self.served[policy] = (c.rank, c.alpha, frozenset(planned.adapter.modules))

    @contextlib.contextmanager
    def serving(self, rows: str | Iterable[str]) -> Iterator[None]:
        """Forwards of the base inside apply `rows`' adapters (a policy, or one per row)."""
        self.rows.current = rows if isinstance(rows, str) else tuple(rows)
        try:
            yield
        finally:
            self.rows.current = None


class PolicyModel:
    """One policy's view of a shared base: what the engine's batch of that policy calls."""

    def __init__(self, shared: SharedBase, policy: str) -> None:
        self.shared, self.policy = shared, policy
        self.cfg = shared.model.cfg

    @property
    def device(self) -> torch.device:
        return self.shared.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.shared.model.dtype

    def new_cache(self) -> KVCache:
        return self.shared.model.new_cache()

    def prefill(self, ids_BT: Tensor, last_B: Tensor, cache: KVCache, slot0: int) -> Tensor:
        with self.shared.serving(self.policy):
            return self.shared.model.prefill(ids_BT, last_B, cache, slot0)

    def decode(self, ids_B: Tensor, pos_B: Tensor, cache: KVCache) -> Tensor:
        with self.shared.serving(self.policy):
            return self.shared.model.decode(ids_B, pos_B, cache)


@dataclass(frozen=True)
class SharedPlan:
    """A checked adapter for one policy; `install` (worker thread) returns its new model."""

    pool: BasePool
    policy: str
    model: CausalLM | PolicyModel
    planned: serving.PlannedAdapter

    def install(self) -> PolicyModel:
        if isinstance(self.model, PolicyModel):
            shared = self.model.shared
        else:
            digest = self.pool.digest(self.policy, self.model)
            shared = self.pool.bases.setdefault(digest, SharedBase(self.model, digest))
            log.info(
                "LoRA policy %s serves on the shared base %s, with %s",
                self.policy,
                digest[:20],
                sorted(shared.served) or "no other policy yet",
            )
        shared.install(self.policy, self.planned)
        return PolicyModel(shared, self.policy)


class BasePool:
    """The engine's shared bases by digest, and each policy's base digest."""

    def __init__(self) -> None:
        self.bases: dict[str, SharedBase] = {}
        self._digests: dict[str, str] = {}

    def digest(self, policy: str, model: CausalLM) -> str:
        """The policy's base digest, taken once, from the base as served before any adapter."""
        if policy not in self._digests:
            self._digests[policy] = serving.served_base_digest(model)
        return self._digests[policy]

    def plan(
        self, policy: str, model: CausalLM | PolicyModel, version: serving.AdapterVersion
    ) -> serving.PlannedAdapter:
        """Checks `version` for the policy; raises the refusal (naming the field) if it fails."""
        try:
            if isinstance(model, PolicyModel):
                shared = model.shared
                return serving.plan(
                    shared.model, version, shared.digest, served=shared.served.get(policy)
                )
            return serving.plan(model, version, self.digest(policy, model))
        except AdapterError as exc:
            raise serving.refusal(exc) from None

    def plan_shared(
        self, policy: str, model: CausalLM | PolicyModel, version: serving.AdapterVersion
    ) -> SharedPlan:
        return SharedPlan(self, policy, model, self.plan(policy, model, version))


def held_bytes(models: Iterable[CausalLM | PolicyModel]) -> int:
    """Bytes of the distinct tensor storages the models hold (a shared base counted once)."""
    seen: dict[int, int] = {}
    for model in models:
        if isinstance(model, PolicyModel):
            base = model.shared.model
            extra = [
                t
                for m in model.shared.layers.values()
                for s in m.slots.values()
                for t in (s.a, s.b)
            ]
        else:
            base, extra = model, []
        for t in [*base.parameters(), *base.buffers(), *extra]:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
