"""Offline validation of one version directory: `inspect` and the delta metadata rule.

Checks what cwtrain's inspect checks (required files, a well-formed index,
shards directly in the directory, the one accepted delta combination) and
more: every shard parses, index and shards name the same tensors, a full
version's Adler-32s match its bytes, every delta tensor is one intact zstd
frame. Reads files; never writes, decodes a delta, or needs the base.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from astra.errors import InvalidArgument
from astra.weights.checksum import CHECKSUM_FORMAT, adler32_hex, is_adler32_hex
from astra.weights.delta import DeltaError, frame_compressed_size, frame_content_size
from astra.weights.layout import CONFIG_NAME, SHARD_SUFFIX, Version, check_identity
from astra.weights.safetensors_io import FormatError

# The one combination slime writes and CoreWeave hot-load accepts.
DELTA_FORMAT = {"delta_encoding": "xor", "compression_format": "zstd", "checksum_format": "adler32"}
_HASH_CHUNK = 1 << 22


def _identity(version: Version, key: str, *, allow_initial: bool) -> str:
    value = version.metadata.get(key)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise FormatError(f"index metadata has no {key}", path=version.path, reason="INVALID_INDEX")
    try:
        return check_identity(str(value), allow_initial=allow_initial)
    except InvalidArgument as exc:
        raise FormatError(
            f"index metadata {key}: {exc.message}", path=version.path, reason="INVALID_IDENTITY"
        ) from exc


def delta_metadata(version: Version) -> tuple[str, str]:
    """(version, base_version) of a delta directory whose metadata is the accepted combination."""
    if not version.is_delta:
        raise FormatError(
            "not a delta (no delta_encoding in the index metadata)", path=version.path
        )
    for key, want in DELTA_FORMAT.items():
        if version.metadata.get(key) != want:
            raise FormatError(
                f"{key} is {version.metadata.get(key)!r}; only {want!r} is supported",
                path=version.path,
                reason="UNSUPPORTED_DELTA",
            )
    return (
        _identity(version, "version", allow_initial=False),
        _identity(version, "base_version", allow_initial=True),
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_delta(version: Version) -> int | None:
    """Validates every delta tensor; returns the decoded size, None if a frame declares none."""
    decoded: int | None = 0
    for name, entry in version.entries.items():
        path = entry.shard.path
        if entry.info.dtype != "U8" or len(entry.info.shape) != 1:
            raise FormatError(
                f"is {entry.info.dtype}{list(entry.info.shape)}, not 1-D U8", path=path, tensor=name
            )
        if not is_adler32_hex(entry.checksum):
            raise FormatError(
                "no Adler-32 of the new bytes in __metadata__", path=path, tensor=name
            )
        frame = version.view(name)
        try:
            if frame_compressed_size(frame) != entry.info.nbytes:
                raise DeltaError("data after the zstd frame")
            size = frame_content_size(frame)
        except DeltaError as exc:
            raise FormatError(str(exc), path=path, tensor=name, reason="CORRUPT_DELTA") from exc
        finally:
            frame.release()
        decoded = None if size is None or decoded is None else decoded + size
    return decoded


def _check_full(version: Version, warnings: list[str]) -> bool:
    """Verifies the recorded checksums; returns whether there were any to verify."""
    fmt = version.metadata.get("checksum_format")
    if fmt is None:
        warnings.append("no checksum_format in the index: tensors are not checksummed")
        return False
    if fmt != CHECKSUM_FORMAT:
        raise FormatError(f"checksum_format {fmt!r} is not supported", path=version.path)
    for name, entry in version.entries.items():
        path = entry.shard.path
        if not is_adler32_hex(entry.checksum):
            raise FormatError("no Adler-32 in __metadata__", path=path, tensor=name)
        view = version.view(name)
        got = adler32_hex(view)
        view.release()
        if got != entry.checksum:
            raise FormatError(
                f"bytes hash to {got}, __metadata__ says {entry.checksum}",
                path=path,
                tensor=name,
                reason="CHECKSUM_MISMATCH",
            )
    return True


def inspect(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Validates a version directory; returns its kind, predecessor, files, sizes, warnings.

    Raises FormatError naming the file and tensor at fault.
    """
    path = Path(directory)
    if not path.is_dir():
        raise FormatError("not a directory", path=path, reason="NOT_A_DIRECTORY")
    warnings: list[str] = []
    with Version(path) as version:
        shards = set(version.weight_map.values())
        stray = sorted(
            p.name for p in path.iterdir() if p.name.endswith(SHARD_SUFFIX) and p.name not in shards
        )
        if stray:
            raise FormatError(f"shards not in the weight_map: {stray}", path=path)
        result: dict[str, Any] = {
            "kind": "delta" if version.is_delta else "full",
            "path": str(path),
        }
        if version.is_delta:
            result["version"], result["base_version"] = delta_metadata(version)
            result["model_size_bytes"] = _check_delta(version)
            result["checksums_verified"] = False
            if not version.entries:
                warnings.append("the delta changes no tensors")
        else:
            has_version = "version" in version.metadata
            result["version"] = (
                _identity(version, "version", allow_initial=False) if has_version else None
            )
            result["base_version"] = None
            result["model_size_bytes"] = sum(e.info.nbytes for e in version.entries.values())
            total = version.metadata.get("total_size")
            if total is not None and total != result["model_size_bytes"]:
                warnings.append(
                    f"index total_size {total} != {result['model_size_bytes']} tensor bytes"
                )
            if not (path / CONFIG_NAME).is_file():
                warnings.append(f"no {CONFIG_NAME}")
            result["checksums_verified"] = _check_full(version, warnings)
        result["checksum_format"] = version.metadata.get("checksum_format")
        result["tensor_count"] = len(version.entries)
        result["shard_count"] = len(shards)
    files = []
    for child in sorted(path.iterdir()):
        if child.is_file():
            files.append(
                {"name": child.name, "size_bytes": child.stat().st_size, "sha256": _sha256(child)}
            )
        else:
            warnings.append(f"{child.name} is not a regular file and is not part of the version")
    result["files"] = files
    result["total_size_bytes"] = sum(f["size_bytes"] for f in files)
    result["warnings"] = warnings
    return result
