"""What one fetch streams: the plan's encoded directory, opened once, plus the target's files.

`open_source` decides the plan on the chain, registers the receiver with what
it holds, pins the versions the plan uses (collection spares them while the
stream runs), and opens the encoded directory the plan reads: the stored
delta, a composed delta or a full copy, each built at most once and shared by
every stream. Tensor headers always carry the target's own dtype, shape and
Adler-32. Never touches gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from astra.errors import DataLoss
from astra.weights.chain import Plan
from astra.weights.layout import Version
from astra.weights.records import TensorRecord, VersionRecord
from astra.weights.safetensors_io import FormatError

if TYPE_CHECKING:
    from astra.weights.store import Store

RAW, XOR_ZSTD = "raw", "xor_zstd"


@dataclass(frozen=True)
class WireTensor:
    """One tensor as a stream sends it."""

    name: str
    record: TensorRecord  # the target's dtype, shape, size and Adler-32
    encoding: str
    encoded_size: int


@dataclass
class FetchSource:
    """An open plan; `close` releases the mapping and the pins."""

    plan: Plan
    target: VersionRecord
    encoding: str
    version: Version | None
    files: dict[str, bytes]  # sent with their content
    _release: object = field(default=None, repr=False)
    # Sent by name and SHA-256 only: equal to the plan's base's (a receiver that takes them).
    same_files: dict[str, str] = field(default_factory=dict)

    def tensors(self) -> list[WireTensor]:
        if self.version is None:
            return []
        return [
            WireTensor(name, self.target.tensors[name], self.encoding, e.info.nbytes)
            for name, e in sorted(self.version.entries.items())
        ]

    def chunks(self, name: str, chunk_bytes: int, start: int = 0) -> Iterator[memoryview]:
        """Zero-copy slices of one tensor's encoded bytes."""
        assert self.version is not None
        view = self.version.view(name)
        try:
            for pos in range(start, view.nbytes, chunk_bytes):
                yield view[pos : pos + chunk_bytes]
        finally:
            view.release()

    def close(self) -> None:
        if self.version is not None:
            self.version.close()
            self.version = None
        if callable(self._release):
            self._release()
            self._release = None


def open_source(
    store: Store,
    policy: str,
    target_id: str,
    held: Iterable[str],
    receiver_id: str = "",
    *,
    same_as_base: bool = False,
) -> FetchSource:
    """Plans and opens a fetch of `target_id` (empty: the current version).

    same_as_base: the receiver takes a file equal to the delta plan's base's by name and
    SHA-256 (FetchStart.accepts_same_as_base_files); only the others are read and sent."""
    held = [h for h in held if h]
    target = store.get(policy, target_id) if target_id else store.current(policy)
    store.check_not_bad(policy, target.identity)
    if receiver_id:
        store.register_receiver(policy, receiver_id, held)
    plan = store.chain(policy).plan(target.identity, held, store.config.max_chain)
    pins = {target.identity, plan.base, *plan.steps} - {""}
    store.pin(policy, pins, +1)
    try:
        version, encoding = None, ""
        if plan.kind == "delta":
            path = store.cache.delta_dir(policy, target, plan.base, plan.steps)
            version, encoding = Version(path), XOR_ZSTD
            store.counters["fetch_plans_delta"] += 1
        elif plan.kind == "full":
            version, encoding = Version(store.cache.full_dir(policy, target)), RAW
            store.counters["fetch_plans_full"] += 1
        unknown = sorted(set(version.entries) - set(target.tensors)) if version else []
        if unknown and version is not None:  # unknown is empty without a version
            version.close()
            raise FormatError("encoded tensor is not in the target", tensor=unknown[0])
        same: dict[str, str] = {}
        if same_as_base and plan.kind == "delta" and plan.base:
            base_files = store.get(policy, plan.base).files
            same = {n: h for n, h in target.files.items() if base_files.get(n) == h}
        files = store.read_files(policy, target, skip=same.keys())
    except DataLoss as exc:
        store.pin(policy, pins, -1)
        if exc.reason == "VERSION_SOURCES_BAD":  # its stored forms: no rebuild can succeed
            store.mark_bad(policy, target.identity, exc.message)
        raise
    except BaseException:
        store.pin(policy, pins, -1)
        raise
    release = lambda: store.pin(policy, pins, -1)  # noqa: E731
    return FetchSource(plan, target, encoding, version, files, release, same)


def stored_tensors(store: Store, policy: str, identity: str) -> list[WireTensor]:
    """The tensors a version stores in its primary form (changed ones only for a delta)."""
    record = store.get(policy, identity)
    with Version(store.version_dir(policy, identity) / record.primary) as version:
        encoding = RAW if record.kind == "full" else XOR_ZSTD
        return [
            WireTensor(name, record.tensors[name], encoding, e.info.nbytes)
            for name, e in sorted(version.entries.items())
        ]
