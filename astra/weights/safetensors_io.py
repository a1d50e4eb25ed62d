"""Reads and writes safetensors files as raw bytes, for every dtype.

A file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape, data_offsets; optional "__metadata__" of str -> str) padded with
spaces to 8-byte alignment, then the tensors' bytes back to back. Reading
validates the header strictly and maps the data lazily (mmap), so a tensor's
bytes are never copied unless asked. Knows nothing of checkpoints, checksums,
deltas, numpy or torch: dtypes are names and sizes only.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from astra.errors import DataLoss

# Bits per element of every dtype name the format defines; sub-byte types must fill whole bytes.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}
# The reference implementation's bound: a larger header is refused before it is read.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
_TENSOR_KEYS = {"dtype", "shape", "data_offsets"}


class FormatError(DataLoss):
    """A file or directory that breaks the format; names the file and, where known, the tensor."""

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        tensor: str | None = None,
        reason: str = "INVALID_FORMAT",
    ) -> None:
        where = ", ".join(p for p in (str(path) if path else "", tensor or "") if p)
        meta = {k: str(v) for k, v in (("path", path), ("tensor", tensor)) if v}
        super().__init__(f"{where}: {message}" if where else message, reason=reason, metadata=meta)
        self.path = str(path) if path else None
        self.tensor = tensor


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; `begin`/`end` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


# astra.common.v1.NDArray dtype names -> safetensors names (which pass through unchanged).
NDARRAY_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
}


def safetensors_dtype(dtype: str) -> str:
    """The safetensors name of a dtype given by either name ("float32" or "F32")."""
    return NDARRAY_DTYPES.get(dtype, dtype)


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Size in bytes of a row-major tensor; ValueError for an unknown dtype or partial byte."""
    if dtype not in DTYPE_BITS:
        raise ValueError(f"unknown dtype {dtype!r}")
    count = 1
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise ValueError(f"bad dimension {dim!r}")
        count *= dim
    bits = count * DTYPE_BITS[dtype]
    if bits % 8:
        raise ValueError(f"{dtype} tensor of {count} elements does not fill whole bytes")
    return bits // 8


def encode_header(
    entries: Iterable[tuple[str, str, tuple[int, ...], int]],
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Length prefix + padded JSON header for (name, dtype, shape, nbytes) laid out in order."""
    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        if name == METADATA_KEY or name in header:
            raise ValueError(f"duplicate or reserved tensor name {name!r}")
        if tensor_nbytes(dtype, shape) != nbytes:
            raise ValueError(f"{name}: {nbytes} bytes do not match {dtype}{list(shape)}")
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(
    path: str | os.PathLike[str],
    tensors: Iterable[tuple[str, str, tuple[int, ...], Any]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes (name, dtype, shape, buffer) tensors in the given order."""
    items = [(n, d, tuple(s), memoryview(b).cast("B")) for n, d, s, b in tensors]
    head = encode_header(((n, d, s, mv.nbytes) for n, d, s, mv in items), metadata)
    with open(path, "wb") as f:
        f.write(head)
        for *_, mv in items:
            f.write(mv)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_entry(name: str, entry: Any, path: Path) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != _TENSOR_KEYS:
        raise FormatError(f"entry must have exactly {sorted(_TENSOR_KEYS)}", path=path, tensor=name)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        raise FormatError("shape must be a list, data_offsets [begin, end]", path=path, tensor=name)
    if not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets):
        raise FormatError(f"bad data_offsets {offsets}", path=path, tensor=name)
    try:
        size = tensor_nbytes(dtype, shape)
    except ValueError as exc:
        raise FormatError(str(exc), path=path, tensor=name) from exc
    begin, end = offsets
    if end - begin != size:
        raise FormatError(
            f"data_offsets span {end - begin} bytes, {dtype}{shape} needs {size}",
            path=path,
            tensor=name,
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)


class SafetensorsFile:
    """An open, validated safetensors file; tensor bytes are views into a read-only mmap."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 8:
                raise FormatError("shorter than the 8-byte header length", path=self.path)
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise FormatError(f"header length {header_len} out of bounds", path=self.path)
            raw = f.read(header_len)
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data_start = 8 + header_len
        try:
            self.metadata, self.tensors = self._parse(raw, file_size - self.data_start)
        except FormatError:
            self._mm.close()
            raise
        self._mv = memoryview(self._mm)

    def _parse(self, raw: bytes, data_len: int) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError) as exc:
            raise FormatError(f"header is not valid JSON: {exc}", path=self.path) from exc
        if not isinstance(header, dict):
            raise FormatError("header is not a JSON object", path=self.path)
        metadata = header.pop(METADATA_KEY, None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise FormatError("__metadata__ must map strings to strings", path=self.path)
        infos = sorted(
            (_parse_entry(name, entry, self.path) for name, entry in header.items()),
            key=lambda t: (t.begin, t.end),
        )
        expected = 0
        for info in infos:
            if info.begin != expected:
                problem = (
                    "overlaps the previous tensor" if info.begin < expected else "leaves a gap"
                )
                raise FormatError(problem, path=self.path, tensor=info.name)
            expected = info.end
        if expected != data_len:
            raise FormatError(
                f"tensors cover {expected} bytes of a {data_len}-byte data section", path=self.path
            )
        return metadata, {info.name: info for info in infos}

    def view(self, name: str) -> memoryview:
        """Zero-copy bytes of one tensor; valid until the last view is dropped."""
        info = self.tensors[name]
        return self._mv[self.data_start + info.begin : self.data_start + info.end]

    def read(self, name: str) -> bytes:
        """A copy of one tensor's bytes."""
        return bytes(self.view(name))

    def close(self) -> None:
        self._mv.release()
        # Views handed out may still be alive; the mapping then goes when the last one does.
        with contextlib.suppress(BufferError):
            self._mm.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
