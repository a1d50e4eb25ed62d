"""Corruption found in the store: cache entries dropped and rebuilt, bad versions marked.

A receiver that refuses a tensor (its Adler-32 did not match) names what the
store served it from. A cache entry (a full copy or a composed delta, built
from the stored versions) is dropped, so the next fetch rebuilds it from its
sources; a stored full version whose tensor no longer matches its record is
marked bad, durably (policies/<policy>/bad.json: identity -> the path and the
reason). A bad version is never served (FAILED_PRECONDITION VERSION_BAD,
naming its directory), and the next publish on top of it is stored as a full
version, which needs no base: the chain heals with the trainer's next step.
A part of `Store` (astra.weights.store), on the state of StoreCore; never touches gRPC.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from astra.errors import FailedPrecondition
from astra.weights.checksum import adler32_hex
from astra.weights.layout import Version
from astra.weights.records import write_json_atomic
from astra.weights.store_core import StoreCore

log = logging.getLogger(__name__)


class StoreHealth(StoreCore):
    """Bad versions and the dropping of damaged cache entries."""

    def _bad_path(self, policy: str) -> Path:
        return self.policy_dir(policy) / "bad.json"

    def bad_versions(self, policy: str) -> dict[str, str]:
        """identity -> why it is bad (its path and what is wrong), for one policy."""
        path = self._bad_path(policy)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return {}

    def mark_bad(self, policy: str, identity: str, why: str) -> None:
        bad = self.bad_versions(policy)
        if identity in bad:
            return
        bad[identity] = why
        write_json_atomic(self._bad_path(policy), bad, durable=self.config.durable)
        self.counters["versions_marked_bad"] += 1
        log.error("policy %s: version %s marked bad: %s", policy, identity, why)

    def check_not_bad(self, policy: str, identity: str) -> None:
        why = self.bad_versions(policy).get(identity)
        if why is not None:
            raise FailedPrecondition(
                f"version {identity!r} is bad: {why}; fetch a newer version",
                reason="VERSION_BAD",
                metadata={"policy": policy, "identity": identity},
            )

    def refused(self, policy: str, identity: str, served: Path, tensor: str) -> None:
        """A receiver refused `tensor` of `identity`, served from the directory `served`."""
        cache = self.policy_dir(policy) / "cache"
        if served.is_relative_to(cache):
            self.counters["cache_entries_dropped"] += 1
            log.warning(
                "policy %s: %s refused by a receiver (%s): cache entry %s dropped, rebuilt "
                "from its versions on the next fetch",
                policy,
                tensor,
                identity,
                served,
            )
            self.cache.drop(policy, served)
            return
        record = self.get(policy, identity)
        if served.name != "full" or tensor not in record.tensors:
            return  # a stored delta decodes against the receiver's base: not checked here
        with Version(served) as version:
            view = version.view(tensor)
            try:
                got = adler32_hex(view)
            finally:
                view.release()
            shard = version.entries[tensor].shard.path
        want = record.tensors[tensor].adler32
        if got != want:
            self.mark_bad(policy, identity, f"{shard}: {tensor} hashes to {got}, "
                          f"its record says {want}")  # fmt: skip
