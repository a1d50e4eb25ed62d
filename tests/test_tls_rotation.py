"""Certificates renewed under a running server (astra.tls.TlsFiles, servers.runtime): the next
handshake shows the new certificate, a CA file that gains a second CA lets that CA's clients in,
and files caught half-written leave the credentials in use as they are. Real handshakes on
loopback, a server in this process."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astra import tls
from astra.clients.channel import channel_credentials
from astra.servers.runtime import GrpcServer
from astra.tls_certs import init_ca, issue


@pytest.fixture
def node(tmp_path: Path, monkeypatch) -> Path:
    """A run's CA with a loopback credential beside it, named by ASTRA_TLS_DIR; files looked at
    again on every handshake."""
    d = tmp_path / "tls"
    init_ca(d)
    issue(d, d, ["127.0.0.1"])
    monkeypatch.setenv("ASTRA_TLS_DIR", str(d))
    monkeypatch.setattr(tls, "RECHECK_S", 0.0)
    return d


def _serial(pem_or_der: bytes) -> int:
    if pem_or_der.startswith(b"-----"):
        return x509.load_pem_x509_certificate(pem_or_der).serial_number
    return x509.load_der_x509_certificate(pem_or_der).serial_number


def _shown(port: int, client: Path, ca: Path) -> int:
    """The serial of the certificate the server shows a client holding `client`'s credential."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(str(ca / "ca.pem"))
    ctx.load_cert_chain(str(client / "cert.pem"), str(client / "key.pem"))
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        ctx.wrap_socket(sock, server_hostname="127.0.0.1") as conn,
    ):
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return _serial(der)


async def _health(address: str, client: Path, ca: Path) -> bool:
    """A health check over a new channel with `client`'s credential; False if refused."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=(ca / "ca.pem").read_bytes(),
        private_key=(client / "key.pem").read_bytes(),
        certificate_chain=(client / "cert.pem").read_bytes(),
    )
    async with grpc.aio.secure_channel(address, creds) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
            return False
    return True


def test_a_running_server_takes_renewed_certificates(node: Path, tmp_path: Path, caplog) -> None:
    async def main() -> None:
        server = GrpcServer("127.0.0.1", 0)
        await server.start()
        try:
            first = _serial((node / "cert.pem").read_bytes())
            assert await asyncio.to_thread(_shown, server.port, node, node) == first

            # Renewed in place (astra tls issue writes the key, then the certificate).
            issue(node, node, ["127.0.0.1"])
            renewed = _serial((node / "cert.pem").read_bytes())
            assert renewed != first
            assert await asyncio.to_thread(_shown, server.port, node, node) == renewed
            assert await _health(server.address, node, node)
            # A channel opened now uses the new files too.
            assert tls.current_tls().cert == (node / "cert.pem").read_bytes()  # type: ignore[union-attr]
            assert channel_credentials(tls.current_tls()) is not None  # type: ignore[arg-type]

            # Caught half-written: a key that is not the certificate's. The server goes on
            # showing the renewed certificate, and says why once.
            good_key = (node / "key.pem").read_bytes()
            other = tmp_path / "other"
            issue(node, other, ["127.0.0.1"])
            (node / "key.pem").write_bytes((other / "key.pem").read_bytes())
            with caplog.at_level(logging.WARNING, logger="astra.tls"):
                for _ in range(3):
                    assert await asyncio.to_thread(_shown, server.port, other, node) == renewed
            said = [
                r.getMessage() for r in caplog.records if "cannot be used yet" in r.getMessage()
            ]
            assert len(said) == 1 and "is not the key of the certificate" in said[0], said
            (node / "key.pem").write_bytes(good_key)

            # A second CA in the CA file: its clients get in, the first CA's still do.
            second = tmp_path / "second"
            init_ca(second)
            issue(second, second, ["127.0.0.1"])
            assert not await _health(server.address, second, node)
            bundle = (node / "ca.pem").read_bytes() + (second / "ca.pem").read_bytes()
            (node / "ca.pem").write_bytes(bundle)
            assert await _health(server.address, second, node)
            assert await _health(server.address, node, node)
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_tls_files_read_again_only_when_changed_and_usable(node: Path, tmp_path: Path) -> None:
    files = tls.TlsFiles()
    first = files.refresh()
    assert first is files.material and files.reloads == 0
    assert files.refresh() is first  # nothing changed: the same material, not read again
    (node / "cert.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\ntruncated")
    assert files.refresh() is first and files.reloads == 0
    issue(node, node, ["127.0.0.1"])
    again = files.refresh()
    assert again is not first and files.reloads == 1
    assert again is not None and again.cert == (node / "cert.pem").read_bytes()
    stranger = tmp_path / "stranger"
    init_ca(stranger)
    issue(stranger, stranger, ["127.0.0.1"])
    for name in ("key.pem", "cert.pem"):  # a whole credential, but of another CA
        (node / name).write_bytes((stranger / name).read_bytes())
    assert files.refresh() is again
    assert files._refused == tls._stamp(files.watched)  # seen, and refused
    with pytest.raises(tls.TlsConfigError, match="was not issued by the CA"):
        tls.load_tls()


def test_a_certificate_chain_through_an_intermediate_ca_is_accepted(tmp_path: Path) -> None:
    """A site PKI: ca.pem the root, cert.pem the node's certificate then the intermediate that
    signed it. The issued-by check follows the chain instead of refusing it."""
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, signer, *, ca: bool):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            ip = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
            b = b.add_extension(x509.SubjectAlternativeName([ip]), critical=False)
        return b.sign(signer, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    root_key, mid_key, leaf_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    d = tmp_path / "site"
    d.mkdir()
    (d / "ca.pem").write_bytes(cert("root", root_key, "root", root_key, ca=True))
    mid = cert("intermediate", mid_key, "root", root_key, ca=True)
    leaf = cert("node", leaf_key, "intermediate", mid_key, ca=False)
    (d / "key.pem").write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (d / "cert.pem").write_bytes(leaf)
    with pytest.raises(tls.TlsConfigError, match="was not issued by the CA"):
        tls.load_tls({"ASTRA_TLS_DIR": str(d)})  # the intermediate missing
    (d / "cert.pem").write_bytes(leaf + mid)
    assert tls.load_tls({"ASTRA_TLS_DIR": str(d)}) is not None
    # A full chain of another CA: its root rides along in cert.pem but is not in ca.pem.
    other = tmp_path / "other"
    init_ca(other)
    issue(other, other, ["127.0.0.1"])
    for name in ("cert.pem", "key.pem"):
        (d / name).write_bytes((other / name).read_bytes())
    with (d / "cert.pem").open("ab") as f:
        f.write((other / "ca.pem").read_bytes())
    with pytest.raises(tls.TlsConfigError, match="was not issued by the CA"):
        tls.load_tls({"ASTRA_TLS_DIR": str(d)})


def test_expired_certificates_stop_at_once_and_ending_ones_are_warned(tmp_path, caplog) -> None:
    ca = tmp_path / "ca"
    init_ca(ca)
    issue(ca, tmp_path / "ended", ["127.0.0.1"], days=0)
    with pytest.raises(tls.TlsConfigError, match=r"expired on .* issue a new one"):
        tls.load_tls({"ASTRA_TLS_DIR": str(tmp_path / "ended")})
    issue(ca, tmp_path / "soon", ["127.0.0.1"], days=10)
    issue(ca, tmp_path / "fine", ["127.0.0.1"], days=365)
    with caplog.at_level(logging.WARNING, logger="astra.tls"):
        soon = tls.TlsFiles({"ASTRA_TLS_DIR": str(tmp_path / "soon")})
        tls.TlsFiles({"ASTRA_TLS_DIR": str(tmp_path / "fine")})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and re.search(r"expires in (9\.9|10\.0) days", said[0]), said
    assert str(tmp_path / "soon") in said[0]
    assert (
        soon.material is not None and 9 * 86400 < tls.expires_in_s(soon.material.cert) <= 10 * 86400
    )


def test_tls_show_prints_hosts_and_days_left_and_refuses_a_broken_directory(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from astra.cli import main

    d = tmp_path / "node"
    init_ca(d)
    issue(d, d, ["127.0.0.1", "node-a"], days=20)
    res = CliRunner().invoke(main, ["tls", "show", str(d)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["hosts"] == ["127.0.0.1", "node-a"] and out["signed_by_ca"] is True
    assert 19.9 <= out["expires_in_days"] <= 20.0
    other = tmp_path / "other"
    init_ca(other)
    (d / "ca.pem").write_bytes((other / "ca.pem").read_bytes())
    res = CliRunner().invoke(main, ["tls", "show", str(d)])
    assert res.exit_code == 1, res.output
    out = json.loads(res.output)
    assert out["signed_by_ca"] is False and not out["usable"]
    assert "was not issued by the CA" in out["problem"]
    # Expired: still shown (what is to be replaced), not usable.
    ended = tmp_path / "ended"
    issue(other, ended, ["127.0.0.1"], days=0)
    res = CliRunner().invoke(main, ["tls", "show", str(ended)])
    out = json.loads(res.output)
    assert res.exit_code == 1 and out["signed_by_ca"] and "expired" in out["problem"]
    assert out["expires_in_days"] <= 0
    res = CliRunner().invoke(main, ["tls", "show", str(tmp_path)])  # no credential there
    assert res.exit_code == 2


def test_a_runs_own_credentials_are_made_again_when_about_to_end(tmp_path, monkeypatch) -> None:
    """`tls: true` on a resume: a node certificate within 30 days of its end is issued again
    from the run's CA; a CA about to end is replaced, with the node credentials under it."""
    from astra.run.cli import _tls
    from astra.tls_certs import child_credential, expiring

    for name in ("ASTRA_TLS_DIR", "ASTRA_TLS_NODE_CA"):
        monkeypatch.setenv(name, "")  # restored after the test (_tls sets them)
    root = tmp_path / "run"
    d = root / "tls"
    init_ca(d)
    issue(d, d, ["127.0.0.1"], days=10)
    node = child_credential(d, "raas", "10.0.0.7")
    ca_before = (d / "ca.pem").read_bytes()
    assert expiring(d / "cert.pem") and not expiring(node / "cert.pem")
    _tls(True, root)
    assert not expiring(d / "cert.pem") and (d / "ca.pem").read_bytes() == ca_before
    assert tls.load_tls({"ASTRA_TLS_DIR": str(d)}) is not None

    monkeypatch.setenv("ASTRA_TLS_DIR", "")
    (d / "ca.key").unlink()
    (d / "ca.pem").unlink()
    init_ca(d, days=5)  # a CA about to end
    issue(d, d, ["127.0.0.1"])
    _tls(True, root)
    assert (d / "ca.pem").read_bytes() != ca_before and not expiring(d / "ca.pem")
    assert not (d / "nodes").exists()  # issued again from the new CA as children are placed
    assert tls.load_tls({"ASTRA_TLS_DIR": str(d)}) is not None
