"""The run's TLS material: where its PEM files are, what they must hold, and how they are read.

Constants and environment names, `TlsMaterial` (the three PEM files and a revocation list),
the checks that a key, certificate and CA belong together (`chains_to_ca`, `expires_in_s`)
and `TlsConfigError`. astra.tls loads and refreshes them; astra.tls_crl and astra.tls_certs
write them. Never touches gRPC or the network.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("astra.tls")

ENV_DIR = "ASTRA_TLS_DIR"
ENV_FILES = {"ca": "ASTRA_TLS_CA", "cert": "ASTRA_TLS_CERT", "key": "ASTRA_TLS_KEY"}
ENV_SERVER_NAME = "ASTRA_TLS_SERVER_NAME"
# Set by `astra run` with `tls: true`: the run's CA, from which the supervisor issues each child
# a credential naming its role, for its node's address under --ray
# (astra.tls_certs.child_credential). Children never see it.
ENV_NODE_CA = "ASTRA_TLS_NODE_CA"
ENV_CRL = "ASTRA_TLS_CRL"  # a revocation list's path (default: crl.pem in ASTRA_TLS_DIR, if any)
CRL_FILE = "crl.pem"
DIR_FILES = {"ca": "ca.pem", "cert": "cert.pem", "key": "key.pem"}
MAX_PEM_BYTES = 1 << 20
RECHECK_S = 1.0  # how often the files' stat is looked at again, at most
EXPIRY_WARN_S = 30 * 86400.0  # a certificate this close to its end is warned about, daily


class TlsConfigError(ValueError):
    """The TLS settings of this process name files that are missing, unreadable or not PEM."""


@dataclass(frozen=True)
class RevocationList:
    """What a node takes from its crl.pem (astra.tls_crl.read_list)."""

    serials: frozenset[int]
    path: str
    issuer: str = ""
    number: int = 0  # its CRLNumber: a newer list of the same CA has a higher one
    next_update: float = 0.0  # Unix time; 0: no promise
    note: str = ""  # why a list found is not used, or why the one before still is


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of one process's credentials, and the revocations it enforces."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str = ""
    source: str = ""  # where they came from, for messages and logs
    revocations: RevocationList | None = None  # None: no revocation list

    @property
    def revoked(self) -> frozenset[int]:
        """The serial numbers the CA's revocation list names."""
        return self.revocations.serials if self.revocations is not None else frozenset()

    @property
    def crl(self) -> str:
        """The revocation list's path, where one was read."""
        return self.revocations.path if self.revocations is not None else ""

    @property
    def crl_next_update(self) -> float:
        return self.revocations.next_update if self.revocations is not None else 0.0

    @property
    def crl_note(self) -> str:
        return self.revocations.note if self.revocations is not None else ""


def tls_paths(env: Mapping[str, str] | None = None) -> dict[str, Path] | None:
    """The files `env` (default: this process's environment) names, None for plaintext."""
    env = os.environ if env is None else env
    directory = env.get(ENV_DIR, "")
    named = {k: env.get(v, "") for k, v in ENV_FILES.items()}
    if directory and any(named.values()):
        given = ", ".join(ENV_FILES[k] for k, v in named.items() if v)
        raise TlsConfigError(f"{ENV_DIR} and {given} are both set: set one or the other")
    if directory:
        return {k: Path(directory) / name for k, name in DIR_FILES.items()}
    if not any(named.values()):
        return None
    missing = [ENV_FILES[k] for k, v in named.items() if not v]
    if missing:
        raise TlsConfigError(
            f"{', '.join(missing)} not set: mutual TLS needs {', '.join(ENV_FILES.values())}"
        )
    return {k: Path(v) for k, v in named.items()}


def crl_path(env: Mapping[str, str] | None = None) -> tuple[Path | None, bool]:
    """The revocation list `env` names, and whether it must exist: ASTRA_TLS_CRL (must),
    else crl.pem in ASTRA_TLS_DIR (where there is one); (None, False) for none."""
    env = os.environ if env is None else env
    if env.get(ENV_CRL):
        return Path(env[ENV_CRL]), True
    if env.get(ENV_DIR):
        return Path(env[ENV_DIR]) / CRL_FILE, False
    return None, False


def _read_pem(kind: str, path: Path, var: str) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise TlsConfigError(f"{var}: cannot read the {kind} file {path}: {exc.strerror}") from exc
    if len(data) > MAX_PEM_BYTES:
        raise TlsConfigError(f"{var}: {path} is over {MAX_PEM_BYTES} bytes: not a PEM file")
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{var}: {path} is not PEM (no -----BEGIN line)")
    return data


def _check(pem: dict[str, bytes], paths: dict[str, Path]) -> None:
    """Each file holds what its name says, and the key belongs to the certificate."""
    if b"CERTIFICATE-----" not in pem["ca"]:
        raise TlsConfigError(f"{paths['ca']}: no certificate in the CA file")
    if b"CERTIFICATE-----" not in pem["cert"]:
        raise TlsConfigError(f"{paths['cert']}: no certificate in the certificate file")
    if b"PRIVATE KEY-----" not in pem["key"]:
        raise TlsConfigError(f"{paths['key']}: no private key in the key file")
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
    except ImportError:  # pragma: no cover - a dependency; gRPC still checks at the handshake
        return
    try:
        cert = x509.load_pem_x509_certificate(pem["cert"])
        key = serialization.load_pem_private_key(pem["key"], password=None)
    except (ValueError, TypeError) as exc:
        raise TlsConfigError(f"{paths['cert']} / {paths['key']}: {exc}") from exc
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc <= now:
        raise TlsConfigError(
            f"{paths['cert']} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: "
            "issue a new one (astra tls issue)"
        )
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if cert.public_key().public_bytes(encoding, public) != key.public_key().public_bytes(
        encoding, public
    ):
        raise TlsConfigError(f"{paths['key']} is not the key of the certificate {paths['cert']}")
    try:
        chained = chains_to_ca(pem["cert"], pem["ca"])
    except ValueError as exc:
        raise TlsConfigError(f"{paths['ca']} / {paths['cert']}: {exc}") from exc
    if not chained:
        raise TlsConfigError(f"{paths['cert']} was not issued by the CA of {paths['ca']}")


def chains_to_ca(cert_pem: bytes, ca_pem: bytes) -> bool:
    """Whether the first certificate of `cert_pem` leads to one of `ca_pem`'s: issued by it
    directly, or through intermediates that `cert_pem` carries after it (each a CA that
    signed the one before). Raises ValueError on a file that holds no certificate."""
    from cryptography import x509

    leaf, *intermediates = x509.load_pem_x509_certificates(cert_pem)
    roots = x509.load_pem_x509_certificates(ca_pem)
    current, left = leaf, list(intermediates)
    for _ in range(len(intermediates) + 1):
        if any(_issued_by(current, root) for root in roots):
            return True
        issuer = next((c for c in left if _is_ca(c) and _issued_by(current, c)), None)
        if issuer is None:
            return False
        left.remove(issuer)
        current = issuer
    return False


def _is_ca(cert) -> bool:
    from cryptography import x509

    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def _issued_by(cert, ca) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:  # InvalidSignature, or a CA of another key type
        return False
    return True


def expires_in_s(cert_pem: bytes) -> float:
    """Seconds until the (first) certificate of `cert_pem` expires (negative: expired);
    ValueError if it holds none."""
    from cryptography import x509

    end = x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
    return (end - datetime.datetime.now(datetime.UTC)).total_seconds()
