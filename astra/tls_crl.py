"""Certificate revocation: the CA's list of node certificates it no longer vouches for.

`revoke` adds certificates (by file or serial number) to the X.509 CRL ``crl.pem`` of a CA
directory, signed by the CA's key: a standard CRL that `openssl crl -text` reads. Nodes find it
as ``crl.pem`` in their ASTRA_TLS_DIR (or at ASTRA_TLS_CRL); `load_crl` checks that the CA of
the node's ca.pem signed it; servers then refuse the serial numbers it lists (servers.authz:
UNAUTHENTICATED, reason CERTIFICATE_REVOKED). Never touches gRPC.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from astra.tls_material import (
    CRL_FILE,
    ENV_CRL,
    ENV_DIR,
    RevocationList,
    TlsConfigError,
    TlsMaterial,
    _read_pem,
    crl_path,
)

DEFAULT_DAYS = 30  # a CRL's nextUpdate: when its issuer promises a newer one, at the latest


class CrlError(TlsConfigError):
    """The revocation list alone cannot be used (the rest of the credentials may be fine)."""


def _pems(data: bytes, kind: str) -> list[bytes]:
    """Each PEM block of `kind` (CERTIFICATE, X509 CRL) in `data`."""
    begin, end = f"-----BEGIN {kind}-----".encode(), f"-----END {kind}-----".encode()
    out, at = [], 0
    while (start := data.find(begin, at)) >= 0:
        stop = data.find(end, start)
        if stop < 0:
            break
        out.append(data[start : stop + len(end)] + b"\n")
        at = stop + len(end)
    return out


def _parse(crl_pem: bytes, ca_pem: bytes, where: str):
    """(the CRL in `crl_pem`, the certificates of `ca_pem` named as its issuer)."""
    from cryptography import x509

    blocks = _pems(crl_pem, "X509 CRL")
    if len(blocks) != 1:
        raise CrlError(f"{where}: holds {len(blocks)} CRLs, not one (X509 CRL PEM)")
    try:
        crl = x509.load_pem_x509_crl(blocks[0])
        cas = [x509.load_pem_x509_certificate(c) for c in _pems(ca_pem, "CERTIFICATE")]
    except ValueError as exc:
        raise CrlError(f"{where}: {exc}") from exc
    return crl, [ca for ca in cas if ca.subject == crl.issuer]


def _signed(crl, issuers: list, where: str):
    for ca in issuers:
        try:
            if crl.is_signature_valid(ca.public_key()):
                return crl
        except TypeError:  # a key type CRLs cannot be signed with
            continue
    raise CrlError(
        f"{where}: not signed by the CA of ca.pem (issuer {crl.issuer.rfc4514_string()}): "
        "a revocation list counts only from the CA that issued the certificates"
    )


def load_crl(crl_pem: bytes, ca_pem: bytes, where: str = CRL_FILE):
    """The CRL (cryptography's x509.CertificateRevocationList: its entries are the revoked
    serials, `next_update_utc` when its CA promised a newer one) in `crl_pem`, signed by a
    certificate of `ca_pem` (CrlError when it is not one CRL or another CA signed it)."""
    crl, issuers = _parse(crl_pem, ca_pem, where)
    return _signed(crl, issuers, where)


def read_list(path: Path, ca_pem: bytes, var: str = ENV_CRL) -> RevocationList:
    """A node's revocation list at `path` (CrlError when it cannot be read or is not one CRL,
    or names a CA of ca.pem as its issuer that did not sign it). A list whose issuer is no CA
    of ca.pem is not used (`note` says so): the certificates it lists chain to a CA the
    node no longer trusts (after a move to a new CA), so they cannot connect anyway."""
    from cryptography import x509

    try:
        data = _read_pem("revocation list", path, var)
    except TlsConfigError as exc:
        raise CrlError(str(exc)) from exc
    crl, issuers = _parse(data, ca_pem, str(path))
    issuer = crl.issuer.rfc4514_string()
    if not issuers:
        note = f"{path} is the list of {issuer}, a CA ca.pem does not trust: not used"
        return RevocationList(frozenset(), str(path), issuer, note=note)
    _signed(crl, issuers, str(path))
    try:
        number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        number = 0
    due = crl.next_update_utc
    return RevocationList(
        frozenset(e.serial_number for e in crl),
        str(path),
        issuer,
        number,
        due.timestamp() if due else 0.0,
    )


def with_list(material: TlsMaterial, env: Mapping[str, str]) -> TlsMaterial:
    """`material` with the revocation list `env` names, where there is one."""
    path, required = crl_path(env)
    if path is None or not (required or path.exists()):
        return material
    if required and not path.exists():
        raise CrlError(f"{ENV_CRL}: no revocation list at {path}")
    found = read_list(path, material.ca, ENV_CRL if required else ENV_DIR)
    return replace(material, revocations=found)


def kept(new: TlsMaterial, old: TlsMaterial, why: str) -> TlsMaterial:
    """The new credentials with the revocations in use before (fail closed)."""
    held = old.revocations or RevocationList(frozenset(), "")
    return replace(new, revocations=replace(held, note=why))


def carried(new: TlsMaterial, old: TlsMaterial | None) -> TlsMaterial:
    """What a refresh uses of the revocations: the new list, unless it would revoke less than
    the one in use says without being newer (removed, not used, or an older list of the same
    CA): then the list in use stays until a restart."""
    if old is None or old.revocations is None or not old.revoked:
        return new
    was, now = old.revocations, new.revocations
    if now is None:
        return kept(new, old, f"{was.path} was removed: its revocations stay")
    if now.note:
        return kept(new, old, f"{now.note}; the revocations before it stay")
    if now.issuer == was.issuer and now.number < was.number:
        why = (f"{now.path} is an older list (number {now.number} < {was.number}): "
               "the newer one's revocations stay")  # fmt: skip
        return kept(new, old, why)
    return new


def own_revoked(material: TlsMaterial) -> bool:
    if not material.revoked:
        return False
    return serial_of(material.cert) in material.revoked


def serial_of(cert_pem: bytes) -> int:
    """The serial number of a PEM certificate (ValueError when it is not one)."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert_pem).serial_number


def revoke(
    ca_dir: Path,
    *,
    certs: Iterable[Path] = (),
    serials: Iterable[int] = (),
    days: int = DEFAULT_DAYS,
) -> dict[str, object]:
    """Adds the certificates at `certs` and the `serials` to CA_DIR/crl.pem (made if missing),
    a new CRL number each time, signed by the CA; already listed ones stay as they were. With
    nothing to add, an existing list is signed again with a new nextUpdate (renewed). Returns
    what the list now holds. Certificates another CA issued are refused."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    from astra.tls_certs import CA_CERT, CA_KEY, _write
    from astra.tls_material import chains_to_ca

    try:
        ca_pem = (ca_dir / CA_CERT).read_bytes()
        ca = x509.load_pem_x509_certificate(ca_pem)
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), None)
    except (OSError, ValueError, TypeError) as exc:
        raise TlsConfigError(f"{ca_dir}: no readable CA ({CA_CERT}, {CA_KEY}): {exc}") from exc
    wanted = dict.fromkeys(serials)
    for path in certs:
        try:
            pem = path.read_bytes()
            chained = chains_to_ca(pem, ca_pem)
            serial = serial_of(pem)
        except (OSError, ValueError) as exc:
            raise TlsConfigError(f"{path}: not a readable certificate: {exc}") from exc
        if not chained:
            raise TlsConfigError(f"{path} was not issued by the CA in {ca_dir}")
        wanted[serial] = None
    path = ca_dir / CRL_FILE
    if not wanted and not path.exists():
        raise TlsConfigError("nothing to revoke: name a certificate file or a serial number")
    for serial in wanted:
        if not 0 < serial < 1 << 160:
            raise TlsConfigError(f"serial {serial:#x}: not a certificate serial number")
    entries: dict[int, x509.RevokedCertificate] = {}
    number = 0
    if path.exists():
        old = load_crl(path.read_bytes(), ca_pem, str(path))
        entries = {e.serial_number: e for e in old}
        try:
            number = old.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
        except x509.ExtensionNotFound:
            number = 0
    now = datetime.datetime.now(datetime.UTC)
    added = [s for s in wanted if s not in entries]
    for serial in added:
        entries[serial] = (
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.subject)
        .last_update(now)
        .next_update(now + datetime.timedelta(days=days))
        .add_extension(x509.CRLNumber(number + 1), critical=False)
    )
    for entry in entries.values():
        builder = builder.add_revoked_certificate(entry)
    crl = builder.sign(key, hashes.SHA256())  # type: ignore[arg-type]
    _write(path, crl.public_bytes(serialization.Encoding.PEM), private=False)
    return {
        "crl": str(path),
        "crl_number": number + 1,
        "added": [f"{s:x}" for s in added],
        "revoked": [f"{s:x}" for s in sorted(entries)],
        "next_update": (now + datetime.timedelta(days=days)).isoformat(),
    }
