"""Certificate revocation: a certificate the CA's revocation list names is refused by servers.

Real certificates and CRLs from astra.tls_certs / astra.tls_crl, real handshakes to in-process
servers on loopback. What must hold: once `astra tls revoke` lists a certificate, every call
its holder makes (any roles, none, any RPC shape) gets UNAUTHENTICATED with ErrorInfo reason
CERTIFICATE_REVOKED, before the handler takes anything, within a second and without a restart;
others keep being served; /metrics closes on it too; a list another CA signed is never used;
a node does not start on a revoked certificate of its own.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astra import tls
from astra.cli import main
from astra.dataflow.v1 import dataflow_service_pb2 as df_pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as df_grpc
from astra.tls import TlsFiles, load_tls
from astra.tls_certs import child_credential, init_ca, issue
from astra.tls_crl import revoke, serial_of
from astra.tls_material import TlsConfigError
from astra.weights.v1 import weight_service_pb2 as w_pb
from astra.weights.v1 import weight_service_pb2_grpc as w_grpc
from tests.conftest import error_info, make_config, running_dataflow
from tests.test_dataflow_service import register_request
from tests.test_tls_roles import channel, ended, scrape_refused
from tests.test_weights_service import serving

REVOKED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture
def ca(tmp_path, monkeypatch) -> Path:
    """The run's CA; servers use its role-less credential (whose crl.pem is the CA's own)."""
    monkeypatch.setattr(tls, "RECHECK_S", 0.0)
    d = tmp_path / "tls"
    init_ca(d)
    issue(d, d, ["127.0.0.1"])
    for name, roles in [("raas", ["raas"]), ("trainer", ["trainer"]), ("operator", [])]:
        issue(d, tmp_path / name, ["127.0.0.1"], roles=roles)
    monkeypatch.setenv("ASTRA_TLS_DIR", str(d))
    return d


def cli(*args: str):
    return CliRunner().invoke(main, ["tls", *args])


async def code_of(result) -> grpc.StatusCode:
    """How a call ends; a revocation is checked to carry its ErrorInfo."""
    exc = await ended(result)
    if exc is None:
        return grpc.StatusCode.OK
    if exc.code() is REVOKED:
        info, _ = error_info(exc)
        assert info is not None and info.reason == "CERTIFICATE_REVOKED", exc
        assert info.metadata["serial"] in exc.details() and info.metadata["method"]
    return exc.code()


def test_a_revoked_certificate_is_refused_at_its_next_call(dataset, tmp_path, ca) -> None:
    async def main_() -> None:
        config = make_config(dataset, tmp_path / "state", metrics_port=0)
        async with running_dataflow(config) as (server, df, _):
            chans = {w: channel(server.address, tmp_path / w) for w in ("raas", "trainer")}
            chans["operator"] = channel(server.address, tmp_path / "operator")
            chans["server"] = channel(server.address, ca)
            stub = {w: df_grpc.DataflowServiceStub(c) for w, c in chans.items()}
            get = df_pb.GetStatusRequest()
            try:
                for who in stub:
                    assert await code_of(stub[who].GetStatus(get)) is grpc.StatusCode.OK
                res = cli("revoke", str(ca), str(tmp_path / "raas" / "cert.pem"))
                assert res.exit_code == 0, res.output
                raas_serial = f"{serial_of((tmp_path / 'raas' / 'cert.pem').read_bytes()):x}"
                assert json.loads(res.output)["added"] == [raas_serial]
                # Open channels, no restart: the next call is refused, whatever it is.
                register = stub["raas"].RegisterInstance(register_request(instance_id="r1"))
                assert await code_of(register) is REVOKED
                assert await code_of(stub["raas"].GetStatus(get)) is REVOKED
                # A role-less (operator's) certificate is refused too, once listed.
                res = cli("revoke", str(ca), str(tmp_path / "operator" / "cert.pem"))
                assert res.exit_code == 0, res.output
                assert await code_of(stub["operator"].GetStatus(get)) is REVOKED
                req = register_request(instance_id="r-op")
                assert await code_of(stub["operator"].RegisterInstance(req)) is REVOKED
                # Others are served; nothing a refused call carried was taken.
                assert await code_of(stub["trainer"].GetStatus(get)) is grpc.StatusCode.OK
                status = await stub["server"].GetStatus(get)
                assert [i.instance_id for i in status.instances] == []
                # Health checking stays open to every certificate of the CA, as documented.
                check = health_pb2_grpc.HealthStub(chans["raas"]).Check
                assert (await check(health_pb2.HealthCheckRequest())).status == 1
                # Counted under "revoked"; /metrics closes on a revoked certificate.
                refused = await asyncio.to_thread(scrape_refused, df.metrics_port, ca)
                name = "/astra.dataflow.v1.DataflowService/GetStatus"
                assert refused[(name, "revoked")] == 2, refused
                assert sum(refused.values()) == server.roles.refused == 4
                with pytest.raises(OSError):
                    await asyncio.to_thread(scrape_refused, df.metrics_port, tmp_path / "raas")
            finally:
                for c in chans.values():
                    await c.close()

    asyncio.run(asyncio.wait_for(main_(), 60))


def test_a_revoked_receiver_cannot_open_a_fetch_stream(tmp_path, ca) -> None:
    """The bidirectional shape: refused before the handler reads the stream's first message."""

    async def one():
        yield w_pb.FetchVersionRequest()

    async def main_() -> None:
        async with (
            serving(tmp_path / "store") as server,
            channel(server.address, tmp_path / "raas") as ch,
        ):
            stub = w_grpc.WeightServiceStub(ch)
            assert await code_of(stub.FetchVersion(one())) is not REVOKED
            revoke(ca, certs=[tmp_path / "raas" / "cert.pem"])
            assert await code_of(stub.FetchVersion(one())) is REVOKED
            listed = stub.ListVersions(w_pb.ListVersionsRequest(policy_id="p"))
            assert await code_of(listed) is REVOKED

    asyncio.run(asyncio.wait_for(main_(), 60))


def test_a_refused_stream_ends_after_its_first_message_within_a_bound(tmp_path, ca) -> None:
    """A refusal at a stream's start waits for the caller's first write (gRPC Python ends a
    call whose write races its end with INTERNAL, losing the refusal: grpc/grpc#36066), for at
    most FIRST_MESSAGE_WAIT_S: a caller that never writes is refused all the same."""
    from astra.servers.errors import FIRST_MESSAGE_WAIT_S

    async def main_() -> None:
        async with (
            serving(tmp_path / "store") as server,
            channel(server.address, tmp_path / "raas") as ch,
        ):
            stub = w_grpc.WeightServiceStub(ch)
            revoke(ca, certs=[tmp_path / "raas" / "cert.pem"])
            call = stub.FetchVersion()
            await asyncio.sleep(FIRST_MESSAGE_WAIT_S / 3)
            assert not call.done()  # still waiting for the first message
            await call.write(w_pb.FetchVersionRequest())
            assert await code_of(call) is REVOKED

            started = asyncio.get_running_loop().time()
            silent = stub.FetchVersion()
            assert await code_of(silent) is REVOKED
            took = asyncio.get_running_loop().time() - started
            assert FIRST_MESSAGE_WAIT_S * 0.9 <= took < FIRST_MESSAGE_WAIT_S + 5

    asyncio.run(asyncio.wait_for(main_(), 60))


def test_a_list_is_used_only_from_the_ca_that_issued_the_certificates(tmp_path, ca) -> None:
    """Its own CA's list is read, and read again; a forged one (the CA's name, another key)
    is refused; the list of a CA ca.pem does not trust (after a move to a new CA) is not
    used; none of them stops a renewed certificate from being taken up, and what the list in
    use revokes stays revoked until a newer list of the same CA says otherwise."""
    ca_name = x509.load_pem_x509_certificate((ca / "ca.pem").read_bytes()).subject
    forger, other = tmp_path / "forger", tmp_path / "other"
    init_ca(forger, name=ca_name.rfc4514_string().removeprefix("CN="))
    init_ca(other)  # a name of its own
    raas_cert = tmp_path / "raas" / "cert.pem"
    serial = serial_of(raas_cert.read_bytes())
    files = TlsFiles({"ASTRA_TLS_DIR": str(ca)})
    assert files.material is not None and files.material.revoked == frozenset()
    revoke(ca, certs=[raas_cert])
    assert files.refresh().revoked == {serial}
    good = (ca / "crl.pem").read_bytes()
    # A forged list: refused at start; on a refresh the list in use stays, and a certificate
    # renewed meanwhile is still taken up.
    revoke(forger, serials=[serial + 1])
    shutil.copy(forger / "crl.pem", ca / "crl.pem")
    with pytest.raises(TlsConfigError, match="not signed by the CA"):
        load_tls({"ASTRA_TLS_DIR": str(ca)})
    before = files.material.cert
    issue(ca, ca, ["127.0.0.1"], name="renewed")
    renewed = files.refresh()
    assert renewed.cert == (ca / "cert.pem").read_bytes() != before
    assert renewed.revoked == {serial} and "not signed" in renewed.crl_note
    # The list of a CA that ca.pem does not trust: not used (its certificates cannot connect).
    revoke(other, serials=[serial + 2])
    shutil.copy(other / "crl.pem", ca / "crl.pem")
    fresh = load_tls({"ASTRA_TLS_DIR": str(ca)})
    assert fresh.revoked == frozenset() and "does not trust" in fresh.crl_note
    assert files.refresh().revoked == {serial}  # a running process keeps what it revoked
    # An older list of the same CA, and no list at all: the newer revocations stay.
    (ca / "crl.pem").write_bytes(good)  # number 1: the raas certificate alone
    revoke(ca, serials=[serial + 3])  # number 2
    older = good
    assert files.refresh().revoked == {serial, serial + 3}
    (ca / "crl.pem").write_bytes(older)
    kept = files.refresh()
    assert kept.revoked == {serial, serial + 3} and "older list" in kept.crl_note
    (ca / "crl.pem").unlink()
    assert files.refresh().revoked == {serial, serial + 3}
    assert load_tls({"ASTRA_TLS_DIR": str(ca)}).revoked == frozenset()  # a restart: none
    # Nor can `revoke` add a certificate another CA issued, or extend another CA's list.
    issue(other, tmp_path / "stranger", ["127.0.0.1"])
    res = cli("revoke", str(ca), str(tmp_path / "stranger" / "cert.pem"))
    assert res.exit_code == 2 and "not issued by the CA" in res.output
    shutil.copy(forger / "crl.pem", ca / "crl.pem")
    with pytest.raises(TlsConfigError, match="not signed by the CA"):
        revoke(ca, serials=[7])
    # A list that is not a CRL, and ASTRA_TLS_CRL naming a file that is not there.
    (ca / "crl.pem").write_text("-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n")
    with pytest.raises(TlsConfigError, match=r"crl\.pem"):
        load_tls({"ASTRA_TLS_DIR": str(ca)})
    missing = {"ASTRA_TLS_DIR": str(tmp_path / "raas"), "ASTRA_TLS_CRL": str(tmp_path / "no.pem")}
    with pytest.raises(TlsConfigError, match="ASTRA_TLS_CRL"):
        load_tls(missing)


def test_a_caller_whose_certificate_cannot_be_read_is_refused_once_a_list_holds_any() -> None:
    from astra.errors import Unauthenticated
    from astra.servers.authz import RoleGuard

    class Context:
        def peer(self) -> str:
            return "ipv4:127.0.0.1:1"

    guard = RoleGuard()
    with pytest.raises(Unauthenticated) as refused:
        guard._check_serial("/m", guard._serial(b""), frozenset({5}), Context())
    assert refused.value.metadata["serial"] == "unreadable"


def test_revoke_cli_keeps_the_list_and_openssl_reads_it(tmp_path, ca) -> None:
    certs = [tmp_path / w / "cert.pem" for w in ("raas", "trainer")]
    first = json.loads(cli("revoke", str(ca), str(certs[0])).output)
    again = cli(
        "revoke", str(ca), str(certs[0]), "--serial", f"{serial_of(certs[1].read_bytes()):X}"
    )
    assert again.exit_code == 0, again.output
    second = json.loads(again.output)
    assert (first["crl_number"], second["crl_number"]) == (1, 2)
    serials = [f"{n:x}" for n in sorted(serial_of(c.read_bytes()) for c in certs)]  # by value
    assert second["revoked"] == serials  # the one listed before stays listed, once
    assert second["added"] == [f"{serial_of(certs[1].read_bytes()):x}"]
    assert load_tls({"ASTRA_TLS_DIR": str(ca)}).revoked == {int(s, 16) for s in serials}
    # Nothing named: the list signed again (a new nextUpdate), what it revokes kept.
    renewed = json.loads(cli("revoke", str(ca), "--days", "60").output)
    assert renewed["crl_number"] == 3 and renewed["revoked"] == serials and not renewed["added"]
    assert renewed["next_update"] > second["next_update"]
    shown = json.loads(cli("show", str(ca)).output)["revocation_list"]
    assert shown["path"] == str(ca / "crl.pem") and shown["revoked"] == 2
    assert shown["next_update"][:19] == renewed["next_update"][:19]  # a CRL keeps seconds
    assert "revocation_list" not in json.loads(cli("show", str(tmp_path / "operator")).output)
    other = tmp_path / "fresh-ca"
    init_ca(other)
    assert cli("revoke", str(other)).exit_code == 2  # nothing named, and no list to renew
    assert cli("revoke", str(ca), "--serial", "xyz").exit_code == 2
    # A standard CRL: OpenSSL verifies its signature against the CA and lists the serials.
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to cross-check the CRL with")
    out = subprocess.run(
        ["openssl", "crl", "-in", str(ca / "crl.pem"), "-CAfile", str(ca / "ca.pem"), "-text"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "verify OK" in out.stderr + out.stdout
    listed = out.stdout.upper().replace(":", "")
    assert all(s.upper().lstrip("0") in listed for s in serials)


def test_a_node_does_not_start_on_its_own_revoked_certificate(tmp_path, ca) -> None:
    node = tmp_path / "raas"
    revoke(ca, certs=[node / "cert.pem"])
    shutil.copy(ca / "crl.pem", node / "crl.pem")  # the operator's copy to the node
    with pytest.raises(TlsConfigError, match="is revoked"):
        TlsFiles({"ASTRA_TLS_DIR": str(node)})
    shown = cli("show", str(node))
    assert shown.exit_code == 1 and "revoked" in json.loads(shown.output)["problem"]
    # A new node credential starts with the CA's list; the trainer's is still usable.
    issue(ca, tmp_path / "new", ["127.0.0.1"])
    assert (tmp_path / "new" / "crl.pem").read_bytes() == (ca / "crl.pem").read_bytes()
    assert TlsFiles({"ASTRA_TLS_DIR": str(tmp_path / "new")}).material is not None
    assert cli("show", str(tmp_path / "trainer")).exit_code == 0


def test_a_runs_child_credentials_follow_the_runs_list(tmp_path, ca) -> None:
    child = child_credential(ca, "raas")
    files = TlsFiles({"ASTRA_TLS_DIR": str(child)})
    assert files.material.revoked == frozenset()  # no list yet: the link dangles
    trainer = child_credential(ca, "trainer")
    revoke(ca, certs=[trainer / "cert.pem"])
    assert files.refresh().revoked == {serial_of((trainer / "cert.pem").read_bytes())}
    assert child_credential(ca, "raas") == child  # called again: the link stays a link
    assert (child / "crl.pem").is_symlink()


def test_a_list_past_its_next_update_still_revokes_and_is_warned_of(tmp_path, ca, caplog) -> None:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    serial = serial_of((tmp_path / "raas" / "cert.pem").read_bytes())
    key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), None)
    issuer = x509.load_pem_x509_certificate((ca / "ca.pem").read_bytes()).subject
    now = datetime.datetime.now(datetime.UTC)
    entry = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
    stale = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer)
        .last_update(now - datetime.timedelta(days=40))
        .next_update(now - datetime.timedelta(days=10))
        .add_revoked_certificate(entry)
        .sign(key, hashes.SHA256())
    )
    (ca / "crl.pem").write_bytes(stale.public_bytes(serialization.Encoding.PEM))
    with caplog.at_level("WARNING", logger="astra.tls"):
        files = TlsFiles({"ASTRA_TLS_DIR": str(ca)})
    assert files.material.revoked == {serial}  # still what it revokes
    assert any("past its nextUpdate" in r.getMessage() for r in caplog.records), caplog.text
    renewed = json.loads(cli("revoke", str(ca)).output)
    assert renewed["revoked"] == [f"{serial:x}"]
    assert files.refresh().crl_next_update > now.timestamp()


def test_a_stream_open_when_its_certificate_is_revoked_ends_at_its_next_message(
    tmp_path, ca
) -> None:
    """A weight fetch under way (16 MB in 64 KiB chunks: far more than the stream's flow
    control lets the service send ahead): after `revoke`, the next message the service sends
    ends it with UNAUTHENTICATED; it never reaches its end."""
    from astra.clients.weights_stream import publish_version
    from astra.servers.weights_fetch import StreamSettings
    from tests.test_weights_store import chain_of

    (model,) = chain_of(1, seed=5, size=1 << 21)

    async def main_() -> None:
        async with serving(tmp_path / "store", StreamSettings(chunk_bytes=64 << 10)) as server:
            await publish_version(server.address, "p", "v0", 0, model)
            queue: asyncio.Queue = asyncio.Queue()

            async def requests():
                while (message := await queue.get()) is not None:
                    yield message

            async with channel(server.address, tmp_path / "raas") as ch:
                call = w_grpc.WeightServiceStub(ch).FetchVersion(requests())
                start = w_pb.FetchStart(policy_id="p", receiver_id="r")
                await queue.put(w_pb.FetchVersionRequest(start=start))
                first = await call.read()
                assert first.WhichOneof("part") == "plan", first
                revoke(ca, certs=[tmp_path / "raas" / "cert.pem"])
                parts = []
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    while (message := await call.read()) is not grpc.aio.EOF:
                        parts.append(message.WhichOneof("part"))
                assert ended.value.code() is REVOKED, ended.value
                assert error_info(ended.value)[0].reason == "CERTIFICATE_REVOKED"
                assert "done" not in parts, parts  # cut, not finished
                await queue.put(None)

    asyncio.run(asyncio.wait_for(main_(), 60))


def test_a_request_stream_checks_every_message_after_the_first() -> None:
    """What the interceptor hands a client- or bidirectional-streaming handler: the first
    message goes through the policy check, each later one through the revocation check."""
    from astra.errors import Unauthenticated
    from astra.servers.errors import _ParsedRequests

    seen: list[str] = []
    revoked = {"now": False}

    def each() -> None:
        seen.append("each")
        if revoked["now"]:
            raise Unauthenticated("revoked", reason="CERTIFICATE_REVOKED")

    async def messages():
        for m in ("a", "b", "c"):
            yield m

    async def main_() -> list[str]:
        stream = _ParsedRequests(messages(), lambda m: seen.append(f"first {m}"), each)
        got = [await anext(stream), await anext(stream)]
        revoked["now"] = True
        with pytest.raises(Unauthenticated):
            await anext(stream)
        return got

    assert asyncio.run(main_()) == ["a", "b"]
    assert seen == ["first a", "each", "each"]
