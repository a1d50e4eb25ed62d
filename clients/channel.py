"""Channels for Astra clients: message limits and retries of idempotent RPCs.

Retries are declared in the gRPC service config, per method, so only the
RPCs a contract marks idempotent are retried (on UNAVAILABLE), by gRPC
itself, with exponential backoff. Every client call also carries a deadline.
Channels use mutual TLS when the process's environment names the run's
credentials (astra.tls), plaintext otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import grpc

from astra.tls import TlsMaterial, current_tls

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
) -> grpc.aio.Channel:
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", service_config),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
    ]
    tls = current_tls()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options)


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
    and GetCapabilities, so those two calls live here.
    """

    SERVICE = ""
    IDEMPOTENT: tuple[str, ...] = ()
    STUB: Callable[[grpc.aio.Channel], Any]
    PB: ModuleType

    def __init__(self, address: str, *, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = open_channel(address, retry_service_config(self.SERVICE, self.IDEMPOTENT))
        self.stub = self.STUB(self.channel)

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
        """Closes the channel; calls in flight get `grace_s` to finish (None: cancelled now)."""
        await self.channel.close(grace_s)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
