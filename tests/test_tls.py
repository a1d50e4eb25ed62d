"""Mutual TLS between Astra's services: real certificates, real handshakes on loopback.

A run's CA and node credentials come from `astra tls init` / `issue`; a process uses them
when ASTRA_TLS_DIR (or the three ASTRA_TLS_* files) names them. What must hold: with TLS on,
only a client with a certificate of the run's CA gets through (plaintext, another CA, no
client certificate and a certificate for another host all fail), and a whole run (Dataflow,
RaaS registering and being dispatched to, a trainer fetching) works over it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from astra.clients.dataflow import DataflowClient
from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as pb_grpc
from astra.tls import load_tls
from astra.tls_certs import cert_policies, cert_roles, init_ca, issue
from astra.tls_material import TlsConfigError, tls_paths
from tests.conftest import make_config
from tests.procs import start_dataflow, start_scripted_raas

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


@pytest.fixture
def run_ca(tmp_path) -> Path:
    """The run's CA with a node credential for loopback in the same directory."""
    ca = tmp_path / "tls"
    init_ca(ca)
    issue(ca, ca, ["127.0.0.1", "localhost"])
    return ca


def _astra(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "astra.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_settings_errors_name_the_variable(tmp_path, run_ca):
    assert tls_paths({}) is None and load_tls({}) is None
    with pytest.raises(TlsConfigError, match="ASTRA_TLS_DIR and ASTRA_TLS_CA are both set"):
        tls_paths({"ASTRA_TLS_DIR": str(run_ca), "ASTRA_TLS_CA": "x"})
    with pytest.raises(TlsConfigError, match="ASTRA_TLS_CERT, ASTRA_TLS_KEY not set"):
        tls_paths({"ASTRA_TLS_CA": str(run_ca / "ca.pem")})
    with pytest.raises(
        TlsConfigError, match=r"ASTRA_TLS_DIR: cannot read the ca file .*nowhere/ca.pem"
    ):
        load_tls({"ASTRA_TLS_DIR": str(tmp_path / "nowhere")})
    (tmp_path / "bad.pem").write_text("not a certificate")
    files = {
        "ASTRA_TLS_CA": str(tmp_path / "bad.pem"),
        "ASTRA_TLS_CERT": str(run_ca / "cert.pem"),
        "ASTRA_TLS_KEY": str(run_ca / "key.pem"),
    }
    with pytest.raises(TlsConfigError, match=r"ASTRA_TLS_CA: .*bad.pem is not PEM"):
        load_tls(files)
    other = tmp_path / "other"
    init_ca(other)
    issue(other, other, ["127.0.0.1"])
    mixed = {
        **files,
        "ASTRA_TLS_CA": str(run_ca / "ca.pem"),
        "ASTRA_TLS_KEY": str(other / "key.pem"),
    }
    with pytest.raises(TlsConfigError, match="is not the key of the certificate"):
        load_tls(mixed)
    assert load_tls({**files, "ASTRA_TLS_CA": str(run_ca / "ca.pem")}).cert.startswith(b"-----")
    with pytest.raises(TlsConfigError, match="a CA is there already"):
        init_ca(run_ca)
    with pytest.raises(TlsConfigError, match="not HOST:PORT"):
        issue(run_ca, tmp_path / "port", ["10.0.0.1:50051"])
    _strict_handshake(run_ca)


def _strict_handshake(ca: Path) -> None:
    """A TLS handshake in memory whose client verifies strictly (VERIFY_X509_STRICT, Python
    3.13's default, wants the key identifiers), checking the host name 127.0.0.1."""
    import ssl

    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(ca / "cert.pem", ca / "key.pem")
    client_ctx = ssl.create_default_context(cafile=str(ca / "ca.pem"))
    client_ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    bios = [ssl.MemoryBIO() for _ in range(4)]
    server = server_ctx.wrap_bio(bios[0], bios[1], server_side=True)
    client = client_ctx.wrap_bio(bios[2], bios[3], server_hostname="127.0.0.1")
    done = set()
    for _ in range(10):
        for name, end, out, into in (
            ("c", client, bios[3], bios[0]),
            ("s", server, bios[1], bios[2]),
        ):
            try:
                end.do_handshake()
                done.add(name)
            except ssl.SSLWantReadError:
                pass
            into.write(out.read())
        if done == {"c", "s"}:
            return
    raise AssertionError("the strict handshake did not complete")
    assert (run_ca / "key.pem").stat().st_mode & 0o077 == 0  # keys readable by their owner only
    assert (run_ca / "ca.key").stat().st_mode & 0o077 == 0


async def _status_over(address: str, credentials: grpc.ChannelCredentials | None, name: str = ""):
    options = [("grpc.ssl_target_name_override", name)] if name else []
    if credentials is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        channel = grpc.aio.secure_channel(address, credentials, options=options)
    async with channel:
        stub = pb_grpc.DataflowServiceStub(channel)
        return await stub.GetStatus(pb.GetStatusRequest(), timeout=5)


def _creds(directory: Path, *, client_cert: bool = True, ca_from: Path | None = None):
    ca = ((ca_from or directory) / "ca.pem").read_bytes()
    if not client_cert:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(directory / "key.pem").read_bytes(),
        certificate_chain=(directory / "cert.pem").read_bytes(),
    )


def test_only_clients_of_the_run_ca_get_through(dataset, tmp_path, run_ca, monkeypatch):
    from astra.servers.dataflow_serve import start_dataflow as start_in_process

    monkeypatch.setenv("ASTRA_TLS_DIR", str(run_ca))
    stranger = tmp_path / "stranger"
    init_ca(stranger)
    issue(stranger, stranger, ["127.0.0.1"])
    elsewhere = tmp_path / "elsewhere"  # the run's CA, but a certificate for another host
    issue(run_ca, elsewhere, ["10.11.12.13"])

    async def main() -> None:
        server, df, _ = await start_in_process(make_config(dataset, tmp_path / "state"))
        try:
            assert server.tls
            # Astra's own client, configured by the environment.
            async with DataflowClient(server.address) as client:
                assert (await client.get_status()).pool_empty
            # The same credentials by hand, and the DNS name the certificate also carries.
            assert (await _status_over(server.address, _creds(run_ca))).pool_empty
            assert (await _status_over(server.address, _creds(run_ca), "localhost")).pool_empty
            refused = {
                "plaintext": None,
                "no client certificate": _creds(run_ca, client_cert=False),
                "a client of another CA": _creds(stranger, ca_from=run_ca),
                "a server of another CA": _creds(run_ca, ca_from=stranger),
            }
            for what, creds in refused.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _status_over(server.address, creds)
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE, what
            # The run's CA signed it, but not for 127.0.0.1: the server's name check fails.
            server_for_elsewhere = await _elsewhere_server(elsewhere, monkeypatch)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _status_over(server_for_elsewhere.address, _creds(run_ca))
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            finally:
                await server_for_elsewhere.stop(0)
            # The server kept serving through every refused handshake.
            async with DataflowClient(server.address) as client:
                assert (await client.get_status()).pool_empty
        finally:
            await df.stop()
            await server.stop(0)

    asyncio.run(main())


async def _elsewhere_server(credential: Path, monkeypatch):
    from astra.servers.runtime import GrpcServer

    monkeypatch.setenv("ASTRA_TLS_DIR", str(credential))
    server = GrpcServer("127.0.0.1", 0)
    await server.start()
    return server


@pytest.mark.slow
def test_a_run_over_mutual_tls(dataset, tmp_path, run_ca, monkeypatch):
    """Dataflow and a RaaS as processes under TLS: the RaaS registers, groups are dispatched
    and collected, a trainer fetches them; grpcurl and `astra status` need the credentials."""
    monkeypatch.setenv("ASTRA_TLS_DIR", str(run_ca))
    config = make_config(dataset, tmp_path / "state")
    df = start_dataflow(config, tmp_path)
    raas = None
    try:
        raas = start_scripted_raas(df.address, tmp_path, "r1")

        async def fetch() -> list:
            async with DataflowClient(df.address, timeout_s=5.0) as client:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        header, trajectories, _ = await client.fetch_batch(
                            "policy", 2, "tls-1", max_wait_s=1.0, timeout_s=5.0
                        )
                        await client.ack_batch(header.batch_id)
                        return trajectories
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                            raise
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.2)

        trajectories = asyncio.run(fetch())
        assert len({t.group_id for t in trajectories}) == 2
        assert all(len(t.sequences[0].token_ids.data) > 0 for t in trajectories)

        status = _astra(
            "--tls", str(run_ca), "status", "--dataflow", df.address, env={"ASTRA_TLS_DIR": ""}
        )
        assert status.returncode == 0, status.stderr
        instances = json.loads(status.stdout)["instances"]
        assert [i["instance_id"] for i in instances] == ["r1"], instances
        plain = _astra(
            "status", "--dataflow", df.address, "--timeout", "2", env={"ASTRA_TLS_DIR": ""}
        )
        assert plain.returncode == 1 and "pass --tls DIR" in plain.stderr, plain.stderr
        if Path(GRPCURL).exists():
            tls_args = ["-cacert", str(run_ca / "ca.pem"), "-cert", str(run_ca / "cert.pem")]
            tls_args += ["-key", str(run_ca / "key.pem")]
            listed = subprocess.run(
                [GRPCURL, *tls_args, df.address, "list"], capture_output=True, text=True, timeout=30
            )
            assert listed.returncode == 0, listed.stderr
            assert "astra.dataflow.v1.DataflowService" in listed.stdout.split()
            plaintext = subprocess.run(
                [GRPCURL, "-plaintext", "-connect-timeout", "2", df.address, "list"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert plaintext.returncode != 0
    finally:
        if raas is not None:
            raas.signal(signal.SIGTERM)
            raas.wait(15)
            raas.close()
        df.signal(signal.SIGTERM)
        code = df.wait(15)
        df.close()
    assert code == 0, df.log.read_text()[-2000:]


@pytest.mark.slow
def test_astra_run_with_tls_true(runs, monkeypatch):
    """`tls: true`: the run makes its CA, every child serves mutual TLS with a credential
    confined to its role, the run trains and accounts for every group as without TLS, and a
    plaintext client is refused meanwhile. A revocation list that names a certificate none
    of them holds is taken up mid-run: every client then checks its server's certificate
    (clients.revocation), and the run goes on as before."""
    for var in ("ASTRA_TLS_DIR", "ASTRA_TLS_CA", "ASTRA_TLS_CERT", "ASTRA_TLS_KEY"):
        monkeypatch.delenv(var, raising=False)
    run = runs("--set", "tls=true", "--set", "trainer.num_steps=2", "--set", "eval.every_steps=0")
    children = run.wait_for_children({"dataflow"}, 60)
    address = next(c["address"] for c in children if c["role"] == "dataflow")
    credential = run.run_dir / "tls"

    async def probe() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _status_over(address, None)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert (await _status_over(address, _creds(credential))).dataflow_id

    asyncio.run(probe())
    revoked = _astra("tls", "revoke", str(credential), "--serial", "1badc0de")
    assert revoked.returncode == 0, revoked.stderr
    assert run.wait(150) == 0, run.output()
    s = run.summary()
    assert s["status"] == "completed" and s["steps"] == 2
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    assert s["versions_published"] >= 2
    for c in run.children():
        text = (run.run_dir / "logs" / f"{c['name']}.log").read_text()
        assert "mutual TLS on" in text, c["name"]
        assert "revokes" not in text, c["name"]  # no server of the run was refused
        if c["role"] == "dataflow":  # up all along: it took the list up while it ran
            assert "(1 revoked)" in text
        # Each child had a credential naming its role (astra.authz), not the run's own, and
        # its trainer's or RaaS's policies (astra.scopes).
        own = Path(c["tls_dir"]) / "cert.pem"
        assert own.parent.parent == credential / "nodes" / "loopback", c
        assert cert_roles(own.read_bytes()) == (c["role"],), c["name"]
        scoped = ["policy"] if c["role"] in ("trainer", "raas") else []
        assert cert_policies(own.read_bytes()) == scoped, c["name"]
    assert (credential / "ca.key").stat().st_mode & 0o077 == 0
