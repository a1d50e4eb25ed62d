"""Policy versions as announced by trainers, and the targets RaaS must load.

Versions of a policy increase by one per optimiser step; a repeat of the
current version is accepted as idempotent. With several policies the
barrier decides which set of versions rollout services load together:
`independent` follows each policy's latest, `lockstep` moves every policy to
version v only once all of them have announced v. Persisted by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from astra.errors import FailedPrecondition, InvalidArgument, NotFound


@dataclass(slots=True)
class Announced:
    version: int
    version_id: str
    weights_address: str


@dataclass(slots=True)
class PolicyVersions:
    current: int = 0
    history: dict[int, Announced] = field(default_factory=dict)


class VersionBook:
    def __init__(self, policy_ids: list[str], barrier: str) -> None:
        self.barrier = barrier
        self.policies: dict[str, PolicyVersions] = {p: PolicyVersions() for p in policy_ids}

    def current(self, policy_id: str) -> int:
        return self.policies[policy_id].current

    def announce(self, policy_id: str, version: int, version_id: str, address: str) -> bool:
        """Records an announcement; returns True if it was a repeat."""
        book = self.policies.get(policy_id)
        if book is None:
            raise NotFound(
                f"version.policy_id: unknown policy {policy_id!r}",
                reason="POLICY_NOT_FOUND",
                metadata={"policy_id": policy_id},
            )
        if version < 0:
            raise InvalidArgument(
                "version.version: must be >= 0",
                reason="INVALID_FIELD",
                field_violations=[("version.version", "must be >= 0")],
            )
        known = book.history.get(version)
        if known is not None and version == book.current:
            return True
        if version not in (book.current, book.current + 1):
            raise FailedPrecondition(
                f"version {version} of {policy_id!r} is not the next one "
                f"(current is {book.current})",
                reason="VERSION_NOT_NEXT",
                metadata={"policy_id": policy_id, "current_version": str(book.current)},
            )
        book.current = version
        book.history[version] = Announced(version, version_id or str(version), address)
        # Keep only recent history: lockstep needs the versions since the slowest policy.
        floor = min(p.current for p in self.policies.values())
        for v in [v for v in book.history if v < floor]:
            del book.history[v]
        return False

    def targets(self) -> dict[str, Announced]:
        """The versions rollout services should hold now, per policy."""
        out: dict[str, Announced] = {}
        if self.barrier == "lockstep":
            v = min(p.current for p in self.policies.values())
            for pid, book in self.policies.items():
                if v in book.history:
                    out[pid] = book.history[v]
            if len(out) != len(self.policies):
                return {}
            return out
        for pid, book in self.policies.items():
            if book.current in book.history:
                out[pid] = book.history[book.current]
        return out

    def state(self) -> dict:
        return {
            pid: {
                "current": b.current,
                "history": {
                    str(v): [a.version_id, a.weights_address] for v, a in b.history.items()
                },
            }
            for pid, b in self.policies.items()
        }

    def restore(self, state: dict) -> None:
        for pid, raw in (state or {}).items():
            if pid not in self.policies:
                continue
            book = self.policies[pid]
            book.current = int(raw["current"])
            book.history = {
                int(v): Announced(int(v), vid, addr) for v, (vid, addr) in raw["history"].items()
            }
