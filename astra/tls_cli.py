"""`astra tls init|issue|show`: the run's CA and node credentials for mutual TLS."""

from __future__ import annotations

import json
from pathlib import Path

import click

from astra.tls import ENV_DIR, TlsConfigError


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
def issue_command(
    ca_dir: Path, out_dir: Path, hosts: tuple[str, ...], name: str, days: int
) -> None:
    """Write a node credential signed by the CA in CA_DIR into OUT_DIR (ca.pem, cert.pem,
    key.pem: what ASTRA_TLS_DIR names on that node)."""
    from astra.tls_certs import DEFAULT_HOSTS, issue

    try:
        issue(ca_dir, out_dir, list(hosts or DEFAULT_HOSTS), name=name, days=days)
    except TlsConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(json.dumps({ENV_DIR: str(out_dir)}))


@tls.command("show")
@click.argument("directory", type=click.Path(file_okay=False, exists=True, path_type=Path))
def show_command(directory: Path) -> None:
    """Check a credential directory and print what its certificate is valid for."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    from astra.tls import expires_in_s, load_tls

    try:
        material = load_tls({ENV_DIR: str(directory)})
    except TlsConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    assert material is not None
    cert = x509.load_pem_x509_certificate(material.cert)
    ca = x509.load_pem_x509_certificate(material.ca)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = [str(v) for v in sans.get_values_for_type(x509.IPAddress)]
        hosts += sans.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        hosts = []
    try:
        cert.verify_directly_issued_by(ca)
        signed = True
    except (InvalidSignature, ValueError, TypeError):
        signed = False
    out = {
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "hosts": hosts,
        "not_after": cert.not_valid_after_utc.isoformat(),
        "expires_in_days": round(expires_in_s(material) / 86400, 1),
        "signed_by_ca": signed,
    }
    click.echo(json.dumps(out, indent=2))
    if not signed:
        raise SystemExit(1)
