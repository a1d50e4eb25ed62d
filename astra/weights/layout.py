"""The layout of one version directory: index, shard names, identities.

A version is a directory holding `model.safetensors.index.json` (metadata and
a weight_map of tensor name -> shard file) and the shards it names. `Version`
opens one read-only and cross-checks index and shards. Knows nothing of
deltas or of what checksums mean, and never modifies a version.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from astra.errors import FailedPrecondition, InvalidArgument
from astra.weights.safetensors_io import FormatError, SafetensorsFile, TensorInfo

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
SHARD_SUFFIX = ".safetensors"
RESERVED_IDENTITY = "initial"
MAX_IDENTITY_CHARS = 128


class Tensor(NamedTuple):
    """A tensor as raw bytes: safetensors dtype name, shape, little-endian row-major data."""

    dtype: str
    shape: tuple[int, ...]
    data: Any


class ChecksumMismatch(FormatError):
    """A tensor's bytes do not match the Adler-32 recorded for them."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None, tensor: str) -> None:
        super().__init__(message, path=path, tensor=tensor, reason="CHECKSUM_MISMATCH")


class LayoutChanged(FailedPrecondition):
    """A tensor added, removed, or changed in dtype or shape: a delta cannot carry it."""

    def __init__(self, tensor: str, detail: str) -> None:
        super().__init__(
            f"{tensor}: {detail}; publish a full version instead",
            reason="TENSOR_LAYOUT_CHANGED",
            metadata={"tensor": tensor},
        )
        self.tensor = tensor


def check_identity(identity: str, *, allow_initial: bool = False) -> str:
    """Returns a well-formed identity: 1-128 chars, one path segment, not ./.., not `initial`."""
    problem = None
    if not isinstance(identity, str) or not 1 <= len(identity) <= MAX_IDENTITY_CHARS:
        problem = f"must be 1-{MAX_IDENTITY_CHARS} characters"
    elif "/" in identity or "\\" in identity or "\0" in identity or identity in (".", ".."):
        problem = "must be one path segment"
    elif identity == RESERVED_IDENTITY and not allow_initial:
        problem = f"{RESERVED_IDENTITY!r} is reserved for the base weights"
    if problem:
        raise InvalidArgument(
            f"identity {identity!r} {problem}",
            reason="INVALID_IDENTITY",
            metadata={"identity": str(identity)},
        )
    return identity


def full_shard_name(i: int, n: int) -> str:
    """Hugging Face's 1-based shard names."""
    return f"model-{i + 1:05d}-of-{n:05d}{SHARD_SUFFIX}"


def delta_shard_name(i: int, n: int) -> str:
    """slime's 0-based delta shard names, as in cwtrain's example layout."""
    return f"model-{i:05d}-of-{n:05d}{SHARD_SUFFIX}"


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Groups tensors in order into shards of at most max_shard_bytes (a larger tensor alone)."""
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    shards: list[list[str]] = []
    filled = 0
    for name, size in sizes:
        if not shards or (shards[-1] and filled + size > max_shard_bytes):
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def write_index(directory: Path, metadata: dict[str, Any], weight_map: dict[str, str]) -> None:
    body = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(body, indent=2) + "\n")


def read_index(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(metadata, weight_map) of a version directory, with their shapes checked."""
    path = directory / INDEX_NAME
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FormatError(f"no {INDEX_NAME}", path=directory, reason="INDEX_MISSING") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"index is not valid JSON: {exc}", path=path) from exc
    if not isinstance(body, dict):
        raise FormatError("index is not a JSON object", path=path)
    metadata, weight_map = body.get("metadata", {}), body.get("weight_map")
    if not isinstance(metadata, dict):
        raise FormatError("index metadata is not an object", path=path)
    if not isinstance(weight_map, dict):
        raise FormatError("index has no weight_map object", path=path)
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(SHARD_SUFFIX):
            raise FormatError(f"maps to {shard!r}, not a *{SHARD_SUFFIX}", path=path, tensor=name)
        if "/" in shard or "\\" in shard or shard in (".", "..") or shard.startswith("."):
            raise FormatError(f"shard {shard!r} is not directly in the directory", path=path)
    return metadata, weight_map


@dataclass(frozen=True)
class Entry:
    """Where one tensor of a version lives."""

    shard: SafetensorsFile
    info: TensorInfo

    @property
    def checksum(self) -> str | None:
        return self.shard.metadata.get(self.info.name)


class Version:
    """An open version directory whose index and shards agree; tensors are mmap views."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory)
        self.metadata, self.weight_map = read_index(self.path)
        self.shards: dict[str, SafetensorsFile] = {}
        self.entries: dict[str, Entry] = {}
        try:
            for shard_name in sorted(set(self.weight_map.values())):
                shard_path = self.path / shard_name
                if not shard_path.is_file():
                    raise FormatError("shard named in the index is missing", path=shard_path)
                shard = self.shards[shard_name] = SafetensorsFile(shard_path)
                for info in shard.tensors.values():
                    if self.weight_map.get(info.name) != shard_name:
                        raise FormatError(
                            "not mapped to this shard", path=shard_path, tensor=info.name
                        )
                    self.entries[info.name] = Entry(shard, info)
            for name, shard_name in self.weight_map.items():
                if name not in self.entries:
                    raise FormatError(
                        "missing from its shard", path=self.path / shard_name, tensor=name
                    )
        except BaseException:
            self.close()
            raise

    @property
    def is_delta(self) -> bool:
        return "delta_encoding" in self.metadata

    def view(self, name: str) -> memoryview:
        entry = self.entries[name]
        return entry.shard.view(name)

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    def __enter__(self) -> Version:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_tensors(directory: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of a version, copied into memory, in weight_map order."""
    with Version(directory) as version:
        return {
            name: Tensor(e.info.dtype, e.info.shape, version.view(name).tobytes())
            for name, e in sorted(version.entries.items())
        }


def open_full(directory: str | os.PathLike[str]) -> Version:
    """Opens a version that must be full (a base, or the new side of a diff)."""
    version = Version(directory)
    if version.is_delta:
        version.close()
        raise FailedPrecondition(
            f"{directory} is a delta, not a full version",
            reason="NOT_A_FULL_VERSION",
            metadata={"path": str(directory)},
        )
    return version


def extra_files(version: Version) -> list[Path]:
    """The version's regular files other than the index and shards (config, tokenizer)."""
    shards = set(version.weight_map.values())
    return [
        p
        for p in sorted(version.path.iterdir())
        if p.is_file() and p.name != INDEX_NAME and p.name not in shards
        if not p.name.endswith(SHARD_SUFFIX) and not p.name.startswith(".")
    ]
