"""Recovery, rollback, receivers and garbage collection of the version store.

Opening a store rebuilds each policy from its version directories: leftover
staging and work directories go, stages of committed identities go, and the
current pointer is rolled forward to the newest committed version.

Rollback publishes an earlier version's content again as a new identity with
a new step counter, so the chain stays one line and receivers move forward
with deltas. Collection removes versions older than the full root of the
oldest version that must stay (the newest few, anything a live receiver
holds, anything a running stream uses); a collected identity leaves a
tombstone with its content digest, so it can never return with other bytes.
A part of `Store` (astra.weights.store), on the state of StoreCore; never touches gRPC.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping

from astra.errors import AlreadyExists
from astra.weights.chain import Chain
from astra.weights.layout import Tensor, Version, check_identity
from astra.weights.records import VersionRecord, write_json_atomic
from astra.weights.store_core import StoreCore

log = logging.getLogger(__name__)


class StoreLifecycle(StoreCore):
    """Recovery, rollback, receiver registration, stream pins and collection."""

    def _recover(self, policy: str) -> None:
        pdir = self.policy_dir(policy)
        for junk in [*pdir.glob("versions/.*.staging-*"), pdir / "trash"]:
            shutil.rmtree(junk, ignore_errors=True)
        self.cache.clean(policy)
        records = [
            VersionRecord.load(d)
            for d in sorted((pdir / "versions").glob("*"))
            if not d.name.startswith(".") and (d / "record.json").is_file()
        ]
        chain = self._chains[policy] = Chain(records)
        for stage in pdir.glob("staging/*"):
            try:
                identity = json.loads((stage / "header.json").read_text())["identity"]
            except (OSError, ValueError, KeyError):
                identity = None
            if identity is None or chain.get(identity) is not None:
                shutil.rmtree(stage, ignore_errors=True)
        if chain.head is not None and self._pointer(policy) != chain.head.identity:
            log.warning("policy %s: current pointer repaired to %s", policy, chain.head.identity)
            self._set_current(policy, chain.head)

    def _pointer(self, policy: str) -> str | None:
        try:
            return json.loads((self.policy_dir(policy) / "current.json").read_text())["identity"]
        except (OSError, ValueError, KeyError):
            return None

    def _set_current(self, policy: str, record: VersionRecord) -> None:
        body = {"identity": record.identity, "version": record.version}
        write_json_atomic(
            self.policy_dir(policy) / "current.json", body, durable=self.config.durable
        )

    def _tombstones(self, policy: str) -> Mapping[str, str]:
        return self.tombstones.get(policy)

    def rollback(
        self,
        policy: str,
        source: str,
        new_identity: str,
        new_version: int,
        request_id: str = "",
    ) -> VersionRecord:
        """Publishes an earlier version's content again as a new identity (the new current).

        Under the policy's lock from the request_id check to the commit: two rollbacks with one
        request_id cannot both commit, and no collection can take the source meanwhile."""
        check_identity(new_identity)
        with self._lock(policy):
            return self._rollback(policy, source, new_identity, new_version, request_id)

    def _rollback(
        self, policy: str, source: str, new_identity: str, new_version: int, request_id: str
    ) -> VersionRecord:
        chain = self.chain(policy)
        for rec in chain.records:
            if request_id and rec.request_id == request_id:
                if (rec.rollback_of, rec.identity, rec.version) != (
                    source,
                    new_identity,
                    new_version,
                ):
                    raise AlreadyExists(
                        f"request_id {request_id!r} was used for another rollback",
                        reason="REQUEST_ID_REUSED",
                        metadata={"request_id": request_id},
                    )
                return rec
        src = self.get(policy, source)
        existing = chain.get(new_identity)
        if existing is not None and (existing.rollback_of, existing.version) == (
            source,
            new_version,
        ):
            return existing
        with Version(self.cache.full_dir(policy, src)) as full:
            tensors = {
                n: Tensor(e.info.dtype, e.info.shape, full.view(n)) for n, e in full.entries.items()
            }
            try:
                record, _ = self.commit(
                    policy, new_identity, new_version, tensors, src.tensors,
                    self.read_files(policy, src), dict(src.metadata),
                    rollback_of=source, request_id=request_id,
                )  # fmt: skip
            finally:
                tensors.clear()
        self.counters["rollbacks"] += 1
        return record

    def register_receiver(self, policy: str, receiver_id: str, held: list[str]) -> None:
        self.receivers.register(policy, receiver_id, held)

    def pin(self, policy: str, identities: set[str], delta: int) -> None:
        """Counts a stream's use of versions, so collection spares them while it runs."""
        with self._guard:
            pins = self._inflight.setdefault(policy, collections.Counter())
            for identity in identities:
                pins[identity] += delta
            self._inflight[policy] = +pins

    def _inflight_ids(self, policy: str) -> set[str]:
        with self._guard:
            return set(self._inflight.get(policy, ()))

    def gc(self, policy: str) -> list[str]:
        """Collects versions no retention rule needs; returns their identities."""
        with self._lock(policy):
            chain = self.chain(policy)
            pinned = self.receivers.pinned(policy) | self._inflight_ids(policy)
            doomed = chain.collectable(self.config.keep_versions, pinned)
            if not doomed:
                return []
            pdir = self.policy_dir(policy)
            self.tombstones.add(policy, {r.identity: r.content_digest() for r in doomed})
            trash = pdir / "trash"
            trash.mkdir(exist_ok=True)
            for rec in doomed:
                os.rename(self.version_dir(policy, rec.identity), trash / uuid.uuid4().hex)
            ids = {r.identity for r in doomed}
            chain.remove(ids)
            self.cache.forget(policy, ids)
            shutil.rmtree(trash, ignore_errors=True)
            self.counters["versions_collected"] += len(doomed)
            log.info("%s: collected %d versions", policy, len(doomed))
            return sorted(ids)
