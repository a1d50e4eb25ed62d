"""Per-tensor content digests: what makes two publishes of one identity comparable.

A version's identity is immutable, so the store records a cryptographic
digest of every tensor's raw bytes and compares a later publish of the same
identity against it (astra.weights.records.VersionRecord.content_digest).
New records use BLAKE3, which hashes at 3-4x SHA-256's speed on one core
(and on every core for a large tensor); SHA-256 was the dearest pass of a
publish. Records written before hold SHA-256. A digest is written
"KIND:HEX" ("blake3:..." or "sha256:..."); a record from before the tags
holds bare SHA-256 hex. A tensor compared against a record is hashed with
that record's kind, so an identity published before the change is still
recognised. Files (config.json, shards) keep SHA-256 (`file_sha256`).
Knows nothing of files, records or gRPC.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

import blake3

BLAKE3 = "blake3"
SHA256 = "sha256"
KINDS = (BLAKE3, SHA256)
DEFAULT = BLAKE3


class Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...
    def hexdigest(self) -> str: ...


def hasher(kind: str = DEFAULT) -> Hasher:
    """A running digest of `kind`; `update` releases the GIL on large buffers."""
    if kind == BLAKE3:
        return blake3.blake3()
    if kind == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown digest kind {kind!r}; known: {', '.join(KINDS)}")


def tagged(kind: str, hexdigest: str) -> str:
    return f"{kind}:{hexdigest}"


def finish(kind: str, running: Hasher) -> str:
    """The tagged digest of what `running` was given."""
    return tagged(kind, running.hexdigest())


def digest_of(data: Any, kind: str = DEFAULT) -> str:
    """The tagged digest of one buffer."""
    running = hasher(kind)
    running.update(memoryview(data).cast("B"))
    return finish(kind, running)


def normalized(value: str) -> str:
    """A stored digest in tagged form: bare hex (records before the tags) is SHA-256."""
    return value if ":" in value else tagged(SHA256, value)


def kind_of(value: str) -> str:
    """The kind of a stored digest (tagged or bare)."""
    kind = normalized(value).split(":", 1)[0]
    if kind not in KINDS:
        raise ValueError(f"unknown digest kind {kind!r} in {value!r}")
    return kind


def digest_body(value: str) -> str:
    """What a version's content digest hashes for this tensor digest.

    SHA-256 digests enter as bare hex, as they did before digests were
    tagged, so the content digest (and the tombstone) of a version stored
    then is the same today; other kinds enter tagged, so they never equal one.
    """
    value = normalized(value)
    kind, hexdigest = value.split(":", 1)
    return hexdigest if kind == SHA256 else value
