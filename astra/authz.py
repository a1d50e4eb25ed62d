"""Which RPCs a caller may make, by the roles its TLS certificate names.

Under mutual TLS every client has a certificate of the run's CA. A certificate may name
roles, as URI subjectAltNames ``urn:astra:role:<role>`` (`astra tls issue --role`): a RaaS
certificate then lets its holder register with Dataflow and fetch weights, but not publish
weights or take training batches. What each role may call is `PERMITTED`, one entry per RPC
of the four services (a test holds it to the protos):

- ``raas``: Dataflow's Register/Heartbeat/DeregisterInstance; WeightService's FetchVersion.
- ``dataflow``: a RaaS's SubmitGroups, CollectResults, AckResults, CollectResultBatch,
  CancelGroups, LoadWeights.
- ``trainer``: Dataflow's FetchBatch, AckBatch, ExtendBatchLease, AnnounceVersion;
  WeightService's PublishVersion, RollbackVersion and FetchVersion.
- ``weights``: WeightService's FetchVersion (a relay fetching what it serves on).
- ``admin``: everything, as does a certificate that names no role at all (an operator's,
  and every certificate made before roles existed).

Reads (GetStatus, GetCapabilities, ListVersions, GetVersion), health checking and reflection
are open to every certificate of the CA. A method this table does not know is refused to
every role but ``admin`` (fail closed). Plaintext servers check nothing: without TLS there is
no identity to check. Which policies a certificate may act on is astra.scopes. Never touches
gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable

from astra.errors import PermissionDenied

ROLE_URI_PREFIX = "urn:astra:role:"
ROLES = ("admin", "dataflow", "raas", "trainer", "weights")
ADMIN = "admin"
ANYONE = "*"  # any certificate of the CA, whatever roles it names

_DF = "/astra.dataflow.v1.DataflowService/"
_RAAS = "/astra.raas.v1.RolloutService/"
_TRAINER = "/astra.trainer.v1.TrainerService/"
_WEIGHTS = "/astra.weights.v1.WeightService/"


def _entries(prefix: str, methods: dict[str, tuple[str, ...]]) -> dict[str, frozenset[str]]:
    return {prefix + m: frozenset(roles) for m, roles in methods.items()}


# Roles that may call each RPC, besides admin (and role-less certificates).
PERMITTED: dict[str, frozenset[str]] = {
    **_entries(
        _DF,
        {
            "RegisterInstance": ("raas",),
            "HeartbeatInstance": ("raas",),
            "DeregisterInstance": ("raas",),
            "FetchBatch": ("trainer",),
            "AckBatch": ("trainer",),
            "ExtendBatchLease": ("trainer",),
            "AnnounceVersion": ("trainer",),
            "GetStatus": (ANYONE,),
            "GetCapabilities": (ANYONE,),
        },
    ),
    **_entries(
        _RAAS,
        {
            "SubmitGroups": ("dataflow",),
            "CollectResults": ("dataflow",),
            "AckResults": ("dataflow",),
            "CollectResultBatch": ("dataflow",),
            "CancelGroups": ("dataflow",),
            "LoadWeights": ("dataflow",),
            "GetStatus": (ANYONE,),
            "GetCapabilities": (ANYONE,),
        },
    ),
    **_entries(
        _TRAINER,
        {
            "GetStatus": (ANYONE,),
            "GetCapabilities": (ANYONE,),
            "SaveCheckpoint": (),  # an operator's (the supervisor's) alone
            "Pause": (),
            "Resume": (),
        },
    ),
    **_entries(
        _WEIGHTS,
        {
            "PublishVersion": ("trainer",),
            "RollbackVersion": ("trainer",),
            "FetchVersion": ("raas", "weights", "trainer"),
            "ListVersions": (ANYONE,),
            "GetVersion": (ANYONE,),
            "GetStatus": (ANYONE,),
            "GetCapabilities": (ANYONE,),
        },
    ),
}
# Services open to every certificate of the CA: grpcurl and health probes work with any.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class RoleError(ValueError):
    """A role name that is not one of `ROLES`."""


def check_roles(roles: Iterable[str]) -> tuple[str, ...]:
    """`roles` without repeats, each one of `ROLES`; RoleError otherwise."""
    out: list[str] = []
    for role in roles:
        if role not in ROLES:
            raise RoleError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
        if role not in out:
            out.append(role)
    return tuple(out)


def roles_of_uris(uris: Iterable[str]) -> frozenset[str]:
    """The roles a certificate's URI subjectAltNames name (other URIs are ignored)."""
    return frozenset(u[len(ROLE_URI_PREFIX) :] for u in uris if u.startswith(ROLE_URI_PREFIX))


def permitted(method: str, roles: frozenset[str]) -> bool:
    """Whether a caller whose certificate names `roles` may call `method` (/pkg.Svc/Name)."""
    if not roles or ADMIN in roles or method.startswith(OPEN_SERVICES):
        return True
    allowed = PERMITTED.get(method)
    if allowed is None:
        return False
    return ANYONE in allowed or not roles.isdisjoint(allowed)


def denied(method: str, roles: frozenset[str]) -> PermissionDenied:
    """The error of a call `permitted` refuses: names the method, the caller's roles and
    the roles that may call it."""
    allowed = sorted(PERMITTED.get(method, ()))
    may = ", ".join([*allowed, ADMIN]) if method in PERMITTED else ADMIN
    return PermissionDenied(
        f"{method}: a certificate with role {', '.join(sorted(roles))} may not call it "
        f"(roles that may: {may})",
        reason="ROLE_NOT_PERMITTED",
        metadata={"method": method, "roles": ",".join(sorted(roles)), "permitted": may},
    )
