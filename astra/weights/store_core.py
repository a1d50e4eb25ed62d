"""The store's shared state and lookups: `StoreConfig` and `StoreCore`.

`StoreCore` declares what every part of the version store holds (the chains,
the cache, the RAM copies, the locks, the counters) and answers the lookups
(paths, chains, records, version files). `Store` (astra.weights.store) builds
it; its parts (store_health, store_lifecycle, store_publish) extend it, so
none of them imports the module that joins them. Never writes anything.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astra.errors import DataLoss, InvalidArgument, NotFound
from astra.weights.chain import Chain
from astra.weights.hot import HotVersion
from astra.weights.pool import BufferPool
from astra.weights.receivers import Receivers
from astra.weights.records import VersionRecord, dirname_for, sha256_bytes
from astra.weights.tombstones import Tombstones


@dataclass(frozen=True)
class StoreConfig:
    """How versions are stored, planned and kept."""

    full_every: int = 20  # a full version every K versions, 1-64
    max_chain: int = 128  # most deltas a plan bridges; a receiver further behind gets a full copy
    keep_versions: int = 8  # newest versions kept whatever receivers hold
    receiver_ttl_s: float = 3600.0  # a receiver's registration lapses after this
    zstd_level: int = 1
    durable: bool = True  # fsync before every rename
    # A policy's current version is kept in RAM when at most this large, so the next publish is
    # encoded or decoded against memory instead of a read of the whole model from disk; up to
    # twice this per policy while a publish builds the next one. 0: never.
    hot_bytes: int = 4 << 30
    # A publish holds tensors below INLINE_BYTES (256 KiB) in RAM, up to this many bytes in
    # all, and writes them as one file at the commit instead of a file (and fsync) each; an
    # interrupted publish sends them again. 0: every tensor staged in its own file.
    ram_stage_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not 1 <= self.full_every <= 64:
            raise InvalidArgument("full_every must be 1-64", reason="INVALID_CONFIG")
        if self.hot_bytes < 0 or self.ram_stage_bytes < 0:
            raise InvalidArgument(
                "hot_bytes and ram_stage_bytes must be >= 0", reason="INVALID_CONFIG"
            )
        if self.max_chain < 1 or self.keep_versions < 1 or self.receiver_ttl_s <= 0:
            raise InvalidArgument(
                "max_chain and keep_versions must be >= 1, receiver_ttl_s > 0",
                reason="INVALID_CONFIG",
            )


class StoreCore:
    """What the store's parts share; `Store.__init__` sets every attribute."""

    root: Path
    config: StoreConfig
    counters: collections.Counter[str]
    cache: Any  # astra.weights.store_cache.VersionCache (it reads the store back)
    hot: dict[str, HotVersion]
    hot_pool: BufferPool
    receivers: Receivers
    tombstones: Tombstones
    _chains: dict[str, Chain]
    _guard: threading.Lock
    _policy_locks: dict[str, threading.RLock]
    _publishing: set[tuple[str, str]]
    _inflight: dict[str, collections.Counter[str]]
    # Defined by Store (astra.weights.store): the commit point, and a new policy's chain.
    commit: Callable[..., Any]
    _new_policy: Callable[[str], Chain]

    # --- paths and lookups -------------------------------------------------

    def policy_dir(self, policy: str) -> Path:
        return self.root / "policies" / dirname_for(policy)

    def version_dir(self, policy: str, identity: str) -> Path:
        return self.policy_dir(policy) / "versions" / dirname_for(identity)

    def policies(self) -> list[str]:
        return sorted(self._chains)

    def chain(self, policy: str) -> Chain:
        chain = self._chains.get(policy)
        if chain is None:
            raise NotFound(
                f"unknown policy {policy!r}", reason="POLICY_NOT_FOUND", metadata={"policy": policy}
            )
        return chain

    def get(self, policy: str, identity: str) -> VersionRecord:
        record = self.chain(policy).get(identity)
        if record is None:
            raise NotFound(
                f"policy {policy!r} has no version {identity!r}",
                reason="VERSION_NOT_FOUND",
                metadata={"policy": policy, "identity": identity},
            )
        return record

    def current(self, policy: str) -> VersionRecord:
        head = self.chain(policy).head
        if head is None:
            raise NotFound(f"policy {policy!r} has no versions", reason="VERSION_NOT_FOUND")
        return head

    def list_versions(self, policy: str) -> list[VersionRecord]:
        """Newest first."""
        return list(reversed(self.chain(policy).records))

    def read_files(
        self, policy: str, record: VersionRecord, skip: Iterable[str] = ()
    ) -> dict[str, bytes]:
        """The version's extra files but `skip`, each checked against the SHA-256 its record
        holds (DataLoss, reason FILE_CHECKSUM_MISMATCH, naming the file)."""
        primary = self.version_dir(policy, record.identity) / record.primary
        out, skip = {}, set(skip)
        for name, want in record.files.items():
            if name in skip:
                continue
            content = (primary / name).read_bytes()
            if sha256_bytes(content) != want:
                raise DataLoss(
                    f"{primary / name}: its bytes do not hash to the SHA-256 its record holds",
                    reason="FILE_CHECKSUM_MISMATCH",
                    metadata={"file": name, "identity": record.identity},
                )
            out[name] = content
        return out

    def _lock(self, policy: str) -> threading.RLock:
        with self._guard:
            return self._policy_locks.setdefault(policy, threading.RLock())
