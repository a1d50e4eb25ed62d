"""Encoded forms the store builds once and serves to every receiver: full copies and composed deltas.

A delta version's full copy (for receivers that hold nothing usable, and as
the base of the next publish) is rebuilt from its full root with one
composed delta; a run of deltas between a held version and a target is
composed into one delta. Each is built at most once, under a per-key lock,
into a hidden work directory renamed into place, and then read (mmap) by any
number of concurrent streams. Deleting an entry never disturbs a stream
that already opened it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from astra.durable import fsync_path
from astra.errors import DataLoss, FailedPrecondition
from astra.weights.checkpoint import apply_delta, write_full
from astra.weights.compose import compose_deltas
from astra.weights.layout import Tensor, Version, extra_files
from astra.weights.records import VersionRecord, dirname_for
from astra.weights.tensor_files import assemble, link_or_copy

MAX_COMPOSED = 32


def _key(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def put_files(
    directory: Path,
    files: Mapping[str, bytes],
    *,
    durable: bool,
    same: Mapping[str, Path] | None = None,
) -> None:
    """Writes the extra files of a version into a directory that is not visible yet.

    `same`: stored files (durable already) that should hold the content of some of them,
    linked in instead of written and synced again when their bytes compare equal (a rotten
    one is not carried on): a tokenizer of several MiB that every version carries unchanged
    costs a read from the page cache and a link, not a write and an fsync, per version.
    """
    same = same or {}
    for name, content in files.items():
        path = directory / name
        if name in same:
            with contextlib.suppress(OSError):
                if same[name].read_bytes() == content:
                    link_or_copy(same[name], path)
                    continue
        path.write_bytes(content)
        if durable:
            fsync_path(path)


class VersionCache:
    """Per-policy cache directory: full/<identity>/ and compose/<base>-<target>/."""

    def __init__(self, store: object) -> None:
        self.store = store
        # key -> [its lock, holders and waiters]: an entry lives while someone uses it, so
        # the table does not grow with every version ever cached (tools/bench/soak.py).
        self._locks: dict[str, list[Any]] = {}
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        """Holds the lock of `key` (one builder of a cache entry at a time)."""
        with self._guard:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._guard:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._locks[key]

    def _root(self, policy: str) -> Path:
        return self.store.policy_dir(policy) / "cache"

    def _work(self, policy: str) -> Path:
        work = self._root(policy) / "tmp" / uuid.uuid4().hex[:12]
        work.mkdir(parents=True)
        return work

    def drop(self, policy: str, path: Path) -> None:
        """Drops a damaged entry: the next use builds it again from the stored versions."""
        with self._lock(str(path)):
            self._drop(policy, path)

    def _drop(self, policy: str, path: Path) -> None:
        """Removes an entry by renaming it out of sight first: a kill mid-delete leaves no torn entry."""
        trash = self._root(policy) / "tmp" / f"drop-{uuid.uuid4().hex[:12]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def _publish(self, work_out: Path, final: Path) -> Path:
        final.parent.mkdir(parents=True, exist_ok=True)
        if self.store.config.durable:
            fsync_path(work_out)
        os.rename(work_out, final)
        return final

    def full_dir(self, policy: str, record: VersionRecord) -> Path:
        """A full checkpoint of the version: stored, cached, or rebuilt from its root now."""
        store = self.store
        if record.kind == "full":
            return store.version_dir(policy, record.identity) / "full"
        path = self._root(policy) / "full" / dirname_for(record.identity)
        with self._lock(str(path)):
            if path.is_dir():
                return path
            chain = store.chain(policy)
            i = chain.index(record.identity)
            root = chain.root_index(i)
            if root is None:
                raise FailedPrecondition(
                    f"version {record.identity!r} has no full root left to rebuild it from",
                    reason="NO_FULL_ROOT",
                    metadata={"identity": record.identity},
                )
            root_rec = chain.records[root]
            work = self._work(policy)
            try:
                try:
                    delta = self._steps_delta(
                        policy, record, root_rec.identity, chain.steps(root, i), work
                    )
                    out = self._rebuild(policy, record, root_rec, delta, work)
                except DataLoss as exc:
                    # Named by the stored versions it was rebuilt from, not the work directory.
                    sources = [store.version_dir(policy, root_rec.identity) / "full"]
                    sources += [
                        store.version_dir(policy, s) / "delta" for s in chain.steps(root, i)
                    ]
                    tensor = exc.metadata.get("tensor", "")
                    raise DataLoss(
                        f"version {record.identity!r} cannot be rebuilt: "
                        f"{tensor or 'a tensor'} does not match its record after applying "
                        f"{', '.join(map(str, sources))} ({exc.reason})",
                        reason="VERSION_SOURCES_BAD",
                        metadata={"identity": record.identity, "tensor": tensor},
                    ) from exc
                return self._publish(out, path)
            finally:
                shutil.rmtree(work, ignore_errors=True)

    def _rebuild(
        self, policy: str, record: VersionRecord, root_rec: VersionRecord, delta: Path, work: Path
    ) -> Path:
        """The full copy of `record` in `work`/out: its root's full copy with `delta` applied."""
        store = self.store
        out = work / "out"
        durable = store.config.durable
        apply_delta(
            store.version_dir(policy, root_rec.identity) / "full", delta, out, durable=durable
        )
        with_files = store.read_files(policy, record)
        for stale in extra_files_of(out):
            if stale.name not in with_files:
                stale.unlink()
        put_files(out, with_files, durable=durable)
        return out

    def _steps_delta(
        self,
        policy: str,
        target: VersionRecord,
        base: str,
        steps: tuple[str, ...],
        work: Path,
        durable: bool = False,
    ) -> Path:
        store = self.store
        if len(steps) == 1 and steps[0] == target.identity and target.base == base:
            return store.version_dir(policy, target.identity) / "delta"
        out = work / "delta"
        compose_deltas(
            [store.version_dir(policy, s) / "delta" for s in steps],
            {n: t.size_bytes for n, t in target.tensors.items()},
            {n: t.adler32 for n, t in target.tensors.items()},
            out,
            target.identity,
            base,
            level=store.config.zstd_level,
            durable=durable,
        )
        return out

    def delta_dir(
        self, policy: str, target: VersionRecord, base: str, steps: tuple[str, ...]
    ) -> Path:
        """The one delta taking `base` to `target`: stored for one forward step, else composed once."""
        store = self.store
        if len(steps) == 1 and steps[0] == target.identity and target.base == base:
            return store.version_dir(policy, target.identity) / "delta"
        path = self._root(policy) / "compose" / f"{_key(base)}-{_key(target.identity)}"
        with self._lock(str(path)):
            if path.is_dir():
                os.utime(path)
                return path
            work = self._work(policy)
            try:
                built = self._steps_delta(policy, target, base, steps, work, store.config.durable)
                store.counters["composed_deltas"] += 1
                final = self._publish(built, path)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        self._prune_composed(policy)
        return final

    def _prune_composed(self, policy: str) -> None:
        root = self._root(policy) / "compose"
        entries = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime)
        for old in entries[:-MAX_COMPOSED]:
            self._drop(policy, old)

    def put_full(
        self,
        policy: str,
        record: VersionRecord,
        tensors: Mapping[str, Tensor],
        files: Mapping[str, bytes],
        shards: Mapping[str, Path] | None = None,
    ) -> None:
        """Caches the full copy of a just-published delta version from its raw tensors.

        With `shards` (the publish stage's verified single-tensor shards) the
        copy is linked from them: no byte is written or hashed again.
        """
        path = self._root(policy) / "full" / dirname_for(record.identity)
        work = self._work(policy)
        try:
            durable = self.store.config.durable
            if shards is not None and shards.keys() == record.tensors.keys():
                sizes = {n: t.size_bytes for n, t in record.tensors.items()}
                assemble(work / "out", shards, sizes, version=record.identity, durable=durable)
            else:
                write_full(work / "out", tensors, version=record.identity, durable=durable)
            stored = self.store.version_dir(policy, record.identity) / record.primary
            same = {name: stored / name for name in files}  # committed before this copy
            put_files(work / "out", files, durable=durable, same=same)
            with self._lock(str(path)):
                if not path.is_dir():
                    self._publish(work / "out", path)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def keep_full(self, policy: str, identities: set[str]) -> None:
        """Drops cached full copies of every version but these."""
        keep = {dirname_for(i) for i in identities}
        root = self._root(policy) / "full"
        for entry in root.iterdir() if root.is_dir() else ():
            if entry.name not in keep:
                self._drop(policy, entry)

    def forget(self, policy: str, identities: set[str]) -> None:
        """Drops every cached form that involves a collected version."""
        keys = {_key(i) for i in identities}
        names = {dirname_for(i) for i in identities}
        root = self._root(policy)
        for entry in (root / "full").iterdir() if (root / "full").is_dir() else ():
            if entry.name in names:
                self._drop(policy, entry)
        for entry in (root / "compose").iterdir() if (root / "compose").is_dir() else ():
            if set(entry.name.split("-")) & keys:
                self._drop(policy, entry)

    def clean(self, policy: str) -> None:
        """Removes half-built work left by a crash."""
        shutil.rmtree(self._root(policy) / "tmp", ignore_errors=True)


def extra_files_of(directory: Path) -> list[Path]:
    with Version(directory) as version:
        return extra_files(version)
