"""Tombstones: the content digest of every collected version, so its identity never returns
with other bytes.

One append-only log per policy (tombstones.jsonl, a line per collected version), read once
and kept in memory: a collection appends its lines (fsynced when durable) instead of
rewriting a file that grows with every version ever collected. A store written before the
log keeps its tombstones.json, which is still read. A torn last line (a crash while
appending) is skipped: its version's directory was not removed yet, since a collection
appends before it removes. Never touches gRPC.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from astra.durable import fsync_path

LOG = "tombstones.jsonl"
LEGACY = "tombstones.json"  # one JSON object, rewritten whole (stores before the log)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class Tombstones:
    """policy -> {identity: content digest} of its collected versions."""

    def __init__(self, policy_dir: Callable[[str], Path], *, durable: bool = True) -> None:
        self.policy_dir, self.durable = policy_dir, durable
        self._lock = threading.Lock()
        # policy -> (the files' stamps when read, what they hold): read again only when a
        # file changed under the store (an older release, a repair by hand).
        self._cache: dict[str, tuple[tuple, dict[str, str]]] = {}

    def _stamps(self, policy: str) -> tuple:
        pdir = self.policy_dir(policy)
        return _stamp(pdir / LEGACY), _stamp(pdir / LOG)

    def get(self, policy: str) -> Mapping[str, str]:
        with self._lock:
            stamps = self._stamps(policy)
            cached = self._cache.get(policy)
            if cached is None or cached[0] != stamps:
                cached = self._cache[policy] = (stamps, self._read(policy))
            return cached[1]

    def _read(self, policy: str) -> dict[str, str]:
        pdir = self.policy_dir(policy)
        out: dict[str, str] = {}
        try:
            body = json.loads((pdir / LEGACY).read_text())
            if isinstance(body, dict):
                out.update({str(k): str(v) for k, v in body.items()})
        except (OSError, ValueError):
            pass
        try:
            lines = (pdir / LOG).read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                entry = json.loads(line)
                out[str(entry["identity"])] = str(entry["digest"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn line: its version was still there to collect again
        return out

    def add(self, policy: str, digests: Mapping[str, str]) -> None:
        """Appends the tombstones of versions about to be removed (durable when the store is)."""
        if not digests:
            return
        path = self.policy_dir(policy) / LOG
        lines = "".join(
            json.dumps({"identity": i, "digest": d}) + "\n" for i, d in sorted(digests.items())
        )
        with self._lock:
            current = self._cache.get(policy)
            fresh = current is not None and current[0] == self._stamps(policy)
            created = not path.exists()
            with open(path, "a+b") as f:
                if f.tell() and (f.seek(f.tell() - 1), f.read(1))[1] != b"\n":
                    lines = "\n" + lines  # after a torn line: that line stays apart, skipped
                f.write(lines.encode())
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            if created and self.durable:
                fsync_path(path.parent)
            if fresh:
                assert current is not None
                current[1].update(digests)
                self._cache[policy] = (self._stamps(policy), current[1])
            else:
                self._cache.pop(policy, None)
