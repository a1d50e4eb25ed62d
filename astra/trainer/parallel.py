"""FSDP2 for the policy: process group and mesh, one `parallelize`, full state in and out.

torchtitan's order: the model is built on the meta device, `parallelize`
applies `fully_shard` to every decoder layer and then to the root (tied
embedding and lm_head stay one parameter, in the root's group), and only
then are parameters materialised and filled from a full (unsharded) state
dict. FSDP averages gradients over ranks; the step multiplies its loss by
the world size, since losses are already normalised by step-wide counts
(a divide factor of 1 would need PREMUL_SUM, which gloo lacks).
Backends: gloo on CPU, nccl on CUDA; the single mesh axis is named "dp".
With one process there is no process group and the model stays plain.

Mixed precision: a trainable model keeps fp32 master weights whatever the
compute dtype (an AdamW step of ~lr on a bf16 weight near 1.0 is below half
its spacing and rounds away: norms would never move). With bf16 compute,
FSDP2 gathers bf16 copies for forward and backward and reduces gradients in
fp32 (MixedPrecisionPolicy); a single process runs the forward under
autocast (`compute`). A frozen model (the KL reference) is held in the
compute dtype itself: nothing updates it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from astra.engine.model import CausalLM
from astra.engine.model_config import ModelConfig
from astra.lora.layer import Adapter, inject

DP = "dp"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(device: str) -> DeviceMesh | None:
    """Joins the torchrun process group when WORLD_SIZE > 1; returns the "dp" mesh or None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not dist.is_initialized():
        return None
    device_type = torch.device(device).type
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend)
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=(DP,))


def parallelize(
    model: CausalLM, mesh: DeviceMesh, compute_dtype: torch.dtype | None = None
) -> CausalLM:
    """FSDP2 over the "dp" axis: each decoder layer, then the root; with `compute_dtype`
    (lower than the parameters'), forward and backward in it, gradients reduced in fp32."""
    assert mesh.mesh_dim_names == (DP,), f"expected a mesh with one axis {DP!r}"
    mp = MixedPrecisionPolicy()
    if compute_dtype is not None and compute_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def build_model(
    cfg: ModelConfig,
    state: dict[str, Tensor],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    mesh: DeviceMesh | None = None,
    trainable: bool = True,
    adapter: Adapter | None = None,
) -> CausalLM:
    """A model computing in `dtype`: meta -> (parallelize) -> materialise -> load the full
    `state`. Trainable: fp32 master weights (see the module doc); frozen: held in `dtype`.
    With `adapter`: its LoRA layers are injected on the meta model (the base frozen, FSDP
    sharding the adapters with their layer), and `state` holds the adapter tensors too."""
    param_dtype = torch.float32 if trainable else dtype
    with torch.device("meta"):
        model = CausalLM(cfg).to(param_dtype)
        if adapter is not None:
            inject(model, adapter)
    if mesh is not None:
        parallelize(model, mesh, dtype if trainable else None)
    model.to_empty(device=device)
    if mesh is None:
        model.tie()  # to_empty gives each module its own tensor
    load_full_state(model, state)
    model.compute_dtype = dtype
    # FSDP casts the parameters itself; a plain model computes lower under autocast.
    model.autocast_dtype = dtype if mesh is None and param_dtype != dtype else None
    return model.train()


def compute(model: nn.Module) -> AbstractContextManager[Any]:
    """Where `model`'s forward runs: autocast to its compute dtype when a plain (unsharded)
    model holds fp32 master weights for a lower compute dtype, else nothing."""
    dtype = getattr(model, "autocast_dtype", None)
    if dtype is None:
        return nullcontext()
    device = next(model.parameters()).device
    return torch.autocast(device.type, dtype=dtype)


def load_full_state(model: CausalLM, state: dict[str, Tensor]) -> None:
    """Loads HF-named full tensors into a plain or sharded model (every rank passes them)."""
    full = dict(state)
    if model.cfg.tie_word_embeddings:
        full["lm_head.weight"] = full["model.embed_tokens.weight"]
    model.check_state(full, partial=False)
    ref = dict(model.named_parameters(remove_duplicate=False))
    full = {k: v.to(ref[k].dtype) for k, v in full.items()}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


def load_partial_state(model: CausalLM, state: dict[str, Tensor]) -> None:
    """Loads some HF-named full tensors (a LoRA adapter's) into a plain or sharded model;
    every other parameter keeps its value (every rank passes the same tensors)."""
    model.check_state(state, partial=True)
    ref = dict(model.named_parameters(remove_duplicate=False))
    part = {k: v.to(ref[k].dtype) for k, v in state.items()}
    set_model_state_dict(model, part, options=StateDictOptions(full_state_dict=True, strict=False))


def full_state(
    model: CausalLM,
    dtype: torch.dtype | None = None,
    *,
    pin: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, Tensor]:
    """HF-named full CPU tensors with their own memory (rank 0; other ranks get {}).

    Collective under FSDP: every rank calls it; each parameter is gathered in turn
    (`full_tensor`), cast to `dtype` on its device (half the bytes to move for a bf16
    copy of fp32 masters) and copied to host memory. With `pin` (the copy every step
    publishes) a CUDA model's tensors go to pinned memory asynchronously, at the link's
    speed instead of through pageable staging (the gathered fp32 state to host, then a
    cast on the CPU, took ~0.3 s a step for a 100M model on an H200); torch keeps freed
    pinned blocks for the next step's copy (`publish.pin_host_copy` says how many are held).
    Checkpoints, rare and fp32, stay pageable.
    A tied lm_head is left out, and with `keep` every tensor whose name it refuses (every
    rank skips the same ones: a LoRA trainer gathers only its adapter).
    """
    rank = world()[0]
    out: dict[str, Tensor] = {}
    devices: set[torch.device] = set()
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        if keep is not None and not keep(name):
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if rank != 0:
            continue
        t = full.detach().to(dtype or full.dtype)
        pinned = pin and t.is_cuda
        if pinned:
            devices.add(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
        host.copy_(t, non_blocking=pinned)
        out[name] = host
    for device in devices:  # every copy landed before anyone reads (each on its device's stream)
        torch.cuda.current_stream(device).synchronize()
    return out


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, unsharded, on CPU (collective)."""
    return get_optimizer_state_dict(model, optimizer, options=FULL)


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )


def all_reduce(t: Tensor, op: str = "sum") -> Tensor:
    """In-place all-reduce of a CPU tensor across ranks (no-op alone; via CUDA under nccl)."""
    if world()[1] > 1:
        buf = t.cuda() if dist.get_backend() == "nccl" else t
        dist.all_reduce(buf, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if buf is not t:
            t.copy_(buf.cpu())
    return t


def all_gather_flat(t: Tensor) -> Tensor:
    """Every rank's 1-D CPU tensor `t` (lengths may differ), concatenated in rank order."""
    rank, size = world()
    if size == 1:
        return t
    lengths = torch.zeros(size, dtype=torch.int64)
    lengths[rank] = t.numel()
    all_reduce(lengths)
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=t.dtype)
    padded[: t.numel()] = t
    cuda = dist.get_backend() == "nccl"
    parts = [torch.empty_like(padded) for _ in range(size)]
    if cuda:
        parts_cuda = [p.cuda() for p in parts]
        dist.all_gather(parts_cuda, padded.cuda())
        parts = [p.cpu() for p in parts_cuda]
    else:
        dist.all_gather(parts, padded)
    return torch.cat([p[: int(n)] for p, n in zip(parts, lengths, strict=True)])


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (no-op alone)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()
