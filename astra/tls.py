"""Transport security of a run: which PEM files this process uses, read and checked once.

Every Astra process, server and client alike, uses mutual TLS when its environment names the
run's credentials, and plaintext otherwise:

- ``ASTRA_TLS_DIR``: a directory holding ``ca.pem`` (the run's certificate authority),
  ``cert.pem`` and ``key.pem`` (this node's certificate and private key), as
  ``astra tls init`` and ``astra tls issue`` write it; or
- ``ASTRA_TLS_CA``, ``ASTRA_TLS_CERT`` and ``ASTRA_TLS_KEY``: the three files by path, all three.

Servers then accept only clients whose certificate the CA signed, and clients accept only
servers whose certificate the CA signed for the host they dial (an IP address or DNS name in
its subjectAltName). ``ASTRA_TLS_SERVER_NAME`` makes clients check that name instead of the
dialled host (a certificate issued for a DNS name, dialled by IP). The same files serve both
ends, so one credential per node is enough. Never touches gRPC.

A certificate revocation list signed by the CA (astra.tls_crl), ``crl.pem`` in ASTRA_TLS_DIR
where there is one or the file ``ASTRA_TLS_CRL`` names, lists the certificates servers refuse
(`TlsMaterial.revoked`, enforced per call by servers.authz).

The files are read again when they change (`TlsFiles.refresh`, at most once a second): a
server's next handshake shows the new certificate and checks clients against the new CA file,
and channels opened after it use the new files. Files that changed into something unusable (a
key written before its certificate, a certificate the CA did not sign) leave the credentials in
use as they are until they are whole again.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

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

log = logging.getLogger("astra.tls")


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


def load_tls(env: Mapping[str, str] | None = None, *, with_crl: bool = True) -> TlsMaterial | None:
    """This process's TLS material, None when its environment asks for plaintext. A
    revocation list that cannot be used raises astra.tls_crl.CrlError (a TlsConfigError);
    `with_crl` False leaves it out."""
    env = os.environ if env is None else env
    paths = tls_paths(env)
    if paths is None:
        return None
    via = {k: ENV_DIR if env.get(ENV_DIR) else ENV_FILES[k] for k in paths}
    pem = {k: _read_pem(k, p, via[k]) for k, p in paths.items()}
    _check(pem, paths)
    source = env.get(ENV_DIR) or ", ".join(str(p) for p in paths.values())
    material = TlsMaterial(**pem, server_name=env.get(ENV_SERVER_NAME, ""), source=source)
    if not with_crl:
        return material
    from astra.tls_crl import with_list

    return with_list(material, env)


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


def _stamp(paths: Iterable[Path]) -> tuple[tuple[int, int, int] | None, ...]:
    """What tells a file changed: inode (a file renamed over it), size and mtime."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            out.append(None)
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class TlsFiles:
    """The TLS setting of an environment and its material, read again when the files change.
    The first read raises TlsConfigError (a wrong setting stops the process); later ones keep
    the material in use and log why (see the module docstring). Thread-safe: gRPC asks a
    server's credentials from its own threads."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self.paths = tls_paths(self.env)
        crl = crl_path(self.env)[0] if self.paths else None
        self.watched = [*(self.paths or {}).values(), *([crl] if crl else [])]
        self.stamp = _stamp(self.watched)
        from astra.tls_crl import own_revoked

        self.material = load_tls(self.env)
        if self.material is not None and own_revoked(self.material):
            raise TlsConfigError(
                f"the certificate of {self.material.source} is revoked by {self.material.crl}: "
                "issue this node a new one (astra tls issue)"
            )
        if self.material is not None and self.material.crl_note:
            log.warning("%s", self.material.crl_note)
        self.reloads = 0
        self._checked = time.monotonic()
        self._refused: tuple = ()
        self._lock = threading.Lock()
        self._expiry_checked = -float("inf")
        self._warn_expiry(self._checked)

    def _warn_expiry(self, now: float) -> None:
        """Looked at once a day at most: a warning while the certificate in use ends within
        EXPIRY_WARN_S."""
        if self.material is None or now - self._expiry_checked < 86400.0:
            return
        self._expiry_checked = now
        with contextlib.suppress(Exception):  # a warning only: never in the way of a handshake
            left = expires_in_s(self.material.cert)
            if left < EXPIRY_WARN_S:
                log.warning("the TLS certificate of %s expires in %.1f days: renew it in place "
                            "(astra tls issue), no restart needed", self.material.source,
                            left / 86400)  # fmt: skip
            due = self.material.crl_next_update
            if due and due < time.time():
                log.warning("the revocation list %s is past its nextUpdate (%s UTC); what it "
                            "revokes still holds: renew it (astra tls revoke CA_DIR) and copy "
                            "it to the nodes", self.material.crl,
                            datetime.datetime.fromtimestamp(due, datetime.UTC)
                            .strftime("%Y-%m-%d %H:%M"))  # fmt: skip

    def refresh(self) -> TlsMaterial | None:
        """The material to use now: read again if the files changed (looked at once a
        RECHECK_S at most)."""
        if self.paths is None:
            return None
        with self._lock:
            now = time.monotonic()
            if now - self._checked < RECHECK_S:
                return self.material
            self._checked = now
            self._warn_expiry(now)
            stamp = _stamp(self.watched)
            if stamp == self.stamp:
                return self.material
            from astra.tls_crl import CrlError, carried, kept, own_revoked

            try:
                try:
                    material = carried(load_tls(self.env), self.material)
                except CrlError as exc:  # the rest may be fine: used, with the list in use
                    why = f"{exc}; the revocations in use stay"
                    material = load_tls(self.env, with_crl=False)
                    if self.material is not None:
                        material = kept(material, self.material, why)
            except TlsConfigError as exc:
                if stamp != self._refused:  # once per state of the files
                    self._refused = stamp
                    log.warning("TLS files changed but cannot be used yet: %s; "
                                "the credentials in use stay", exc)  # fmt: skip
                return self.material
            if material is not None and material.crl_note:
                log.warning("%s", material.crl_note)
            self.stamp, self.material = stamp, material
            self.reloads += 1
            log.info("TLS credentials read again from %s (%d revoked)", material.source,
                     len(material.revoked))  # fmt: skip
            if own_revoked(material):  # its callers refuse it; its own checks still hold
                log.error("the certificate of %s is revoked by %s: issue this node a new one "
                          "(astra tls issue)", material.source, material.crl)  # fmt: skip
            self._expiry_checked = -float("inf")  # the new certificate's own end
            self._warn_expiry(now)
            return material


_cache: dict[tuple[str, ...], TlsFiles] = {}


def tls_files() -> TlsFiles | None:
    """The TlsFiles of this process's environment (one per distinct setting), None for
    plaintext."""
    names = (ENV_DIR, *ENV_FILES.values(), ENV_SERVER_NAME, ENV_CRL)
    key = tuple(os.environ.get(n, "") for n in names)
    if key not in _cache:
        _cache[key] = TlsFiles()
    files = _cache[key]
    return None if files.paths is None else files


def current_tls() -> TlsMaterial | None:
    """This process's TLS material now (`load_tls`, read again when its files change)."""
    files = tls_files()
    return None if files is None else files.refresh()
