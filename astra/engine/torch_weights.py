"""Moves weights between torch and the raw (dtype name, shape, bytes) form astra.weights uses.

Reading: a version directory with `model.safetensors.index.json` (what
astra.weights writes) through `load_tensors`, or a lone `model.safetensors` as
many Hugging Face repositories ship, through `SafetensorsFile`. Writing goes
through `astra.weights.checkpoint.write_full`, so a saved model is a full
version the WeightService can serve. Bytes are little-endian, row-major; no
safetensors or transformers package is involved.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from astra.engine.char_hf import char_tokenizer_files
from astra.engine.tokenizer import CHAR_TOKENIZER
from astra.errors import FailedPrecondition, InvalidArgument
from astra.weights.checkpoint import load_tensors, write_full
from astra.weights.layout import INDEX_NAME
from astra.weights.layout import Tensor as RawTensor
from astra.weights.safetensors_io import SafetensorsFile

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a torch dtype, "bfloat16"-style name or safetensors name."""
    if isinstance(name, torch.dtype):
        return name
    if name in TORCH_DTYPES:
        return TORCH_DTYPES[name]
    found = getattr(torch, str(name), None)
    if not isinstance(found, torch.dtype):
        raise InvalidArgument(f"unknown dtype {name!r}", reason="UNKNOWN_DTYPE")
    return found


def to_torch(raw: Any) -> Tensor:
    """A CPU tensor (own memory) from (dtype name, shape, buffer)."""
    dtype_name, shape, data = raw
    if dtype_name not in TORCH_DTYPES:
        raise InvalidArgument(f"dtype {dtype_name} has no torch equivalent", reason="UNKNOWN_DTYPE")
    dtype = TORCH_DTYPES[dtype_name]
    view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(view), dtype=dtype).reshape(tuple(shape))


def to_raw(tensor: Tensor) -> RawTensor:
    """(dtype name, shape, bytes) of a tensor, copied to the CPU."""
    t = tensor.detach().to("cpu").contiguous()
    if t.dtype not in DTYPE_NAMES:
        raise InvalidArgument(f"dtype {t.dtype} has no safetensors name", reason="UNKNOWN_DTYPE")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return RawTensor(DTYPE_NAMES[t.dtype], tuple(t.shape), data)


def from_memory(held: Mapping[str, Any]) -> dict[str, Tensor]:
    """Torch tensors over a receiver's in-memory version (astra.weights.memory), not copied.

    They share the receiver's buffers, which are never written while anything
    references them; a caller that keeps them keeps those buffers from reuse.
    """
    out = {}
    for name, t in held.items():
        if t.dtype not in TORCH_DTYPES:
            raise InvalidArgument(
                f"dtype {t.dtype} has no torch equivalent", reason="UNKNOWN_DTYPE"
            )
        dtype = TORCH_DTYPES[t.dtype]
        if t.data.nbytes == 0:
            out[name] = torch.empty(tuple(t.shape), dtype=dtype)
        else:
            out[name] = torch.frombuffer(t.data, dtype=dtype).reshape(tuple(t.shape))
    return out


def as_torch_state(state: Mapping[str, Any]) -> dict[str, Tensor]:
    """Accepts torch tensors or raw (dtype, shape, buffer) tensors; returns torch tensors."""
    return {k: v if isinstance(v, Tensor) else to_torch(v) for k, v in state.items()}


def load_state(directory: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face directory, as CPU tensors in the file's dtype."""
    path = Path(directory)
    if (path / INDEX_NAME).is_file():
        return {name: to_torch(raw) for name, raw in load_tensors(path).items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FailedPrecondition(
            f"{path}: neither {INDEX_NAME} nor model.safetensors",
            reason="NO_WEIGHTS",
            metadata={"path": str(path)},
        )
    with SafetensorsFile(single) as f:
        return {
            name: to_torch((info.dtype, info.shape, f.view(name)))
            for name, info in f.tensors.items()
        }


def save_state(
    directory: str | os.PathLike[str],
    state: Mapping[str, Tensor],
    config: Mapping[str, Any],
    *,
    version: str | None = None,
    files: Mapping[str, bytes] | None = None,
) -> dict[str, Any]:
    """Writes a full, checksummed version directory (config.json + shards + index).

    `files` are written beside them (tokenizer files, say). A model on the built-in
    character tokenizer (config.json `astra_tokenizer: char`) also gets that tokenizer
    as Hugging Face files (astra.engine.char_hf), so vLLM and transformers load it too.
    """
    extra = dict(files or {})
    if config.get("astra_tokenizer") == CHAR_TOKENIZER:
        extra = {**char_tokenizer_files(config), **extra}
    return write_full(
        directory,
        {name: to_raw(t) for name, t in state.items()},
        config,
        version=version,
        files=extra,
    )
