"""Role checks of a mutual-TLS server: the caller's certificate roles against astra.authz.

`RoleGuard.guard(method)` gives the check one call of `method` needs, or None when there is
nothing to check (a plaintext server, health and reflection). The check reads the roles from
the peer's URI subjectAltNames in gRPC's auth context (``peer_uri`` and
``x509_subject_alternative_name``), a few microseconds per call, and raises astra.authz's
PERMISSION_DENIED (reason ROLE_NOT_PERMITTED) for the ErrorInterceptor to map. A certificate
with a policy scope (astra.scopes) also gets a check of the request, or of a stream's first
message, before the handler sees it. A certificate the CA's revocation list names
(astra.tls_crl; the list is read again when its file changes) gets UNAUTHENTICATED, reason
CERTIFICATE_REVOKED, whatever its roles, as a call starts and before each later message of a
stream (one under way when the list changed ends there). Each refused (method, roles) pair
is logged once and counted (`metrics`: astra_rpc_refused_total on the service's Prometheus
port; a scope refusal under roles "policy scope", a revoked certificate's under "revoked").
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily, Metric

from astra.authz import OPEN_SERVICES, denied, permitted, roles_of_uris
from astra.errors import PermissionDenied, Unauthenticated
from astra.scopes import POLICY_FIELDS, check_scope, policies_of_uris
from astra.tls import TlsFiles
from astra.tls_crl import serial_of

log = logging.getLogger(__name__)
# (a check of the request or a stream's first message: the caller's policy scope; a check
# before each later message of a stream: its certificate not revoked since the call began)
Checks = tuple[Callable[[object], None] | None, Callable[[], None] | None]
MAX_LOGGED = 1024  # refused (method, roles) pairs logged, at most
MAX_SERIALS = 4096  # callers' certificates whose serial number is kept parsed


class RoleGuard:
    """Checks calls against the caller's roles once `enabled` (the port is mutual TLS)."""

    def __init__(self) -> None:
        self.enabled = False
        self.files: TlsFiles | None = None  # the revocation list's source, once enabled
        # refused calls by (method, roles); bounded: past MAX_LOGGED pairs, under "other"
        self.by_caller: Counter[tuple[str, str]] = Counter()
        self._logged: set[tuple[str, frozenset[str]]] = set()
        self._serials: dict[bytes, int] = {}  # a caller's PEM certificate -> its serial

    def enable(self, files: TlsFiles | None) -> None:
        """On for a mutual-TLS port (`files`: its credentials and revocation list)."""
        self.enabled, self.files = files is not None, files

    @property
    def refused(self) -> int:
        """Calls refused so far, for their roles or their policy scope."""
        return sum(self.by_caller.values())

    def guard(self, method: str) -> Callable[[grpc.aio.ServicerContext], Checks | None] | None:
        if not self.enabled or method.startswith(OPEN_SERVICES):
            return None
        scoped = method in POLICY_FIELDS

        def check(context: grpc.aio.ServicerContext) -> Checks | None:
            auth = context.auth_context()
            pem = next(iter(auth.get("x509_pem_cert", ())), b"")
            self._refuse_if_revoked(method, pem, context)
            # Both properties carry the URI SANs in gRPC's core; read both, so that a version
            # of gRPC without one of them does not make a confined certificate an operator's.
            uris = [
                u.decode(errors="replace")
                for u in (*auth.get("peer_uri", ()), *auth.get("x509_subject_alternative_name", ()))
            ]
            roles = roles_of_uris(uris)
            if permitted(method, roles):
                policies = policies_of_uris(uris) if scoped else frozenset()
                first = (
                    (lambda message: self._in_scope(method, policies, message))
                    if policies
                    else None
                )
                # Before each later message of a stream: revoked since the call began?
                each = (
                    (lambda: self._refuse_if_revoked(method, pem, context)) if self.files else None
                )
                return (first, each) if first or each else None
            key = (method, roles)
            known = key in self._logged
            if not known and len(self._logged) < MAX_LOGGED:
                self._logged.add(key)
                log.warning(
                    "refused %s to %s: its certificate's roles (%s) may not call it",
                    method,
                    context.peer(),
                    ", ".join(sorted(roles)),
                )
                known = True
            label = (method, ",".join(sorted(roles))) if known else ("other", "other")
            self.by_caller[label] += 1
            raise denied(method, roles)

        return check

    def _serial(self, pem: bytes) -> int:
        """The serial number of a caller's PEM certificate (-1: unreadable), kept parsed."""
        serial = self._serials.get(pem)
        if serial is None:
            try:
                serial = serial_of(pem)
            except ValueError:
                serial = -1  # refused where a list holds any serial (closed)
            if len(self._serials) >= MAX_SERIALS:
                self._serials.clear()
            self._serials[pem] = serial
        return serial

    def _refuse_if_revoked(
        self, method: str, pem: bytes, context: grpc.aio.ServicerContext
    ) -> None:
        """UNAUTHENTICATED when the revocation list in force (read again if its file changed)
        names the caller's certificate, or holds any serial and that one cannot be read."""
        material = self.files.refresh() if self.files is not None else None
        if material is not None and material.revoked:
            self._check_serial(method, self._serial(pem), material.revoked, context)

    def _check_serial(
        self,
        method: str,
        serial: int,
        revoked: frozenset[int],
        context: grpc.aio.ServicerContext,
    ) -> None:
        if serial not in revoked and serial >= 0:
            return
        self.by_caller[(method, "revoked")] += 1
        shown = f"{serial:x}" if serial >= 0 else "unreadable"
        if self.by_caller[(method, "revoked")] == 1:
            log.warning("refused %s to %s: its certificate (serial %s) is revoked",
                        method, context.peer(), shown)  # fmt: skip
        raise Unauthenticated(
            f"{method}: the caller's certificate (serial {shown}) is revoked by the CA's "
            "revocation list (or could not be read to tell): its holder needs a new one "
            "(astra tls issue)",
            reason="CERTIFICATE_REVOKED",
            metadata={"method": method, "serial": shown},
        )

    def _in_scope(self, method: str, policies: frozenset[str], message: object) -> None:
        try:
            check_scope(method, policies, message)
        except PermissionDenied as exc:
            self.by_caller[(method, "policy scope")] += 1
            if self.by_caller[(method, "policy scope")] == 1:
                log.warning("refused %s: %s", method, exc.message)
            raise

    def metrics(self) -> Iterator[Metric]:
        """astra_rpc_refused_total{method, roles}: calls refused for their certificate's roles."""
        family = CounterMetricFamily(
            "astra_rpc_refused",
            "Calls refused because the caller's certificate roles do not permit the method",
            labels=["method", "roles"],
        )
        for (method, roles), n in sorted(self.by_caller.items()):
            family.add_metric([method, roles], n)
        yield family
