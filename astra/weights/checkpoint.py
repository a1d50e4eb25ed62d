"""Writes full and delta version directories; the one entry point for the format.

Full: a Hugging Face checkpoint whose shard headers carry each tensor's
Adler-32. Delta: slime's xor+zstd layout (cwtrain README, "What lands in the
bucket"): only changed tensors, each a U8 tensor holding one zstd frame,
checksums of the new bytes. The delta format carries no dtype or shape of the
original tensors, so apply takes them from the base: a tensor added, removed,
or changed in dtype or shape is refused here (LayoutChanged) and needs a full
version. Every directory appears atomically (staging + rename) or not at all.
Re-exports apply_delta, inspect and load_tensors. Never touches gRPC or the store.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from astra.errors import InvalidArgument
from astra.weights.apply import apply_delta, worker_count
from astra.weights.checksum import CHECKSUM_FORMAT, adler32_hex, format_adler32
from astra.weights.delta import DEFAULT_LEVEL, encode_if_changed
from astra.weights.layout import (
    CONFIG_NAME,
    INDEX_NAME,
    SHARD_SUFFIX,
    ChecksumMismatch,
    LayoutChanged,
    Tensor,
    Version,
    check_identity,
    delta_shard_name,
    full_shard_name,
    load_tensors,
    open_full,
    plan_shards,
    write_index,
)
from astra.weights.safetensors_io import tensor_nbytes, write_file
from astra.weights.staging import require_absent, staged_dir
from astra.weights.validate import inspect

__all__ = [
    "LayoutChanged",
    "apply_delta",
    "check_identity",
    "inspect",
    "load_tensors",
    "write_delta",
    "write_full",
]

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # Hugging Face's default "5GB"


def _as_tensor(name: str, value: Any) -> Tensor:
    dtype, shape, data = value
    view = memoryview(data).cast("B")
    try:
        size = tensor_nbytes(dtype, tuple(shape))
    except ValueError as exc:
        raise InvalidArgument(
            f"{name}: {exc}", reason="INVALID_TENSOR", metadata={"tensor": name}
        ) from exc
    if size != view.nbytes:
        raise InvalidArgument(
            f"{name}: {view.nbytes} bytes, {dtype}{list(shape)} needs {size}",
            reason="INVALID_TENSOR",
            metadata={"tensor": name},
        )
    return Tensor(dtype, tuple(shape), view)


def write_full(
    out_dir: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    version: str | None = None,
    files: Mapping[str, bytes] | None = None,
    durable: bool = True,
) -> dict[str, Any]:
    """Writes a checksummed Hugging Face checkpoint of (dtype, shape, bytes) tensors; returns its index."""
    items = {name: _as_tensor(name, t) for name, t in tensors.items()}
    for name in files or {}:
        if name in (INDEX_NAME, CONFIG_NAME) or name.endswith(SHARD_SUFFIX) or "/" in name:
            raise InvalidArgument(
                f"extra file {name!r} collides with the layout", reason="INVALID_FILE"
            )
    plan = plan_shards([(n, t.data.nbytes) for n, t in items.items()], max_shard_bytes)
    metadata: dict[str, Any] = {"total_size": sum(t.data.nbytes for t in items.values())}
    metadata["checksum_format"] = CHECKSUM_FORMAT
    if version is not None:
        metadata["version"] = check_identity(version)
    weight_map: dict[str, str] = {}
    with staged_dir(out_dir, durable=durable) as stage:
        for i, names in enumerate(plan):
            shard = full_shard_name(i, len(plan))
            checksums = {"format": "pt", **{n: adler32_hex(items[n].data) for n in names}}
            write_file(stage / shard, [(n, *items[n]) for n in names], checksums)
            weight_map.update(dict.fromkeys(names, shard))
        if config is not None:
            (stage / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        for name, content in (files or {}).items():
            (stage / name).write_bytes(content)
        write_index(stage, metadata, weight_map)
    return {"metadata": metadata, "weight_map": weight_map}


def _source_version(new: Any) -> tuple[Version | None, dict[str, Tensor]]:
    if isinstance(new, Mapping):
        return None, {name: _as_tensor(name, t) for name, t in new.items()}
    source = open_full(new)
    views = {
        n: Tensor(e.info.dtype, e.info.shape, source.view(n)) for n, e in source.entries.items()
    }
    return source, views


def write_delta(
    base_dir: str | os.PathLike[str],
    new: str | os.PathLike[str] | Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    version: str | None = None,
    base_version: str | None = None,
    *,
    level: int = DEFAULT_LEVEL,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    workers: int | None = None,
    durable: bool = True,
    frames: Mapping[str, tuple[bytes, int] | None] | None = None,
    opened: Version | None = None,
) -> dict[str, Any]:
    """Writes the xor+zstd delta taking base_dir to `new` (a full directory or tensors).

    `version` defaults to the new directory's index version or name,
    `base_version` to the base's. `frames` holds tensors already encoded
    against this base (encode_if_changed's result, e.g. while they were
    received); only the others are encoded here. `opened`: base_dir already open as a full
    Version (the caller's, left open), so its shards are not read and checked again.
    Returns sizes and counts.
    """
    frames = frames or {}
    require_absent(out_dir)  # before the encoding work, not only at the rename
    if opened is not None and (opened.path != Path(base_dir) or opened.is_delta):
        raise ValueError(f"opened is {opened.path}, not the full version at {base_dir}")
    with contextlib.nullcontext(opened) if opened is not None else open_full(base_dir) as base:
        source, tensors = _source_version(new)
        try:
            if base_version is None:
                base_version = str(base.metadata.get("version") or base.path.resolve().name)
            if version is None:
                if source is None:
                    raise InvalidArgument(
                        "version is required for in-memory tensors", reason="NO_VERSION"
                    )
                version = str(source.metadata.get("version") or source.path.resolve().name)
            check_identity(version)
            check_identity(base_version, allow_initial=True)
            for name, t in tensors.items():
                old = base.entries.get(name)
                if old is None:
                    raise LayoutChanged(name, "not in the base")
                if (old.info.dtype, old.info.shape) != (t.dtype, t.shape):
                    raise LayoutChanged(
                        name,
                        f"{old.info.dtype}{list(old.info.shape)} became {t.dtype}{list(t.shape)}",
                    )
            missing = sorted(base.entries.keys() - tensors.keys())
            if missing:
                raise LayoutChanged(missing[0], "missing from the new version")
            names = sorted(tensors)

            def encode(name: str) -> tuple[bytes, int] | None:
                if name in frames:
                    return frames[name]
                old, view = base.entries[name], base.view(name)
                # The base's bytes are checked as they are read: a delta against damaged bytes
                # would decode to garbage on every receiver.
                if (want := old.checksum) is not None and (got := adler32_hex(view)) != want:
                    raise ChecksumMismatch(
                        f"{name}: the base's bytes hash to {got}, its file says {want}",
                        path=old.shard.path,
                        tensor=name,
                    )
                return encode_if_changed(tensors[name].data, view, level)

            if all(name in frames for name in names):  # encoded while received: no pool
                encoded = [frames[name] for name in names]
            else:
                with ThreadPoolExecutor(worker_count(workers)) as pool:
                    encoded = list(pool.map(encode, names))
            changed = {n: e for n, e in zip(names, encoded, strict=True) if e is not None}
            for name, (_, value) in changed.items():
                recorded = source.entries[name].checksum if source else None
                if recorded is not None and recorded != format_adler32(value):
                    raise ChecksumMismatch(
                        "new tensor does not match its checksum", path=new, tensor=name
                    )
            metadata = {
                "version": version,
                "base_version": base_version,
                "delta_encoding": "xor",
                "compression_format": "zstd",
                "checksum_format": CHECKSUM_FORMAT,
            }
            plan = plan_shards([(n, len(f)) for n, (f, _) in changed.items()], max_shard_bytes)
            weight_map: dict[str, str] = {}
            with staged_dir(out_dir, durable=durable) as stage:
                for i, shard_names in enumerate(plan):
                    shard = delta_shard_name(i, len(plan))
                    entries = [(n, "U8", (len(changed[n][0]),), changed[n][0]) for n in shard_names]
                    sums = {n: format_adler32(changed[n][1]) for n in shard_names}
                    write_file(stage / shard, entries, sums)
                    weight_map.update(dict.fromkeys(shard_names, shard))
                write_index(stage, metadata, weight_map)
            model_bytes = sum(t.data.nbytes for t in tensors.values())
            return {
                "kind": "delta",
                "path": str(out_dir),
                "version": version,
                "base_version": base_version,
                "tensor_count": len(tensors),
                "changed_tensor_count": len(changed),
                "model_size_bytes": model_bytes,
                "changed_size_bytes": sum(tensors[n].data.nbytes for n in changed),
                "delta_size_bytes": sum(len(f) for f, _ in changed.values()),
                "shard_count": len(plan),
            }
        finally:
            tensors.clear()
            if source is not None:
                source.close()
