"""The version store: per policy, a chain of immutable versions on disk.

Layout under the store root: policies/<policy>/ holds policy.json,
versions/<identity>/ (record.json, full/ and/or delta/), staging/<identity>/
for publishes in progress, cache/ for forms built on demand, current.json
(the current version, replaced by rename) and tombstones.jsonl (content
digests of collected identities, so an identity never changes content;
astra.weights.tombstones).
receivers.json lists receivers and what they hold.

The trainer publishes raw tensors; the store decides the form: a full
version every `full_every` versions (and whenever the tensor layout
changes), else an xor+zstd delta against the previous version. A version
directory appears by one rename, which is the commit point: after a crash
(kill -9) a version is absent or complete, and opening the store rebuilds
everything else from disk. Blocking and thread-safe; never touches gRPC.
"""

from __future__ import annotations

import collections
import copy
import logging
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from astra.durable import fsync_dir, make_dirs
from astra.errors import DataLoss, FailedPrecondition, InvalidArgument
from astra.weights.chain import Chain
from astra.weights.checkpoint import LayoutChanged, write_delta, write_full
from astra.weights.digest import SHA256, digest_of, kind_of
from astra.weights.hot import HotVersion
from astra.weights.layout import ChecksumMismatch, Tensor, Version
from astra.weights.pool import BufferPool
from astra.weights.publish_stage import content_mismatch
from astra.weights.receivers import Receivers
from astra.weights.records import (
    TensorRecord,
    VersionRecord,
    disk_full,
    load_json,
    sha256_bytes,
    tree_sha256,
    write_json_atomic,
)
from astra.weights.staging import staged_dir
from astra.weights.store_cache import VersionCache, put_files
from astra.weights.store_core import StoreConfig
from astra.weights.store_health import StoreHealth
from astra.weights.store_lifecycle import StoreLifecycle
from astra.weights.store_publish import StorePublishing, check_files
from astra.weights.tensor_files import assemble
from astra.weights.tombstones import Tombstones

__all__ = ["Store", "StoreConfig"]

log = logging.getLogger(__name__)


def _sha256_digest(record: VersionRecord, tensors: Mapping[str, Tensor]) -> str:
    """The content digest `record` would have with SHA-256 tensor digests, as a release before
    BLAKE3 recorded them: a tombstone left then still names the same content. Hashes every
    tensor again: only for an identity that was collected and is published once more."""
    if all(kind_of(t.digest) == SHA256 for t in record.tensors.values()):
        return record.content_digest()
    if tensors.keys() != record.tensors.keys():
        return ""
    again = copy.copy(record)
    again.tensors = {
        n: replace(t, digest=digest_of(tensors[n].data, SHA256)) for n, t in record.tensors.items()
    }
    return again.content_digest()


class Store(StorePublishing, StoreLifecycle, StoreHealth):
    """Versions of every policy under one directory."""

    def __init__(self, root: str | Path, config: StoreConfig | None = None) -> None:
        self.root = Path(root)
        self.config = config or StoreConfig()
        self.counters: collections.Counter[str] = collections.Counter()
        self.cache = VersionCache(self)
        # Each policy's current version in RAM (astra.weights.hot), and the buffers to reuse.
        self.hot: dict[str, HotVersion] = {}
        self.hot_pool = BufferPool(self.config.hot_bytes)
        self._chains: dict[str, Chain] = {}
        self._guard = threading.Lock()
        self._policy_locks: dict[str, threading.RLock] = {}
        self._publishing: set[tuple[str, str]] = set()
        self._inflight: dict[str, collections.Counter[str]] = {}
        self.tombstones = Tombstones(self.policy_dir, durable=self.config.durable)
        # durable names: a power cut must not empty the store under versions it fsynced
        make_dirs(self.root / "policies", durable=self.config.durable)
        # Replaced atomically but never fsynced: it is written at every fetch's start and end,
        # and what a power cut takes from it is only what GC spares for a while (a receiver
        # whose held version went gets a full copy; each registers again at its next fetch).
        self.receivers = Receivers(
            self.root / "receivers.json", self.config.receiver_ttl_s, durable=False
        )
        for pdir in sorted((self.root / "policies").iterdir()):
            if (pdir / "policy.json").is_file():
                self._recover(load_json(pdir / "policy.json")["policy"])

    # --- publishing ------------------------------------------------------------

    def commit(
        self,
        policy: str,
        identity: str,
        version: int,
        tensors: Mapping[str, Tensor],
        records: Mapping[str, TensorRecord],
        files: dict[str, bytes],
        metadata: dict[str, str],
        *,
        rollback_of: str = "",
        request_id: str = "",
        shards: Mapping[str, Path] | None = None,
        frames: tuple[str, Mapping[str, tuple[bytes, int] | None]] | None = None,
        hot: HotVersion | None = None,
        base: Version | None = None,
    ) -> tuple[VersionRecord, bool]:
        """Stores a version whose tensors are verified; idempotent for the same content.

        `shards`, when given, holds each tensor as a durable single-tensor
        shard whose header carries its verified Adler-32 (a publish stage):
        full copies are then linked from them instead of written again.
        `frames` is (base identity, tensors already encoded against it); used
        when that base is still the current version, so the delta is encoded once.
        `hot`: the version's bytes in RAM, kept as the policy's current version's.
        `base`: the full form of `frames`' base, open (the caller's): not read again here.
        """
        check_files(files)
        if version < 0:
            raise InvalidArgument("version must be >= 0", reason="INVALID_VERSION")
        file_hashes = {n: sha256_bytes(c) for n, c in files.items()}
        record = VersionRecord(
            policy, identity, version, "delta", "", False, dict(records), file_hashes, metadata,
            time.time(), rollback_of=rollback_of, request_id=request_id,
        )  # fmt: skip
        digest = record.content_digest()
        with self._lock(policy):
            chain = self._chains.get(policy) or self._new_policy(policy)
            existing = chain.get(identity)
            if existing is not None:
                if existing.content_digest() != digest:
                    raise content_mismatch(identity, "a different version was published as it")
                return existing, True
            tombstone = self._tombstones(policy).get(identity, digest)
            if tombstone != digest and tombstone != _sha256_digest(record, tensors):
                raise content_mismatch(identity, "a collected version had other content")
            head = chain.head
            if head is not None and version <= head.version:
                raise FailedPrecondition(
                    f"version {version} is not newer than the current {head.version}",
                    reason="VERSION_NOT_NEWER",
                    metadata={"version": str(version), "current_version": str(head.version)},
                )
            if tensors.keys() != records.keys():
                raise FailedPrecondition(
                    f"{identity!r} changed while it was being published; publish it again",
                    reason="PUBLISH_RACED",
                )
            full = head is None or chain.deltas_since_root() + 1 >= self.config.full_every
            try:
                self._write_version(
                    policy, record, head, full, tensors, files, shards, frames, base
                )
            except OSError as exc:
                raise disk_full(exc, f"cannot store {identity!r}") from exc
            chain.add(record)
            self.counters["versions_published"] += 1
            if record.kind == "delta":
                try:
                    self.cache.put_full(policy, record, tensors, files, shards)
                except OSError:
                    log.warning("%s: no full copy cached for %s", policy, identity, exc_info=True)
            self._set_current(policy, record)
            if hot is not None and hot.identity == identity:
                self.hot[policy] = hot
            else:
                self.hot.pop(policy, None)
            self.cache.keep_full(policy, {identity, record.base} | self._inflight_ids(policy))
            self.gc(policy)
            return record, False

    def _delta_base(self, policy: str, head: VersionRecord) -> Path | None:
        """The full copy of `head` to encode the next delta against; None when `head` is bad
        (its stored forms damaged): the next version is then stored full, needing no base."""
        if head.identity not in self.bad_versions(policy):
            try:
                return self.cache.full_dir(policy, head)
            except DataLoss as exc:
                self.mark_bad(policy, head.identity, exc.message)
        log.warning("%s: %s is bad; the next version is stored full", policy, head.identity)
        return None

    def _new_policy(self, policy: str) -> Chain:
        make_dirs(self.policy_dir(policy), durable=self.config.durable)
        if self.config.durable:  # a publish stage may have made it first, not durably
            fsync_dir(self.policy_dir(policy).parent)
        write_json_atomic(self.policy_dir(policy) / "policy.json", {"policy": policy})
        chain = self._chains[policy] = Chain()
        return chain

    def _write_version(
        self,
        policy: str,
        record: VersionRecord,
        head: VersionRecord | None,
        full: bool,
        tensors: Mapping[str, Tensor],
        files: dict[str, bytes],
        shards: Mapping[str, Path] | None = None,
        frames: tuple[str, Mapping[str, tuple[bytes, int] | None]] | None = None,
        base: Version | None = None,
    ) -> None:
        """Writes versions/<identity>/ in one rename: the commit point of a publish."""
        durable, level, identity = self.config.durable, self.config.zstd_level, record.identity
        with staged_dir(self.version_dir(policy, identity), durable=durable) as stage:
            base_full = self._delta_base(policy, head) if head is not None else None
            if head is not None:
                record.base = head.identity
            if head is not None and base_full is None:
                full = True
            if head is not None and base_full is not None:
                done = frames[1] if frames is not None and frames[0] == head.identity else None
                same_base = done is not None and base is not None and base.path == Path(base_full)
                opened = base if same_base else None
                try:
                    written = write_delta(
                        base_full, tensors, stage / "delta", identity, head.identity,
                        level=level, durable=durable, frames=done, opened=opened,
                    )  # fmt: skip
                    record.has_delta = True
                    record.num_stored_tensors = written["changed_tensor_count"]
                except LayoutChanged as exc:
                    log.info("%s: %s; %s is stored full", policy, exc.message, identity)
                    full = True
                except ChecksumMismatch as exc:  # the base's bytes are damaged
                    if not Path(exc.path or "/").is_relative_to(base_full):
                        raise
                    tensor = str(exc.metadata.get("tensor", ""))
                    log.error("%s: %s; %s is stored full", policy, exc.message, identity)
                    self.counters["delta_bases_damaged"] += 1
                    self.refused(policy, head.identity, base_full, tensor)
                    shutil.rmtree(stage / "delta", ignore_errors=True)
                    full = True
            record.kind = "full" if full else "delta"
            if full and shards is not None and shards.keys() == record.tensors.keys():
                sizes = {n: t.size_bytes for n, t in record.tensors.items()}
                assemble(stage / "full", shards, sizes, version=identity, durable=durable)
                record.num_stored_tensors = len(tensors)
            elif full:
                write_full(stage / "full", tensors, version=identity, durable=durable)
                record.num_stored_tensors = len(tensors)
            same = {}
            if head is not None:  # files the last version stored with the same content
                stored = self.version_dir(policy, head.identity) / head.primary
                same = {n: stored / n for n in files if head.files.get(n) == record.files[n]}
            put_files(stage / record.primary, files, durable=durable, same=same)
            record.file_sha256 = tree_sha256(stage)
            record.size_bytes = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file())
            record.save(stage)
