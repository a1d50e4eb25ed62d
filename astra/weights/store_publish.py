"""Publishing into the store: streamed sessions, in-memory tensors, checkpoint directories.

A session claims its (policy, identity) for its lifetime, so two streams
never write one stage; a second is told to retry (UNAVAILABLE). For a new
identity, verified tensors are staged durably and survive a disconnect or a
restart; `commit` stores the version and removes the stage. For an identity
that exists, tensors are only compared as they stream (nothing is written)
and the commit succeeds when every byte matches. Never touches gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astra.errors import AlreadyExists, InvalidArgument, Unavailable
from astra.weights.apply import worker_count
from astra.weights.checksum import adler32_hex
from astra.weights.layout import (
    INDEX_NAME,
    SHARD_SUFFIX,
    Tensor,
    check_identity,
    extra_files,
    open_full,
)
from astra.weights.publish_stage import PublishStage, TensorSink, content_mismatch
from astra.weights.records import (
    RECORD_NAME,
    TensorRecord,
    check_policy,
    dirname_for,
    sha256_bytes,
)
from astra.weights.safetensors_io import tensor_nbytes

if TYPE_CHECKING:
    from astra.weights.records import VersionRecord
    from astra.weights.store import Store

MAX_FILES = 64
MAX_FILE_BYTES = 8 << 20


def check_files(files: Mapping[str, bytes]) -> None:
    """Extra files: at most 64 of at most 8 MiB, plain names that do not collide with the layout."""
    if len(files) > MAX_FILES:
        raise InvalidArgument(f"more than {MAX_FILES} files", reason="INVALID_FILE")
    for name, content in files.items():
        bad = (
            not name
            or len(name) > 255
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


def hash_tensors(tensors: Mapping[str, Tensor]) -> dict[str, TensorRecord]:
    """Adler-32 and SHA-256 of every tensor, in parallel threads (both release the GIL)."""

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
            t.dtype, tuple(t.shape), size, adler32_hex(view), sha256_bytes(view)
        )

    with ThreadPoolExecutor(worker_count(None)) as pool:
        return dict(pool.map(one, sorted(tensors.items())))


class PublishSession:
    """One publish stream's view of the store; close it whatever happens."""

    def __init__(
        self, store: Store, policy: str, identity: str, version: int, metadata: dict[str, str]
    ) -> None:
        if version < 0:
            raise InvalidArgument("version must be >= 0", reason="INVALID_VERSION")
        self.store, self.policy, self.identity = store, policy, identity
        self.version, self.metadata = version, metadata
        self._key = (policy, identity)
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
            self.stage = PublishStage(path, header, expected=expected, durable=store.config.durable)
        except BaseException:
            self.close()
            raise

    @property
    def held(self) -> list[str]:
        """Tensors already staged by an earlier attempt; the client skips them."""
        return sorted(self.stage.held)

    def begin_tensor(self, name: str, dtype: str, shape: tuple[int, ...], adler: str) -> TensorSink:
        return self.stage.begin_tensor(name, dtype, shape, adler)

    def add_file(self, name: str, content: bytes) -> None:
        if name in self.stage.files:
            raise InvalidArgument(f"file {name!r} sent twice", reason="INVALID_FILE")
        check_files({name: content})
        self.stage.files[name] = content

    def commit(self, num_tensors: int) -> tuple[VersionRecord, bool]:
        """Stores the version (or confirms the existing one); the stage goes once stored."""
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
            )
        except AlreadyExists:
            self.stage.remove()  # refused content leaves nothing behind
            raise
        finally:
            tensors.clear()
        self.stage.remove()
        return result

    def close(self) -> None:
        with self.store._guard:
            self.store._publishing.discard(self._key)


class StorePublishing:
    """The ways into the store: a streamed session, in-memory tensors, a checkpoint directory."""

    def begin_publish(
        self: Store,
        policy: str,
        identity: str,
        version: int,
        metadata: Mapping[str, str] | None = None,
    ) -> PublishSession:
        """Opens (or resumes) a streamed publish; the caller must close the session."""
        check_policy(policy)
        check_identity(identity)
        return PublishSession(self, policy, identity, version, dict(metadata or {}))

    def publish(
        self: Store,
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
        hashes = hash_tensors(items)
        return self.commit(
            policy, identity, version, items, hashes, dict(files or {}), dict(metadata or {})
        )

    def publish_dir(
        self: Store, policy: str, identity: str, version: int, directory: str | Path
    ) -> tuple[VersionRecord, bool]:
        """Publishes a full checkpoint directory (a relay importing what it fetched)."""
        with open_full(directory) as source:
            tensors = {
                n: Tensor(e.info.dtype, e.info.shape, source.view(n))
                for n, e in source.entries.items()
            }
            files = {p.name: p.read_bytes() for p in extra_files(source)}
            try:
                hashes = hash_tensors(tensors)
                return self.commit(policy, identity, version, tensors, hashes, files, {})
            finally:
                tensors.clear()
