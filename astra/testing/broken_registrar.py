"""Registration rules switched off, for `astra raas check --as-dataflow`'s tests.

Each switch breaks one rule of dataflow_service.proto that a RaaS keeps towards Dataflow
(RegisterInstance, HeartbeatInstance) in Astra's own Registrar
(astra.clients.registrar); astra.testing.broken_raas lists them among its SWITCHES, with
the registration check that must fail for each (REGISTRATION_CATCHES). A switch marks the
servicer; `start_registering` applies it to the Registrar it starts.
Never used outside tests.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from astra.clients.registrar import Registrar
from astra.common.v1 import version_pb2

RegistrarSwitch = Callable[[Registrar], None]


def _set(registrar: Registrar, name: str, value: Any) -> None:
    """Replaces one of the Registrar's methods or its client (what a switch breaks)."""
    setattr(registrar, name, value)


def _mark(fn: RegistrarSwitch) -> Callable[[Any, Any], None]:
    def switch(servicer: Any, server: Any) -> None:
        servicer.registrar_switch = fn

    switch.__doc__, switch.__name__ = fn.__doc__, fn.__name__
    return switch


def _unheld(request: Any) -> None:
    for v in request.loaded_versions:
        v.version, v.version_id = v.version + 1, f"v{v.version + 1}-not-held"
    if not request.loaded_versions:
        request.loaded_versions.append(version_pb2.PolicyVersion(version=7, version_id="v7"))


def claims_unheld_version(registrar: Registrar) -> None:
    """Registers and heartbeats claiming a version it does not hold (rule: only what it
    holds, by counter AND identity)."""
    register, beat = registrar._register_request, registrar._heartbeat_request

    def lie(build: Callable[[], Any]) -> Callable[[], Any]:
        def built() -> Any:
            out = build()
            _unheld(out)
            return out

        return built

    _set(registrar, "_register_request", lie(register))
    _set(registrar, "_heartbeat_request", lie(beat))


def registers_other_capacity(registrar: Registrar) -> None:
    """Registers a capacity its GetStatus does not report (rule: what the instance runs)."""
    build = registrar._register_request

    def built() -> Any:
        out = build()
        out.capacity += 3
        return out

    _set(registrar, "_register_request", built)


def claims_stale_versions(registrar: Registrar) -> None:
    """Heartbeats keep claiming what it held when it registered (rule: the versions held now)."""
    build = registrar._heartbeat_request
    first: list[Any] = []

    def built() -> Any:
        out = build()
        if not first:
            first.append(copy.deepcopy(list(out.loaded_versions)))
        del out.loaded_versions[:]
        out.loaded_versions.extend(first[0])
        return out

    _set(registrar, "_heartbeat_request", built)


class _Swallowing:
    """A DataflowClient whose heartbeat answers every failure with an empty OK."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def heartbeat_instance(self, request: Any) -> Any:
        from astra.dataflow.v1 import dataflow_service_pb2 as df_pb

        try:
            return await self.inner.heartbeat_instance(request)
        except Exception:
            return df_pb.HeartbeatInstanceResponse()


def ignores_not_found(registrar: Registrar) -> None:
    """Goes on heartbeating after NOT_FOUND (rule: register again)."""
    _set(registrar, "client", _Swallowing(registrar.client))


def new_incarnation_on_reregister(registrar: Registrar) -> None:
    """Registers again under a new incarnation from the same process (rule: a new incarnation
    means a new process, whose predecessor's groups died)."""
    build = registrar._register_request
    count = [0]

    def built() -> Any:
        out = build()
        count[0] += 1
        out.incarnation = f"{out.incarnation}-{count[0]}"
        return out

    _set(registrar, "_register_request", built)


def no_heartbeats(registrar: Registrar) -> None:
    """Registers, then never heartbeats (rule: every heartbeat_interval)."""
    forever = asyncio.Event()

    class Silent(_Swallowing):
        async def heartbeat_instance(self, request: Any) -> Any:
            await forever.wait()

    _set(registrar, "client", Silent(registrar.client))


REGISTRAR_SWITCHES = (
    claims_unheld_version,
    registers_other_capacity,
    claims_stale_versions,
    ignores_not_found,
    new_incarnation_on_reregister,
    no_heartbeats,
)
REGISTRATION_SWITCHES = {fn.__name__: _mark(fn) for fn in REGISTRAR_SWITCHES}
REGISTRATION_CATCHES = {
    "claims_unheld_version": "registration_matches_status",
    "registers_other_capacity": "registration_matches_status",
    "claims_stale_versions": "claims_loaded_version",
    "ignores_not_found": "reregisters_on_not_found",
    "new_incarnation_on_reregister": "reregisters_on_not_found",
    "no_heartbeats": "heartbeats",
}


def start_registering(servicer: Any, server: Any, dataflow: str) -> Registrar:
    """Registers the instance served by `server` with the Dataflow at `dataflow`, through a
    Registrar broken by the servicer's registration switch, if any; stop it before the server."""
    registrar = Registrar(dataflow, servicer, server.address)
    getattr(servicer, "registrar_switch", lambda registrar: None)(registrar)
    registrar.start()
    return registrar
