"""What the store records about each version, and the small file helpers it needs.

A `VersionRecord` is written as record.json inside the version's directory,
in the same atomic rename as the version itself, so a version on disk always
has its record. It names the identity, the step counter, how the version is
stored, every tensor (dtype, shape, Adler-32 and content digest of its raw
bytes: astra.weights.digest), the SHA-256 of every stored file, and a digest
of the content that decides whether a repeated publish of the identity is
the same. Never touches gRPC.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from astra.damage import Damaged
from astra.durable import fsync_path
from astra.errors import InvalidArgument, ResourceExhausted
from astra.weights.digest import digest_body, normalized

RECORD_NAME = "record.json"
STORE_FIX = (
    "restore it from a backup, or move the store directory aside (the trainer publishes "
    "again; `astra doctor RUN_DIR` lists what else is damaged)"
)


def load_json(path: Path) -> Any:
    """A JSON file of the store read back at start-up; Damaged (naming it) if it does not."""
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise Damaged(path, f"not JSON ({exc})", STORE_FIX) from exc


_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HASH_CHUNK = 1 << 22
MAX_POLICY_CHARS = 128


def dirname_for(name: str) -> str:
    """A directory name for an identity or policy: itself when plain, else `~` + its hash.

    Keeps arbitrary identities (spaces, leading dots, non-ASCII) out of path
    names, where they could collide with staging directories or be
    normalised by the filesystem.
    """
    if _PLAIN.fullmatch(name) and ".staging-" not in name:
        return name
    return "~" + hashlib.sha256(name.encode()).hexdigest()[:32]


def check_policy(policy: str) -> str:
    """A policy id: 1-128 characters, no NUL."""
    if not isinstance(policy, str) or not 1 <= len(policy) <= MAX_POLICY_CHARS or "\0" in policy:
        raise InvalidArgument(
            f"policy id {policy!r} must be 1-{MAX_POLICY_CHARS} characters",
            reason="INVALID_POLICY_ID",
            metadata={"field": "policy_id"},
        )
    return policy


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tree_sha256(directory: Path) -> dict[str, str]:
    """SHA-256 of every regular file under directory, keyed by relative path."""
    return {
        str(p.relative_to(directory)): sha256_file(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != RECORD_NAME
    }


def write_json_atomic(path: Path, body: Any, *, durable: bool = True) -> None:
    """Writes JSON to a temporary sibling and renames it over `path`: readers see old or new."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.write("\n")
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_path(path.parent)


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a version, as the trainer published it."""

    dtype: str
    shape: tuple[int, ...]
    size_bytes: int
    adler32: str
    digest: str  # "blake3:<hex>" or "sha256:<hex>" (astra.weights.digest)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "size_bytes": self.size_bytes,
            "adler32": self.adler32,
            "digest": self.digest,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> TensorRecord:
        """From a record or manifest line; one written before digests were tagged has `sha256`."""
        digest = body["digest"] if "digest" in body else body["sha256"]
        size = body["size_bytes"] if "size_bytes" in body else body["size"]
        return cls(body["dtype"], tuple(body["shape"]), size, body["adler32"], normalized(digest))


@dataclass
class VersionRecord:
    """One stored version. `kind` is the primary stored form; a full version past the
    first also keeps a `delta` against its predecessor (`has_delta`), so receivers
    cross full roots with deltas."""

    policy: str
    identity: str
    version: int
    kind: str  # "full" | "delta"
    base: str  # predecessor identity, "" for the first version
    has_delta: bool
    tensors: dict[str, TensorRecord]
    files: dict[str, str]  # extra files (config.json, tokenizer) -> SHA-256
    metadata: dict[str, str]
    create_time: float
    file_sha256: dict[str, str] = field(default_factory=dict)  # stored files by relative path
    size_bytes: int = 0
    num_stored_tensors: int = 0  # all tensors for a full version, changed ones for a delta
    rollback_of: str = ""
    request_id: str = ""

    @property
    def primary(self) -> str:
        """The subdirectory holding the primary stored form and the extra files."""
        return self.kind

    def content_digest(self) -> str:
        """SHA-256 of what the identity names: step counter, tensors, extra files, metadata."""
        body = {
            "version": self.version,
            "tensors": {
                n: [t.dtype, list(t.shape), digest_body(t.digest)] for n, t in self.tensors.items()
            },
            "files": self.files,
            "metadata": self.metadata,
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        # Field by field (asdict deep-copies every value, twice for the tensors: a few ms a
        # version for a model of a few dozen tensors, on every publish).
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body["tensors"] = {n: t.to_json() for n, t in self.tensors.items()}
        body["files"], body["metadata"] = dict(self.files), dict(self.metadata)
        body["file_sha256"] = dict(self.file_sha256)
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> VersionRecord:
        tensors = {n: TensorRecord.from_json(t) for n, t in body["tensors"].items()}
        return cls(**{**body, "tensors": tensors})

    @classmethod
    def load(cls, directory: Path) -> VersionRecord:
        """Damaged (naming the file) if the record does not read back."""
        path = directory / RECORD_NAME
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise Damaged(path, f"unreadable version record ({exc!r})", STORE_FIX) from exc

    def save(self, directory: Path) -> None:
        # No indent: json's C encoder then writes it (the Python one took ~3 ms a version).
        (directory / RECORD_NAME).write_text(json.dumps(self.to_json()) + "\n")


def sha256_bytes(data: Any) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def disk_full(exc: OSError, what: str) -> ResourceExhausted | OSError:
    """RESOURCE_EXHAUSTED (DISK_FULL) for ENOSPC/EDQUOT, the error itself otherwise."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{what}: {exc.strerror}", reason="DISK_FULL", retry_after_s=30.0)
    return exc
