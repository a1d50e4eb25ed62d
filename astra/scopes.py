"""Policy scopes of TLS certificates: a credential confined to some policies acts on them alone.

Roles (astra.authz) say what kind of caller a certificate holds; a scope says for which
policies. A certificate names its policies as URI subjectAltNames
``urn:astra:policy:<policy id, percent-encoded>`` (`astra tls issue --policy`). A certificate
that names none is not confined by policy. One that names some may only make the calls that
name policies when each policy the call names is one of them:

- Dataflow: RegisterInstance (every id of `policy_ids`), FetchBatch (`policy_id`),
  AnnounceVersion (`version.policy_id`);
- WeightService: PublishVersion (`header.policy_id` of the stream's first message),
  FetchVersion (`start.policy_id` of the first message), RollbackVersion (`policy_id`).

Others are not confined by policy: reads, calls that name a batch or an instance (their ids are
Dataflow's, random, and given to the caller that owns them), and Dataflow's own calls to a RaaS.
A refused call is PERMISSION_DENIED with reason POLICY_NOT_PERMITTED. Never touches gRPC.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote

from astra.errors import PermissionDenied

POLICY_URI_PREFIX = "urn:astra:policy:"

# method -> the field path, in its (first) request message, of the policy id(s) it names
POLICY_FIELDS: dict[str, tuple[str, ...]] = {
    "/astra.dataflow.v1.DataflowService/RegisterInstance": ("policy_ids",),
    "/astra.dataflow.v1.DataflowService/FetchBatch": ("policy_id",),
    "/astra.dataflow.v1.DataflowService/AnnounceVersion": ("version", "policy_id"),
    "/astra.weights.v1.WeightService/PublishVersion": ("header", "policy_id"),
    "/astra.weights.v1.WeightService/FetchVersion": ("start", "policy_id"),
    "/astra.weights.v1.WeightService/RollbackVersion": ("policy_id",),
}


def policy_uri(policy_id: str) -> str:
    if not policy_id:
        raise ValueError("a policy scope needs a policy id")
    return POLICY_URI_PREFIX + quote(policy_id, safe="")


def policies_of_uris(uris: Iterable[str]) -> frozenset[str]:
    """The policies a certificate's URI subjectAltNames name (other URIs are ignored)."""
    n = len(POLICY_URI_PREFIX)
    return frozenset(unquote(u[n:]) for u in uris if u.startswith(POLICY_URI_PREFIX))


def named_policies(message: Any, path: tuple[str, ...]) -> list[str]:
    """The policy ids at `path` in `message`: [] where the path is not set (the handler then
    refuses the request for its own reasons)."""
    value = message
    for name in path[:-1]:
        if not value.HasField(name):
            return []
        value = getattr(value, name)
    last = getattr(value, path[-1])
    return [last] if isinstance(last, str) else list(last)


def check_scope(method: str, scope: frozenset[str], message: Any) -> None:
    """Raises PERMISSION_DENIED when `message`, the (first) request of `method`, names a
    policy outside `scope` (a certificate's policies, not empty)."""
    path = POLICY_FIELDS.get(method)
    if path is None:
        return
    outside = sorted({p for p in named_policies(message, path) if p not in scope})
    if outside:
        raise PermissionDenied(
            f"{method}: this certificate may act on policies {', '.join(sorted(scope))}, "
            f"not {', '.join(outside)}",
            reason="POLICY_NOT_PERMITTED",
            metadata={"method": method, "policies": ",".join(outside)},
        )
