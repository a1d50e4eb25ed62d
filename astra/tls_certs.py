"""A run's certificate authority and its nodes' credentials (what `astra tls` writes).

`init_ca` writes a CA (ca.pem, ca.key) into a directory; `issue` writes a node credential
(ca.pem, cert.pem, key.pem: what ASTRA_TLS_DIR names) signed by it, valid for the given hosts
(IP addresses and DNS names, all in the subjectAltName) for both server and client use, since
every Astra process is both. A credential may name roles (astra.authz), as URI subjectAltNames
``urn:astra:role:<role>``, which confine what its holder may call; one without roles may call
everything. Keys are ECDSA P-256, written readable by their owner only. Never touches gRPC.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import os
import secrets
import tempfile
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from astra.authz import ROLE_URI_PREFIX, ROLES, RoleError, check_roles, roles_of_uris
from astra.scopes import policies_of_uris, policy_uri
from astra.tls_material import CRL_FILE, DIR_FILES, TlsConfigError, expires_in_s

CA_CERT, CA_KEY = "ca.pem", "ca.key"
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def _x509():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:  # pragma: no cover - a dependency of astra-rl
        raise TlsConfigError("astra tls needs the cryptography package") from exc
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Atomically, through a new temporary file of its own (never a name that could already
    exist or be a link), with the mode set before the bytes land, synced."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600 if private else 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _names(hosts: Sequence[str]):
    x509 = _x509()[0]
    out = []
    for h in hosts:
        h = h.strip()
        if not h:
            raise TlsConfigError("a host must not be empty")
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            if ":" in h or "/" in h or " " in h:
                raise TlsConfigError(
                    f"{h!r} is neither an IP address nor a DNS name (a host, not HOST:PORT)"
                ) from None
            out.append(x509.DNSName(h))
    return out


def _ca_usage(x509):
    """Key usage of a CA: signs certificates and CRLs, nothing else."""
    flags = dict.fromkeys(
        ["content_commitment", "key_encipherment", "data_encipherment", "key_agreement"], False
    )
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
        **flags,
    )


def init_ca(directory: Path, *, name: str = "", days: int = 365) -> Path:
    """Writes a new CA into `directory` (refuses to overwrite one); returns ca.pem's path. Its
    name (default: "astra run CA" and a random suffix) tells its revocation list from another
    CA's (astra.tls_crl)."""
    x509, hashes, serialization, ec, _, NameOID = _x509()
    name = name or f"astra run CA {secrets.token_hex(4)}"
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / CA_KEY).exists():
        raise TlsConfigError(f"{directory / CA_KEY} exists: a CA is there already")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_ca_usage(x509), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(directory / CA_KEY, pem_key, private=True)
    _write(directory / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return directory / CA_CERT


def issue(
    ca_dir: Path,
    out_dir: Path,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    *,
    name: str = "",
    days: int = 365,
    roles: Sequence[str] = (),
    policies: Sequence[str] = (),
) -> Path:
    """Writes a node credential signed by the CA in `ca_dir` into `out_dir`, naming `roles`
    (none: it may call every RPC) and `policies` (none: any policy, astra.scopes); returns
    out_dir."""
    x509, hashes, serialization, ec, EKU, NameOID = _x509()
    if not hosts:
        raise TlsConfigError("a node certificate needs at least one host")
    try:
        uris = [x509.UniformResourceIdentifier(ROLE_URI_PREFIX + r) for r in check_roles(roles)]
        uris += [x509.UniformResourceIdentifier(policy_uri(p)) for p in dict.fromkeys(policies)]
    except (RoleError, ValueError) as exc:
        raise TlsConfigError(str(exc)) from exc
    try:
        ca_pem = (ca_dir / CA_CERT).read_bytes()
        ca_cert = x509.load_pem_x509_certificate(ca_pem)
        ca_key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), None)
    except (OSError, ValueError, TypeError) as exc:  # TypeError: a key with a passphrase
        raise TlsConfigError(f"{ca_dir}: no readable CA ({CA_CERT}, {CA_KEY}): {exc}") from exc
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name or hosts[0])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(_names(hosts) + uris), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(out_dir / DIR_FILES["key"], pem_key, private=True)
    _write(
        out_dir / DIR_FILES["cert"], cert.public_bytes(serialization.Encoding.PEM), private=False
    )
    if (out_dir / DIR_FILES["ca"]).resolve() != (ca_dir / CA_CERT).resolve():
        _write(out_dir / DIR_FILES["ca"], ca_pem, private=False)
        if (ca_dir / CRL_FILE).exists():  # the node starts with the CA's revocation list
            _write(out_dir / CRL_FILE, (ca_dir / CRL_FILE).read_bytes(), private=False)
    return out_dir


RENEW_WITHIN_S = 30 * 86400.0  # the credentials a run makes itself are renewed this early


def expiring(cert_path: Path, within_s: float = RENEW_WITHIN_S) -> bool:
    """Whether the certificate at `cert_path` is missing, unreadable or ends within
    `within_s`: what a run's own credentials are issued again for."""
    try:
        return expires_in_s(cert_path.read_bytes()) < within_s
    except (OSError, ValueError):
        return True


def _uris(cert_pem: bytes) -> list[str]:
    x509 = _x509()[0]
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return sans.get_values_for_type(x509.UniformResourceIdentifier)


def cert_roles(cert_pem: bytes) -> tuple[str, ...]:
    """The roles a PEM certificate names (astra.authz), sorted; () for none."""
    return tuple(sorted(roles_of_uris(_uris(cert_pem))))


def cert_policies(cert_pem: bytes) -> list[str]:
    """The policies a PEM certificate is confined to (astra.scopes), sorted; [] for any."""
    return sorted(policies_of_uris(_uris(cert_pem)))


def child_credential(ca_dir: Path, role: str, host: str = "", policies: Sequence[str] = ()) -> Path:
    """The credential of a child of `role` on the node dialled as `host` (loopback when
    empty): issued by the CA in `ca_dir` into ca_dir/nodes/<host or loopback>/<role>, naming
    that role (astra.authz) and confined to `policies` where given (astra.scopes; the
    directory is then <role>.<the policies>), and again when it is about to end. A role
    astra.authz does not know (a warm-up step) gets a credential without roles or policies, in
    .../operator. Its crl.pem links to the CA's, so `astra tls revoke CA_DIR` reaches the run's
    servers at once. What a supervisor hands each child it starts. Returns its directory."""
    if host and ("/" in host or host.startswith(".")):
        raise TlsConfigError(f"not a host name or address: {host!r}")
    roles = [role] if role in ROLES else []
    policies = sorted(dict.fromkeys(policies)) if roles else []
    leaf = role if roles else "operator"
    if policies:
        leaf += "." + "+".join(urllib.parse.quote(p, safe="") for p in policies)
        if len(leaf) > 200:  # a path segment stays short; the certificate names them all
            digest = hashlib.sha256("\0".join(policies).encode()).hexdigest()[:16]
            leaf = f"{role}.{digest}"
    out = ca_dir / "nodes" / (host or "loopback") / leaf
    hosts = [host, *(h for h in DEFAULT_HOSTS if h != host)] if host else list(DEFAULT_HOSTS)
    if expiring(out / DIR_FILES["cert"]):  # none yet, or about to end: (re)issued
        name = f"{roles[0] if roles else 'operator'}@{host or 'loopback'}"
        issue(ca_dir, out, hosts, name=name, roles=roles, policies=policies)
    crl = out / CRL_FILE
    if not crl.is_symlink():  # the run's revocation list, as `astra tls revoke` writes it
        crl.unlink(missing_ok=True)
        crl.symlink_to(os.path.relpath(ca_dir / CRL_FILE, out))
    return out
