"""The broken RolloutService's LoadWeights switches, and what every switch builds on.

Part of astra.testing.broken_raas (its SWITCHES table names these too): each function breaks
one LoadWeights rule of rollout_service.proto, as its docstring says. `FetchingScripted`
fetches every version for real (each tensor verified); `wrap` replaces a unary RPC. Never
used outside tests.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from astra.clients.weights_stream import Receiver
from astra.errors import (
    FailedPrecondition,
)
from astra.raas.backend import VersionSpec
from astra.raas.scripted import ScriptedGenerator
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.servers.raas import RolloutServicer
from astra.servers.raas_convert import version_protos


class FetchingScripted(ScriptedGenerator):
    """The scripted generator, but LoadWeights really fetches each version with the streaming
    Receiver (which verifies every tensor) into a temporary directory, as Astra's engines do."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._dir = tempfile.TemporaryDirectory(prefix="broken-raas-")
        self._receivers: dict[tuple[str, str], Receiver] = {}

    async def load_weights(self, versions: dict[str, VersionSpec], weights_address: str) -> int:
        fetched = 0
        for p, spec in versions.items():
            address = spec.weights_address or weights_address
            rec = self._receivers.get((p, address))
            if rec is None:
                where = Path(self._dir.name) / f"{p}-{len(self._receivers)}"
                rec = Receiver(address, p, directory=where, durable=False, timeout_s=8.0)
                self._receivers[(p, address)] = rec
            fetched += (await rec.fetch(spec.version_id or str(spec.version))).bytes_received
        await super().load_weights(versions, weights_address)
        return fetched


def wrap(servicer: RolloutServicer, method: str, before: Callable[[Any], Any]) -> None:
    """Replaces a unary RPC: `before(request)` returns a response to send instead, or None."""
    call = getattr(servicer, method)

    async def wrapped(request, context):
        out = before(request)
        return out if out is not None else await call(request, context)

    setattr(servicer, method, wrapped)


def load_accepts_empty(servicer, server) -> None:
    """LoadWeights with no versions answers OK (rule: INVALID_ARGUMENT)."""

    def ok(request):
        if not request.versions:
            return pb.LoadWeightsResponse(loaded_versions=version_protos(servicer.versions.held))
        return None

    wrap(servicer, "LoadWeights", ok)


def load_accepts_unknown_policy(servicer, server) -> None:
    """LoadWeights for a policy it does not serve answers OK (rule: UNKNOWN_POLICY)."""

    def ok(request):
        if any(v.policy_id not in servicer.policy_ids for v in request.versions):
            return pb.LoadWeightsResponse(loaded_versions=version_protos(servicer.versions.held))
        return None

    wrap(servicer, "LoadWeights", ok)


def load_is_ignored(servicer, server) -> None:
    """LoadWeights answers OK without loading (rule: loaded_versions and GetStatus show it)."""

    async def nothing(wanted, address):
        return 0

    servicer.versions._load = nothing


def allows_regression(servicer, server) -> None:
    """Swaps to any version asked, older ones included (rule: VERSION_REGRESSION)."""
    versions = servicer.versions
    load = versions._load

    async def reset_then_load(wanted, address):
        versions.held = {p: replace(v, version=-1) for p, v in versions.held.items()}
        return await load(wanted, address)

    versions._load = reset_then_load


def reload_refused(servicer, server) -> None:
    """The versions in service, asked under a new request id, are refused (rule: idempotent)."""

    def refuse(request):
        held = servicer.loaded_versions
        if request.request_id not in servicer.versions.requests and all(
            held.get(v.policy_id) == v.version for v in request.versions
        ):
            raise FailedPrecondition("already loaded", reason="ALREADY_LOADED")

    wrap(servicer, "LoadWeights", refuse)


def loaded_by_counter_only(servicer, server) -> None:
    """A version whose counter is in service counts as loaded whatever its identity (rule:
    "already loaded" means by counter AND identity)."""

    def same_counter(request):
        held = servicer.loaded_versions
        if request.versions and all(held.get(v.policy_id) == v.version for v in request.versions):
            return pb.LoadWeightsResponse(loaded_versions=version_protos(servicer.versions.held))
        return None

    wrap(servicer, "LoadWeights", same_counter)


def forgets_request_ids(servicer, server) -> None:
    """A request id reused for other versions loads them (rule: REQUEST_ID_REUSED)."""
    wrap(servicer, "LoadWeights", lambda request: servicer.versions.requests.clear())


def skips_verification(servicer, server) -> None:
    """LoadWeights swaps to a version without fetching and verifying it (rule: an engine
    refuses weights whose bytes do not match their checksums and keeps its version)."""
    backend = servicer.backend
    servicer.backend.load_weights = lambda versions, address: ScriptedGenerator.load_weights(
        backend, versions, address
    )


def ids_past_vocab(servicer, server) -> None:
    """Generates an id past the vocabulary (rule: ids below config.json's vocab_size)."""
    generate = servicer.backend.generate

    async def past(spec, versions):
        out = await generate(spec, versions)
        for t in out:
            for s in t.sequences:
                s.token_ids[-1] = 1 << 20
        return out

    servicer.backend.generate = past


def stamps_version_zero(servicer, server) -> None:
    """Loads new versions but stamps every token with version 0 (rule: tokens carry the
    version that generated them)."""
    generate = servicer.backend.generate

    async def zero(spec, versions):
        return await generate(spec, dict.fromkeys(versions, 0))

    servicer.backend.generate = zero
