"""Policy versions as announced by trainers, and the targets RaaS must load.

Versions of a policy increase by one per optimiser step; a repeat of the
current version is accepted as idempotent. With several policies the
barrier decides which set of versions rollout services load together:
`independent` follows each policy's latest, `lockstep` moves every policy to
version v only once all of them have announced v. Persisted by the caller.

Every load of a policy uses the WeightService address of its newest
announcement, whichever version it names: a WeightService that restarted on
another port serves every stored version, and the address an older version
was announced with may be dead. A repeated announcement with a new address
updates it (a trainer announcing again after the restart).
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
    address: str = ""  # WeightService address of the newest announcement


class VersionBook:
    def __init__(self, policy_ids: list[str], barrier: str) -> None:
        self.barrier = barrier
        self.policies: dict[str, PolicyVersions] = {p: PolicyVersions() for p in policy_ids}
        self._unconfigured: dict[str, dict] = {}  # saved state of other policies, kept as is

    def current(self, policy_id: str) -> int:
        return self.policies[policy_id].current

    def address(self, policy_id: str) -> str:
        """The WeightService address every load of the policy uses now."""
        return self.policies[policy_id].address

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
            if address:
                book.address = address
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
        if address:
            book.address = address
        # Keep only recent history: lockstep needs the versions since the slowest policy.
        floor = min(p.current for p in self.policies.values())
        for v in [v for v in book.history if v < floor]:
            del book.history[v]
        return False

    def targets(self) -> dict[str, Announced]:
        """The versions rollout services should hold now, per policy, at the newest address."""
        out: dict[str, Announced] = {}
        if self.barrier == "lockstep":
            v = min(p.current for p in self.policies.values())
            for pid, book in self.policies.items():
                if v in book.history:
                    out[pid] = self._at_newest(book, book.history[v])
            if len(out) != len(self.policies):
                return {}
            return out
        for pid, book in self.policies.items():
            if book.current in book.history:
                out[pid] = self._at_newest(book, book.history[book.current])
        return out

    @staticmethod
    def _at_newest(book: PolicyVersions, a: Announced) -> Announced:
        if not book.address or book.address == a.weights_address:
            return a
        return Announced(a.version, a.version_id, book.address)

    def state(self) -> dict:
        return self._unconfigured | {
            pid: {
                "current": b.current,
                "history": {
                    str(v): [a.version_id, a.weights_address] for v, a in b.history.items()
                },
                "address": b.address,
            }
            for pid, b in self.policies.items()
        }

    def restore(self, state: dict) -> None:
        for pid, raw in (state or {}).items():
            if pid not in self.policies:  # kept for a configuration that has it again
                self._unconfigured[pid] = raw
                continue
            book = self.policies[pid]
            book.current = int(raw["current"])
            book.history = {
                int(v): Announced(int(v), vid, addr) for v, (vid, addr) in raw["history"].items()
            }
            # State saved before the newest address was kept: the newest version's address.
            newest = book.history[max(book.history)].weights_address if book.history else ""
            book.address = raw.get("address") or newest
