"""A client looks its server's certificate up in the revocation list (astra.tls_peer,
clients.revocation).

Real certificates and CRLs, real handshakes to in-process WeightServices on loopback, each
started under its own node's credentials. What must hold: once the client's list names the
server's certificate, every call of the client there, of any shape, fails with
UNAUTHENTICATED (ErrorInfo SERVER_CERTIFICATE_REVOKED, naming the serial) before it is sent,
on a channel opened before the revocation too; a server not listed is served; a list that
names nobody costs no handshake; a probe that cannot reach the server leaves the call to gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import grpc
import pytest

from astra import tls, tls_peer
from astra.clients.weights import WeightClient
from astra.clients.weights_stream import Receiver, publish_version
from astra.errors import AstraError
from astra.tls_certs import init_ca, issue
from astra.tls_crl import revoke, serial_of
from astra.tls_peer import PeerCheck, split_address
from astra.weights.v1 import weight_service_pb2 as w_pb
from tests.conftest import error_info
from tests.test_tls_roles import ended
from tests.test_weights_service import serving
from tests.test_weights_store import chain_of, same


def test_addresses_a_probe_can_reach() -> None:
    assert split_address("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert split_address("node7.cluster:443") == ("node7.cluster", 443)
    assert split_address("[::1]:5000") == ("::1", 5000)
    assert split_address("dns:///node7:5000") == ("node7", 5000)
    assert split_address("ipv4:10.0.0.1:5000") == ("10.0.0.1", 5000)
    for unreachable in ("unix:/tmp/s.sock", "node7", "::1", "[::1]", "a:1,b:2", "h:port", ""):
        assert split_address(unreachable) is None, unreachable


@pytest.fixture
def nodes(tmp_path, monkeypatch) -> Path:
    """A CA, two servers' credentials (srv_a, srv_b) and an operator's that may publish and
    fetch; no list yet."""
    monkeypatch.setattr(tls, "RECHECK_S", 0.0)
    ca = tmp_path / "ca"
    init_ca(ca)
    for name in ("srv_a", "srv_b"):
        issue(ca, tmp_path / name, ["127.0.0.1"])
    issue(ca, tmp_path / "operator", ["127.0.0.1"], roles=["trainer", "raas"])
    return tmp_path


@contextlib.asynccontextmanager
async def server_as(node: Path, store: Path, monkeypatch):
    """A WeightService under `node`'s credentials (taken at start, as a process would)."""
    monkeypatch.setenv("ASTRA_TLS_DIR", str(node))
    monkeypatch.delenv("ASTRA_TLS_CRL", raising=False)
    async with serving(store) as server:
        yield server


def as_operator(nodes: Path, monkeypatch) -> None:
    monkeypatch.setenv("ASTRA_TLS_DIR", str(nodes / "operator"))


def revoke_server(nodes: Path, name: str) -> str:
    """`astra tls revoke` of a server's certificate, the list copied to the operator's
    directory; the serial, in hex."""
    revoke(nodes / "ca", certs=[nodes / name / "cert.pem"])
    shutil.copy(nodes / "ca" / "crl.pem", nodes / "operator" / "crl.pem")
    return f"{serial_of((nodes / name / 'cert.pem').read_bytes()):x}"


async def refused(call) -> grpc.aio.AioRpcError:
    """How a call (or a stream, read to its end) fails."""
    exc = await ended(call())
    assert exc is not None, "the call succeeded"
    return exc


async def served(call) -> bool:
    """Whether the server answered: a call about a policy it does not know ends NOT_FOUND."""
    return (await refused(call)).code() is grpc.StatusCode.NOT_FOUND


async def one_fetch():
    yield w_pb.FetchVersionRequest(start=w_pb.FetchStart(policy_id="p", receiver_id="r"))


def test_a_client_does_not_call_a_server_whose_certificate_is_revoked(nodes, monkeypatch):
    monkeypatch.setattr(tls_peer, "RETRY_S", 600.0)  # one probe per channel, however slow

    async def main_() -> None:
        async with (
            server_as(nodes / "srv_a", nodes / "store_a", monkeypatch) as a,
            server_as(nodes / "srv_b", nodes / "store_b", monkeypatch) as b,
        ):
            as_operator(nodes, monkeypatch)
            to_a, to_b = WeightClient(a.address), WeightClient(b.address)
            try:
                # A list that names nobody: no interceptor, no handshake of its own.
                assert await served(lambda: to_a.list_versions("p"))
                assert to_a.redials == 0
                assert await served(lambda: to_a.stub.FetchVersion(one_fetch()))
                serial = revoke_server(nodes, "srv_a")
                # The channel opened before: the next call of each shape is refused unsent.
                exc = await refused(lambda: to_a.list_versions("p"))
                assert exc.code() is grpc.StatusCode.UNAUTHENTICATED
                info, _ = error_info(exc)
                assert info.reason == "SERVER_CERTIFICATE_REVOKED" and info.domain == "astra.tls"
                assert info.metadata["serial"] == serial and serial in exc.details()
                assert info.metadata["address"] == a.address
                exc = await refused(lambda: to_a.stub.FetchVersion(one_fetch()))
                assert exc.code() is grpc.StatusCode.UNAUTHENTICATED
                assert error_info(exc)[0].reason == "SERVER_CERTIFICATE_REVOKED"
                # A client opened now too; the other server is served.
                async with WeightClient(a.address) as fresh:
                    exc = await refused(lambda: fresh.list_versions("p"))
                    assert error_info(exc)[0].reason == "SERVER_CERTIFICATE_REVOKED"
                assert await served(lambda: to_b.list_versions("p"))
                assert await served(lambda: to_b.stub.FetchVersion(one_fetch()))
                # One handshake of its own per channel while the verdict holds.
                checks = [i.check for i in interceptors(to_a) + interceptors(to_b)]
                assert [c.probes for c in checks] == [1, 1]
            finally:
                await to_a.close()
                await to_b.close()

    asyncio.run(asyncio.wait_for(main_(), 60))


def interceptors(client: WeightClient) -> list:
    return list(client.channel._unary_unary_interceptors)


def test_a_probe_that_cannot_reach_the_server_leaves_the_call_to_grpc(nodes, monkeypatch):
    async def main_() -> None:
        as_operator(nodes, monkeypatch)
        revoke_server(nodes, "srv_a")
        material = tls.current_tls()
        assert material is not None and material.revoked
        with contextlib.closing(__import__("socket").socket()) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # nothing listens there
        check = PeerCheck(f"127.0.0.1:{port}", material, timeout_s=2.0)
        await check.check()  # no verdict: no refusal
        assert check.probes == 1
        await check.check()  # within RETRY_S: not asked again
        assert check.probes == 1
        monkeypatch.setattr(tls_peer, "RETRY_S", 0.0)  # each call probes, and goes on
        async with WeightClient(f"127.0.0.1:{port}", timeout_s=2.0) as client:
            exc = await refused(lambda: client.list_versions("p"))
            assert exc.code() is grpc.StatusCode.UNAVAILABLE  # gRPC's own answer

    asyncio.run(asyncio.wait_for(main_(), 60))


def test_weights_flow_through_a_checked_channel_and_not_from_a_revoked_server(nodes, monkeypatch):
    """Publish and fetch (full, then delta) through channels that check the server: the
    streams are intact; a receiver of the revoked server gets nothing."""
    models = chain_of(2, seed=5)

    async def main_() -> None:
        async with (
            server_as(nodes / "srv_a", nodes / "store_a", monkeypatch) as a,
            server_as(nodes / "srv_b", nodes / "store_b", monkeypatch) as b,
        ):
            as_operator(nodes, monkeypatch)
            revoke_server(nodes, "srv_a")
            receiver = Receiver(b.address, "p", nodes / "rx", durable=False)
            for i, m in enumerate(models):
                await publish_version(b.address, "p", f"v{i}", i, m, {}, chunk_bytes=4096)
                fetched = await receiver.fetch()
                assert fetched.identity == f"v{i}" and same(receiver.current_path, m)
            assert fetched.plan == "delta"
            with pytest.raises(AstraError) as refused_publish:  # as publish_version raises
                await publish_version(a.address, "p", "v0", 0, models[0], {})
            assert refused_publish.value.reason == "SERVER_CERTIFICATE_REVOKED"
            assert refused_publish.value.code == "UNAUTHENTICATED"
            with pytest.raises(AstraError) as refused_fetch:
                await Receiver(a.address, "p", nodes / "rx_a", durable=False).fetch()
            assert refused_fetch.value.reason == "SERVER_CERTIFICATE_REVOKED"
            assert refused_fetch.value.metadata["address"] == a.address
            assert not list((nodes / "store_a").rglob("*.safetensors"))  # nothing was sent

    asyncio.run(asyncio.wait_for(main_(), 60))
