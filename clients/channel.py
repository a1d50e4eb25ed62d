"""Channels for Astra clients: message limits and retries of idempotent RPCs.

Retries are declared in the gRPC service config, per method, so only the
RPCs a contract marks idempotent are retried (on UNAVAILABLE), by gRPC
itself, with exponential backoff. Every client call also carries a deadline.
Channels use mutual TLS when the process's environment names the run's
credentials (astra.tls), plaintext otherwise. A client whose credential files
are renewed dials again with the new ones at its next call (`BaseClient`), so
processes that hold a channel for their whole life (Dataflow's to each RaaS,
a trainer's to Dataflow) follow a renewal without a restart. Under a revocation list
that names anyone, a channel also looks up its server's certificate (clients.revocation).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import grpc

from astra.clients.revocation import check_server, peer_check, revocation_interceptors
from astra.tls import current_tls
from astra.tls_material import TlsMaterial
from astra.tls_peer import PeerCheck

log = logging.getLogger(__name__)
MiB = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB


def retry_service_config(
    service: str,
    idempotent_methods: Iterable[str],
    *,
    max_attempts: int = 5,
    initial_backoff_s: float = 0.1,
    max_backoff_s: float = 2.0,
) -> str:
    """A service config JSON that retries `idempotent_methods` on UNAVAILABLE."""
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": service, "method": m} for m in idempotent_methods],
                    "retryPolicy": {
                        "maxAttempts": max_attempts,
                        "initialBackoff": f"{initial_backoff_s}s",
                        "maxBackoff": f"{max_backoff_s}s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


def open_channel(
    address: str,
    service_config: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: TlsMaterial | None = None,
    peer: PeerCheck | None = None,
) -> grpc.aio.Channel:
    """A channel to `address`: mutual TLS with `tls` (default: this process's credentials
    now), plaintext when there are none; its calls ask `peer` first, where there is one
    (clients.revocation)."""
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", service_config),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        # Its own connections: by default gRPC shares them process-wide by address, and a new
        # channel to a server started where a dead one was (a restarted RaaS, a new port that a
        # gone server had) inherits the other channel's reconnect backoff, up to 120 s of
        # "connection refused" from a server that is up (tests/test_channel_reconnect.py).
        ("grpc.use_local_subchannel_pool", 1),
    ]
    tls = current_tls() if tls is None else tls
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    interceptors = revocation_interceptors(peer) if peer is not None else None
    return grpc.aio.secure_channel(
        address, channel_credentials(tls), options=options, interceptors=interceptors
    )


def connect_hint(code: grpc.StatusCode) -> str:
    """What to add to an UNAVAILABLE seen by a command line tool: the usual cause when the
    process has no TLS settings is a server that requires them."""
    if code is grpc.StatusCode.UNAVAILABLE and current_tls() is None:
        return " (a server with mutual TLS refuses plaintext: pass --tls DIR or set ASTRA_TLS_DIR)"
    return ""


def channel_credentials(tls: TlsMaterial) -> grpc.ChannelCredentials:
    """Mutual TLS: the server must show a certificate of the run's CA; this node shows its own."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )


class BaseClient:
    """Owns one channel and the service's stub.

    Subclasses set SERVICE, IDEMPOTENT, STUB (the generated stub class) and PB
    (the service's generated message module): every Astra service has GetStatus
    and GetCapabilities, so those two calls live here. A subclass that builds more
    callables on the channel does it in `_bind`.

    Under mutual TLS, `channel` and `stub` look at the credential files first (astra.tls:
    a stat a second at most): once they were renewed into a usable set, a new channel with
    the new certificate replaces the old one, and the old one closes after its calls in
    flight, given RENEW_GRACE_S at most (a weight fetch cut then resumes from its last
    acknowledged tensor).
    """

    SERVICE = ""
    IDEMPOTENT: tuple[str, ...] = ()
    STUB: Callable[[grpc.aio.Channel], Any]
    PB: ModuleType
    RENEW_GRACE_S = 120.0

    def __init__(self, address: str, *, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._config = retry_service_config(self.SERVICE, self.IDEMPOTENT)
        self._tls = current_tls()
        self._peer = peer_check(address, self._tls)
        self._channel = open_channel(address, self._config, tls=self._tls, peer=self._peer)
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None] | None] = {}
        self.redials = 0  # channels opened again for renewed credentials
        self._bind(self._channel)

    def _bind(self, channel: grpc.aio.Channel) -> None:
        """Builds what calls go through on `channel` (again after a renewal)."""
        self._stub = self.STUB(channel)

    def _follow_renewal(self) -> None:
        if self._tls is None:
            return  # plaintext stays plaintext
        now = current_tls()
        if now is None or now is self._tls:
            return
        old, self._tls = self._channel, now
        self._peer = peer_check(self.address, now)
        self._channel = open_channel(self.address, self._config, tls=now, peer=self._peer)
        self._bind(self._channel)
        self.redials += 1
        log.info("%s: TLS credentials renewed: a new channel to %s", self.SERVICE, self.address)
        try:
            closing = asyncio.get_running_loop().create_task(old.close(self.RENEW_GRACE_S))
        except RuntimeError:  # no loop: closed by close()
            closing = None
        self._retired[old] = closing
        if closing is not None:
            closing.add_done_callback(lambda _t, ch=old: self._retired.pop(ch, None))

    @property
    def channel(self) -> grpc.aio.Channel:
        self._follow_renewal()
        return self._channel

    @property
    def stub(self) -> Any:
        self._follow_renewal()
        return self._stub

    async def check_server(self) -> None:
        """Raises UNAUTHENTICATED (SERVER_CERTIFICATE_REVOKED) when the server shows a
        certificate the revocation list names: for a call that writes its requests, before
        it opens (clients.revocation); other calls are checked on their own."""
        self._follow_renewal()
        await check_server(self._peer)

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    async def get_status(self, *, timeout_s: float | None = None) -> Any:
        """The service's GetStatusResponse."""
        return await self.stub.GetStatus(
            self.PB.GetStatusRequest(), timeout=self._timeout(timeout_s)
        )

    async def get_capabilities(self, *, timeout_s: float | None = None) -> Any:
        """The service's GetCapabilitiesResponse."""
        return await self.stub.GetCapabilities(
            self.PB.GetCapabilitiesRequest(), timeout=self._timeout(timeout_s)
        )

    async def close(self, grace_s: float | None = None) -> None:
        """Closes the channel (and any a renewal left closing); calls in flight get `grace_s`
        to finish (None: cancelled now)."""
        retired, self._retired = self._retired, {}
        for closing in retired.values():
            if closing is not None:
                closing.cancel()  # closed here instead, with this grace
        await asyncio.gather(*(ch.close(grace_s) for ch in [*retired, self._channel]))

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
