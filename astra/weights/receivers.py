"""Receivers the store knows of, with what they hold, so garbage collection spares it.

A receiver is registered (or refreshed) each time it opens a fetch and when
it completes one; a registration lapses after its TTL. The registry is one
JSON file replaced atomically, so it survives restarts. Thread-safe; never
touches gRPC or version files.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from astra.weights.records import write_json_atomic

MAX_HELD = 64


class Receivers:
    """policy -> receiver id -> (held identities, expiry as a wall-clock time)."""

    def __init__(self, path: Path, ttl_s: float, *, durable: bool = True) -> None:
        self.path, self.ttl_s, self.durable = path, ttl_s, durable
        self._lock = threading.Lock()
        self._by_policy: dict[str, dict[str, dict]] = {}
        try:
            body = json.loads(path.read_text())
            if isinstance(body, dict):
                self._by_policy = body
        except (OSError, ValueError):
            pass

    def register(self, policy: str, receiver_id: str, held: list[str]) -> None:
        with self._lock:
            entry = {"held": sorted(set(held))[:MAX_HELD], "expires": time.time() + self.ttl_s}
            self._by_policy.setdefault(policy, {})[receiver_id] = entry
            self._expire(time.time())
            write_json_atomic(self.path, self._by_policy, durable=self.durable)

    def _expire(self, now: float) -> None:
        for policy in list(self._by_policy):
            live = {r: e for r, e in self._by_policy[policy].items() if e["expires"] > now}
            if live:
                self._by_policy[policy] = live
            else:
                del self._by_policy[policy]

    def pinned(self, policy: str) -> set[str]:
        """Identities held by live receivers of a policy."""
        now = time.time()
        with self._lock:
            entries = self._by_policy.get(policy, {}).values()
            return {h for e in entries if e["expires"] > now for h in e["held"]}

    def snapshot(self) -> dict[str, dict[str, list[str]]]:
        """policy -> receiver id -> held identities, live ones only."""
        now = time.time()
        with self._lock:
            return {
                p: {r: list(e["held"]) for r, e in rs.items() if e["expires"] > now}
                for p, rs in self._by_policy.items()
            }
