"""`astra tls init|issue|revoke|show`: the run's CA, node credentials and the revocation list
for mutual TLS."""

from __future__ import annotations

import json
from pathlib import Path

import click

from astra.authz import ROLES
from astra.tls_crl import DEFAULT_DAYS
from astra.tls_material import DIR_FILES, ENV_DIR, TlsConfigError


@click.group("tls")
def tls() -> None:
    """Mutual TLS for a run: one CA, a credential per node (ASTRA_TLS_DIR or `astra --tls`)."""


def _hosts_option(f):
    return click.option(
        "--host",
        "hosts",
        multiple=True,
        help="IP address or DNS name the node is dialled by (repeat; default 127.0.0.1 and "
        "localhost). Every address a service advertises must be here.",
    )(f)


@tls.command("init")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@_hosts_option
@click.option("--days", type=click.IntRange(1, 3650), default=365, show_default=True)
def init_command(directory: Path, hosts: tuple[str, ...], days: int) -> None:
    """Create a CA in DIRECTORY (ca.pem, ca.key) and a credential for this node beside it
    (cert.pem, key.pem), so `--tls DIRECTORY` works at once. Keep ca.key off the nodes."""
    from astra.tls_certs import DEFAULT_HOSTS, init_ca, issue

    try:
        init_ca(directory, days=days)
        issue(directory, directory, list(hosts or DEFAULT_HOSTS), days=days)
    except TlsConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(json.dumps({"ca": str(directory / "ca.pem"), ENV_DIR: str(directory)}))


@tls.command("issue")
@click.argument("ca_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@_hosts_option
@click.option("--name", default="", help="Subject common name (default: the first host).")
@click.option("--days", type=click.IntRange(1, 3650), default=365, show_default=True)
@click.option(
    "--role",
    "roles",
    multiple=True,
    type=click.Choice(ROLES),
    help="What the holder may call (repeat for several; see astra.authz): raas, dataflow, "
    "trainer, weights, admin. Without --role it may call every RPC, as an operator.",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help="Confine the holder to this policy (repeat for several; see astra.scopes): it may "
    "register, fetch batches, announce, publish, fetch and roll back weights for these alone. "
    "Without --policy: any policy.",
)
def issue_command(
    ca_dir: Path,
    out_dir: Path,
    hosts: tuple[str, ...],
    name: str,
    days: int,
    roles: tuple[str, ...],
    policies: tuple[str, ...],
) -> None:
    """Write a node credential signed by the CA in CA_DIR into OUT_DIR (ca.pem, cert.pem,
    key.pem: what ASTRA_TLS_DIR names on that node)."""
    from astra.tls_certs import DEFAULT_HOSTS, issue

    try:
        issue(
            ca_dir,
            out_dir,
            list(hosts or DEFAULT_HOSTS),
            name=name,
            days=days,
            roles=roles,
            policies=policies,
        )
    except TlsConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(json.dumps({ENV_DIR: str(out_dir)}))


@tls.command("revoke")
@click.argument("ca_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("certs", nargs=-1, type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option(
    "--serial",
    "serials",
    multiple=True,
    help="Serial number (hex, as `astra tls show` and `openssl x509 -serial` print it) of a "
    "certificate to revoke whose file is gone (repeat).",
)
@click.option(
    "--days",
    type=click.IntRange(1, 3650),
    default=DEFAULT_DAYS,
    show_default=True,
    help="The list's nextUpdate: sign it again (revoke with nothing named) before it passes.",
)
def revoke_command(
    ca_dir: Path, certs: tuple[Path, ...], serials: tuple[str, ...], days: int
) -> None:
    """Add certificates (CERTS, files the CA in CA_DIR issued) to CA_DIR/crl.pem, the CA's
    signed revocation list. Copy crl.pem into each node's ASTRA_TLS_DIR (or point ASTRA_TLS_CRL
    at it): servers read it again within a second and refuse those certificates from then on
    (UNAUTHENTICATED, CERTIFICATE_REVOKED); nothing restarts. With nothing named, the list is
    signed again with a new nextUpdate (processes warn once it has passed)."""
    from astra.tls_crl import revoke

    try:
        numbers = [int(s.replace(":", ""), 16) for s in serials]
    except ValueError as exc:
        raise click.UsageError(f"--serial: not a hexadecimal serial number: {exc}") from exc
    try:
        click.echo(json.dumps(revoke(ca_dir, certs=certs, serials=numbers, days=days)))
    except TlsConfigError as exc:
        raise click.UsageError(str(exc)) from exc


@tls.command("show")
@click.argument("directory", type=click.Path(file_okay=False, exists=True, path_type=Path))
def show_command(directory: Path) -> None:
    """Print what a credential directory's certificate is valid for, and whether it is usable:
    issued by the CA of its ca.pem (through the chain it carries), its key, its expiry. Shown
    even when expired or broken, which exits 1."""
    from cryptography import x509

    from astra.tls import load_tls
    from astra.tls_certs import cert_policies, cert_roles
    from astra.tls_material import chains_to_ca, expires_in_s

    paths = {k: directory / name for k, name in DIR_FILES.items()}
    try:
        pem = {k: p.read_bytes() for k, p in paths.items()}
        cert = x509.load_pem_x509_certificate(pem["cert"])
        signed = chains_to_ca(pem["cert"], pem["ca"])
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"{directory}: {exc}") from exc
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = [str(v) for v in sans.get_values_for_type(x509.IPAddress)]
        hosts += sans.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        hosts = []
    material = None
    try:
        material = load_tls({ENV_DIR: str(directory)})
        problem = ""
        if material is not None and cert.serial_number in material.revoked:
            problem = f"revoked by {material.crl}: issue a new one (astra tls issue)"
    except TlsConfigError as exc:
        problem = str(exc)
    out = {
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "hosts": hosts,
        # What the holder may call (astra.authz); [] = every RPC, as an operator.
        "roles": list(cert_roles(pem["cert"])),
        "policies": cert_policies(pem["cert"]),  # [] = any policy (astra.scopes)
        "serial": f"{cert.serial_number:x}",
        **_revocation_list(material),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "expires_in_days": round(expires_in_s(pem["cert"]) / 86400, 1),
        "signed_by_ca": signed,
        "usable": not problem,
    }
    if problem:
        out["problem"] = problem
    click.echo(json.dumps(out, indent=2))
    if problem:
        raise SystemExit(1)


def _revocation_list(material) -> dict[str, object]:
    """What `show` prints of the credential's revocation list, where it has one."""
    if material is None or not material.crl:
        return {}
    import datetime

    due = material.crl_next_update
    return {
        "revocation_list": {
            "path": material.crl,
            "revoked": len(material.revoked),
            "next_update": datetime.datetime.fromtimestamp(due, datetime.UTC).isoformat()
            if due
            else None,
        }
    }
