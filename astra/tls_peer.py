"""A client's check of its server's certificate against the revocation list.

gRPC Python verifies that a server's certificate chains to the run's CA and names the host,
but it neither reads a revocation list nor shows the client the certificate it was given. So
a client whose list names any serial opens a TLS handshake of its own to the same address
(its own certificate, ALPN h2, the CA of `ca.pem`), reads the certificate the server shows and
looks up its serial: listed, the client's calls there fail before they are sent
(`RevokedPeer`). The verdict holds for RECHECK_S (a listed one for RETRY_S, so a server that
was given a new certificate is taken again); a handshake that fails says nothing, the call
goes on (gRPC's own handshake decides) and the next call asks again, RETRY_S later at the
earliest.

What this does not cover: the probe and gRPC's connection are two connections, so a party
that tells them apart (answers the probe with the real server and the call with a stolen
key) passes. It catches a server that keeps serving with a certificate since revoked, and a
stolen key used where the probe reaches it. No grpc in here: astra.clients.channel calls it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
import time
from dataclasses import dataclass

from cryptography import x509

from astra.tls_material import TlsMaterial
from astra.waits import within

log = logging.getLogger(__name__)

RECHECK_S = 300.0  # a server found not listed is looked at again after this long
RETRY_S = 5.0  # after a probe that failed, or a listed server: the soonest next look
PROBE_TIMEOUT_S = 5.0


class RevokedPeer(Exception):
    """The server at `address` showed a certificate the revocation list names."""

    def __init__(self, address: str, serial: int, crl: str) -> None:
        self.address, self.serial, self.crl = address, serial, crl
        super().__init__(
            f"the server at {address} shows certificate serial {serial:x}, which {crl} "
            "revokes: not calling it"
        )


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC target Astra dials (`host:port`, `[v6]:port`, `dns:`/`ipv4:`/
    `ipv6:` forms of one address); None for one a probe cannot reach (a Unix socket, a list,
    no port)."""
    target = address
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :]
            break
    if target.startswith("unix") or "," in target:
        return None
    if target.startswith("["):
        host, sep, rest = target[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port = target.rpartition(":")
        if ":" in host:  # a bare IPv6 address without a port
            return None
    if not host or not sep or not port.isdigit():
        return None
    return host, int(port)


def client_context(tls: TlsMaterial) -> ssl.SSLContext:
    """A TLS client context of this node's credentials: the CA's chain is checked (the host
    name is gRPC's to check), h2 offered, as gRPC offers it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=tls.ca.decode())
    # load_cert_chain reads files only: the PEMs pass through a private directory.
    with tempfile.TemporaryDirectory(prefix="astra-tls-") as d:
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cert, tls.cert), (key, tls.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    return ctx


async def peer_serial(
    host: str, port: int, ctx: ssl.SSLContext, server_name: str, timeout_s: float
) -> int:
    """The serial number of the certificate the server at host:port shows in a handshake."""

    async def handshake() -> bytes:
        _reader, writer = await asyncio.open_connection(
            host, port, ssl=ctx, server_hostname=server_name or host
        )
        try:
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        finally:
            writer.close()
        return der

    der = await within(handshake(), timeout_s)
    return x509.load_der_x509_certificate(der).serial_number


@dataclass
class _Verdict:
    until: float = 0.0  # monotonic time the verdict holds until
    revoked: int | None = None  # the listed serial the server showed


class PeerCheck:
    """Whether the server at one address may be called under one TlsMaterial (a new one, a
    changed list among them, comes with a new channel and so a new check)."""

    def __init__(self, address: str, tls: TlsMaterial, *, timeout_s: float = PROBE_TIMEOUT_S):
        self.address, self.tls, self.timeout_s = address, tls, timeout_s
        self.target = split_address(address)
        self.probes = 0  # handshakes made
        self._verdict = _Verdict()
        self._ctx: ssl.SSLContext | None = None
        self._probe: asyncio.Task[_Verdict] | None = None
        if self.target is None:
            log.warning("%s: no host:port to check the server's certificate against %s",
                        address, tls.crl)  # fmt: skip

    async def check(self) -> None:
        """Returns when the server may be called; raises RevokedPeer when it may not."""
        if self.target is None or not self.tls.revoked:
            return
        if time.monotonic() >= self._verdict.until:
            probe = self._probe
            if probe is None or probe.done() or probe.get_loop() is not asyncio.get_running_loop():
                probe = self._probe = asyncio.get_running_loop().create_task(self._look())
            self._verdict = await asyncio.shield(probe)
        if self._verdict.revoked is not None:
            raise RevokedPeer(self.address, self._verdict.revoked, self.tls.crl)

    async def _look(self) -> _Verdict:
        assert self.target is not None
        self.probes += 1
        try:
            if self._ctx is None:
                self._ctx = client_context(self.tls)
            serial = await peer_serial(*self.target, self._ctx, self.tls.server_name,
                                       self.timeout_s)  # fmt: skip
        except (TimeoutError, OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.debug("%s: the server's certificate could not be read (%s); gRPC decides",
                      self.address, exc)  # fmt: skip
            return _Verdict(until=time.monotonic() + RETRY_S)
        if serial in self.tls.revoked:
            log.error("the server at %s shows certificate serial %x, which %s revokes",
                      self.address, serial, self.tls.crl)  # fmt: skip
            return _Verdict(until=time.monotonic() + RETRY_S, revoked=serial)
        return _Verdict(until=time.monotonic() + RECHECK_S)
