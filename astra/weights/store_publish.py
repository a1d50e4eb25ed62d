"""Publishing into the store: streamed sessions, in-memory tensors, checkpoint directories.

A session claims its (policy, identity) for its lifetime, so two streams
never write one stage; a second is told to retry (UNAVAILABLE). For a new
identity, verified tensors are staged durably and survive a disconnect or a
restart; `commit` stores the version and removes the stage. For an identity
that exists, tensors are only compared as they stream (nothing is written)
and the commit succeeds when every byte matches. Never touches gRPC.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from astra.errors import (
    AlreadyExists,
    AstraError,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from astra.weights.apply import worker_count
from astra.weights.checksum import adler32_hex
from astra.weights.digest import DEFAULT, digest_of, kind_of
from astra.weights.hot import HotBuilder
from astra.weights.layout import (
    INDEX_NAME,
    SHARD_SUFFIX,
    Tensor,
    Version,
    check_identity,
    extra_files,
    open_full,
)
from astra.weights.publish_sink import TensorSink
from astra.weights.publish_stage import PublishStage, content_mismatch
from astra.weights.records import (
    RECORD_NAME,
    TensorRecord,
    VersionRecord,
    check_policy,
    dirname_for,
)
from astra.weights.safetensors_io import tensor_nbytes
from astra.weights.store_core import StoreCore
from astra.weights.tensor_files import read_range

log = logging.getLogger(__name__)
MAX_FILES = 64
MAX_FILE_BYTES = 8 << 20


def check_files(files: Mapping[str, bytes]) -> None:
    """Extra files: at most 64 of at most 8 MiB, plain names that do not collide with the layout."""
    if len(files) > MAX_FILES:
        raise InvalidArgument(f"more than {MAX_FILES} files", reason="INVALID_FILE")
    for name, content in files.items():
        bad = (
            not name
            or len(name.encode()) > 255  # the filesystem's limit is in bytes
            or "/" in name
            or "\\" in name
            or "\0" in name
            or name.startswith(".")
            or name in (INDEX_NAME, RECORD_NAME)
            or name.endswith(SHARD_SUFFIX)
        )
        if bad:
            raise InvalidArgument(
                f"file name {name!r} is not allowed", reason="INVALID_FILE", metadata={"file": name}
            )
        if len(content) > MAX_FILE_BYTES:
            raise InvalidArgument(
                f"file {name!r} is larger than {MAX_FILE_BYTES} bytes",
                reason="INVALID_FILE",
                metadata={"file": name},
            )


def hash_tensors(
    tensors: Mapping[str, Tensor], kinds: Mapping[str, str] | None = None
) -> dict[str, TensorRecord]:
    """Adler-32 and content digest of every tensor, in parallel threads (both release the
    GIL); `kinds` names a tensor's digest kind where it is not the default (to compare it with
    a record made by an earlier release)."""

    def one(item: tuple[str, Tensor]) -> tuple[str, TensorRecord]:
        name, t = item
        try:
            size = tensor_nbytes(t.dtype, t.shape)
        except ValueError as exc:
            raise InvalidArgument(
                f"{name}: {exc}", reason="INVALID_TENSOR", metadata={"tensor": name}
            ) from exc
        view = memoryview(t.data).cast("B")
        if view.nbytes != size:
            raise InvalidArgument(
                f"{name}: {view.nbytes} bytes, {t.dtype}{list(t.shape)} needs {size}",
                reason="INVALID_TENSOR",
                metadata={"tensor": name},
            )
        return name, TensorRecord(
            t.dtype, tuple(t.shape), size, adler32_hex(view),
            digest_of(view, (kinds or {}).get(name, DEFAULT)),
        )  # fmt: skip

    with ThreadPoolExecutor(worker_count(None)) as pool:
        return dict(pool.map(one, sorted(tensors.items())))


class PublishSession:
    """One publish stream's view of the store; close it whatever happens."""

    def __init__(
        self,
        store: StoreCore,
        policy: str,
        identity: str,
        version: int,
        metadata: dict[str, str],
        delta_base: str = "",
        restart: bool = False,
    ) -> None:
        if version < 0:
            raise InvalidArgument("version must be >= 0", reason="INVALID_VERSION")
        self.store, self.policy, self.identity = store, policy, identity
        self.version, self.metadata = version, metadata
        self._key = (policy, identity)
        self._closed = False
        self.stage: PublishStage | None = None
        base: Version | None = None
        with store._guard:
            if self._key in store._publishing:
                raise Unavailable(
                    f"{identity!r} is being published by another stream",
                    reason="PUBLISH_IN_PROGRESS",
                    metadata={"identity": identity},
                    retry_after_s=1.0,
                )
            store._publishing.add(self._key)
        try:
            chain = store._chains.get(policy)
            self.existing: VersionRecord | None = chain.get(identity) if chain else None
            header = {"policy": policy, "identity": identity, "version": version}
            header["metadata"] = metadata
            expected = None
            if self.existing is not None:
                if (self.existing.version, self.existing.metadata) != (version, metadata):
                    raise content_mismatch(identity, "version or metadata differ")
                expected = self.existing.tensors
            path = store.policy_dir(policy) / "staging" / dirname_for(identity)
            base, base_identity = (None, "") if expected is not None else _open_base(store, policy)
            if delta_base and (base is None or base_identity != delta_base):
                now = "an existing identity" if expected is not None else repr(base_identity)
                raise FailedPrecondition(
                    f"xor+zstd tensors against {delta_base!r}, but the publish of {identity!r} "
                    f"decodes against {now}: publish raw tensors",
                    reason="PUBLISH_BASE_NOT_CURRENT",
                    metadata={"base_version_id": delta_base, "current": base_identity},
                )
            hot = store.hot.get(policy)
            hot_base = hot if hot is not None and hot.identity == base_identity else None
            hot_new = None
            if expected is None and store.config.hot_bytes:
                hot_new = HotBuilder(store.hot_pool, store.config.hot_bytes)
            self.stage = PublishStage(
                path, header, expected=expected, durable=store.config.durable,
                base=base, base_identity=base_identity, level=store.config.zstd_level,
                hot_base=hot_base, hot_new=hot_new, restart=restart,
                ram_bytes=store.config.ram_stage_bytes,
            )  # fmt: skip
            if hot_base is not None:
                store.counters["publish_base_in_memory"] += 1
        except BaseException:
            if base is not None and self.stage is None:
                base.close()
            self.close()
            raise

    @property
    def held(self) -> list[str]:
        """Tensors already staged by an earlier attempt; the client skips them."""
        return sorted(self.stage.held)

    def held_records(self) -> list[tuple[str, TensorRecord]]:
        """The held tensors with their records (dtype, shape, size, Adler-32), by name."""
        return sorted((n, rec) for n, (_file, rec) in self.stage.held.items())

    def begin_tensor(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        adler: str,
        *,
        encoded: int | None = None,
    ) -> TensorSink:
        """A tensor's sink: raw bytes, or (encoded: its length) an xor+zstd frame against the base."""
        return self.stage.begin_tensor(name, dtype, shape, adler, encoded=encoded)

    def add_file(self, name: str, content: bytes) -> None:
        if name in self.stage.files:
            raise InvalidArgument(f"file {name!r} sent twice", reason="INVALID_FILE")
        check_files({name: content})
        self.stage.files[name] = content

    def add_base_file(self, name: str, sha256: str) -> None:
        """The base's file of this name, which must hash to `sha256` (the sender's copy):
        FAILED_PRECONDITION (FILE_NOT_IN_BASE) when the base has no such file."""
        base = self.stage.base_identity
        chain = self.store._chains.get(self.policy)
        record = chain.get(base) if chain is not None and base else None
        if record is None or record.files.get(name) != sha256:
            raise FailedPrecondition(
                f"file {name!r}: the base {base!r} has no file of that name and SHA-256; "
                "send its content",
                reason="FILE_NOT_IN_BASE",
                metadata={"file": name, "base_version_id": base},
            )
        skip = set(record.files) - {name}
        try:
            content = self.store.read_files(self.policy, record, skip=skip)[name]
        except (DataLoss, OSError) as exc:  # its stored copy rotted or went: the sender's, then
            raise FailedPrecondition(
                f"file {name!r}: the base's copy cannot be read back ({exc}); send its content",
                reason="FILE_NOT_IN_BASE",
                metadata={"file": name, "base_version_id": base},
            ) from exc
        self.add_file(name, content)
        self.store.counters["publish_files_same_as_base"] += 1

    def commit(self, num_tensors: int) -> tuple[VersionRecord, bool]:
        """Stores the version (or confirms the existing one); the stage goes once stored."""
        self.stage.flush()
        self.stage.pack()
        records = self.stage.records()
        if num_tensors != len(records):
            raise InvalidArgument(
                f"commit says {num_tensors} tensors, {len(records)} were received",
                reason="PUBLISH_INCOMPLETE",
                metadata={"received": str(len(records))},
            )
        tensors = {} if self.existing is not None else self.stage.tensors()
        try:
            result = self.store.commit(
                self.policy,
                self.identity,
                self.version,
                tensors,
                records,
                dict(self.stage.files),
                self.metadata,
                shards=self.stage.shards(),
                frames=(self.stage.base_identity, dict(self.stage.frames)),
                hot=self.stage.hot_version(self.identity, records),
                base=self.stage.base,
            )
        except AlreadyExists:
            self.stage.remove()  # refused content leaves nothing behind
            raise
        finally:
            tensors.clear()
        self.stage.remove()
        return result

    def close(self) -> None:
        """Releases the stage and the identity; a second call does nothing (the identity may
        be another stream's by then)."""
        if self._closed:
            return
        self._closed = True
        if self.stage is not None:
            hot_base = self.stage.hot_base
            if self.stage.base_suspect and hot_base is not None:
                # A frame decoded against the RAM copy failed its checksum, or the copy's own
                # bytes did not match what is stored: while it is still the current version's,
                # it goes, so what follows reads the base from disk (verified when stored).
                self.store.counters["ram_base_mismatches"] += 1
                log.warning("%s: the RAM copy of %s is suspect", self.policy, hot_base.identity)
                with self.store._lock(self.policy):
                    if self.store.hot.get(self.policy) is hot_base:
                        del self.store.hot[self.policy]
            self.stage.close()
        with self.store._guard:
            self.store._publishing.discard(self._key)


def _open_base(store: StoreCore, policy: str) -> tuple[Version | None, str]:
    """The current version's full form, which the new tensors are encoded against as they arrive."""
    chain = store._chains.get(policy)
    head = chain.head if chain is not None else None
    if head is None:
        return None, ""
    try:
        return open_full(store.cache.full_dir(policy, head)), head.identity
    except AstraError as exc:  # no full form to encode against: the commit decides
        log.info("%s: no base to encode %s against while it streams: %s", policy, head, exc)
        return None, ""


class StorePublishing(StoreCore):
    """The ways into the store: a streamed session, in-memory tensors, a checkpoint directory."""

    def begin_publish(
        self,
        policy: str,
        identity: str,
        version: int,
        metadata: Mapping[str, str] | None = None,
        *,
        delta_base: str = "",
        restart: bool = False,
    ) -> PublishSession:
        """Opens (or resumes) a streamed publish; the caller must close the session.

        delta_base: the sender's tensors may be xor+zstd frames against this
        identity, which must be the current version (FAILED_PRECONDITION otherwise).
        restart: drop what an earlier, uncommitted attempt staged for the identity.
        """
        check_policy(policy)
        check_identity(identity)
        return PublishSession(
            self, policy, identity, version, dict(metadata or {}), delta_base, restart
        )

    def publish(
        self,
        policy: str,
        identity: str,
        version: int,
        tensors: Mapping[str, Any],
        files: Mapping[str, bytes] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[VersionRecord, bool]:
        """Publishes in-memory (dtype, shape, bytes) tensors; returns (record, already existed)."""
        check_policy(policy)
        check_identity(identity)
        items = {
            n: Tensor(d, tuple(s), memoryview(b).cast("B")) for n, (d, s, b) in tensors.items()
        }
        try:
            return self._publish_tensors(
                policy, identity, version, items, dict(files or {}), dict(metadata or {})
            )
        finally:
            items.clear()

    def publish_dir(
        self, policy: str, identity: str, version: int, directory: str | Path
    ) -> tuple[VersionRecord, bool]:
        """Publishes a full checkpoint directory (a relay importing what it fetched)."""
        with open_full(directory) as source:
            sources = {
                n: Tensor(
                    e.info.dtype, e.info.shape, (e.shard.path, e.shard.data_start + e.info.begin)
                )
                for n, e in source.entries.items()
            }
            files = {p.name: p.read_bytes() for p in extra_files(source)}
            return self._publish_tensors(policy, identity, version, sources, files, {})

    def _publish_tensors(
        self,
        policy: str,
        identity: str,
        version: int,
        tensors: Mapping[str, Tensor],
        files: dict[str, bytes],
        metadata: dict[str, str],
    ) -> tuple[VersionRecord, bool]:
        """Writes each tensor once, as a single-tensor shard, through a publish session.

        Adler-32, content digest and the xor+zstd frame against the current version
        are computed as the bytes are written (one pass, several tensors at
        once); the commit then writes those frames as the delta and links the
        shards as the full copy: nothing is written, hashed or encoded twice.
        A tensor's data is a buffer, or (path, offset) of its bytes in a file,
        read without mapping it.
        """
        sizes = {n: _checked_size(n, t) for n, t in tensors.items()}
        with self._lock(policy):  # the policy exists from here on, as when the commit began it
            if policy not in self._chains:
                self._new_policy(policy)
        session = self.begin_publish(policy, identity, version, metadata)
        try:
            held = set(session.held)
            if held:  # an interrupted publish of this identity: skip only what matches
                staged = session.stage.records()
                ours = hash_tensors(
                    {n: _in_memory(t, sizes[n]) for n, t in tensors.items() if n in held},
                    {n: kind_of(r.digest) for n, r in staged.items()},
                )
                if held - ours.keys() or any(staged[n] != r for n, r in ours.items()):
                    # Another content was staged under this identity and never committed.
                    log.warning("publish %s: dropping a stale attempt's tensors", identity)
                    session.close()
                    session = self.begin_publish(policy, identity, version, metadata, restart=True)
                    held = set()

            def one(name: str) -> None:
                t = tensors[name]
                sink = session.begin_tensor(name, t.dtype, tuple(t.shape), None)
                try:
                    if isinstance(t.data, tuple):
                        path, offset = t.data
                        pos = 0
                        for piece in read_range(Path(path), offset, sizes[name]):
                            sink.write(pos, piece)
                            pos += piece.nbytes
                    else:
                        sink.write(0, t.data)
                    sink.finish()
                except BaseException:
                    sink.abort()
                    raise

            with ThreadPoolExecutor(worker_count(None)) as pool:
                list(pool.map(one, sorted(n for n in tensors if n not in held)))
            for name, content in sorted(files.items()):
                session.add_file(name, content)
            return session.commit(len(tensors))
        finally:
            session.close()


def _checked_size(name: str, t: Tensor) -> int:
    try:
        size = tensor_nbytes(t.dtype, t.shape)
    except ValueError as exc:
        raise InvalidArgument(
            f"{name}: {exc}", reason="INVALID_TENSOR", metadata={"tensor": name}
        ) from exc
    if not isinstance(t.data, tuple) and memoryview(t.data).nbytes != size:
        raise InvalidArgument(
            f"{name}: {memoryview(t.data).nbytes} bytes, {t.dtype}{list(t.shape)} needs {size}",
            reason="INVALID_TENSOR",
            metadata={"tensor": name},
        )
    return size


def _in_memory(t: Tensor, size: int) -> Tensor:
    if not isinstance(t.data, tuple):
        return t
    path, offset = t.data
    with open(path, "rb") as f:
        f.seek(offset)
        return Tensor(t.dtype, t.shape, f.read(size))
