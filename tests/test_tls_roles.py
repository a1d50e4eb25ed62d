"""Roles in TLS certificates: what a caller may call is what its certificate's roles permit.

Real certificates from astra.tls_certs, real handshakes to in-process servers on loopback. What
must hold: every RPC of the four services has an entry in astra.authz.PERMITTED (the table
follows the protos); a certificate naming a role is refused, with PERMISSION_DENIED and an
ErrorInfo naming the method, what that role may not call, in every RPC shape, before the
handler runs; what it may call goes through; a certificate without roles (an operator's, and
every one made before roles) may call everything; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astra.authz import ADMIN, ANYONE, PERMITTED, ROLES, permitted, roles_of_uris
from astra.cli import main
from astra.dataflow.v1 import dataflow_service_pb2 as df_pb
from astra.dataflow.v1 import dataflow_service_pb2_grpc as df_grpc
from astra.raas.v1 import rollout_service_pb2 as raas_pb
from astra.raas.v1 import rollout_service_pb2_grpc as raas_grpc
from astra.tls_certs import cert_policies, cert_roles, child_credential, init_ca, issue
from astra.tls_material import TlsConfigError
from astra.trainer.v1 import trainer_service_pb2 as trainer_pb
from astra.weights.v1 import weight_service_pb2 as w_pb
from astra.weights.v1 import weight_service_pb2_grpc as w_grpc
from tests.conftest import error_info, make_config, running_dataflow
from tests.test_dataflow_service import register_request
from tests.test_raas_scripted import raas
from tests.test_weights_service import serving

DENIED = grpc.StatusCode.PERMISSION_DENIED
SERVICES = (df_pb, raas_pb, trainer_pb, w_pb)


@pytest.fixture
def ca(tmp_path, monkeypatch) -> Path:
    """The run's CA; servers use its role-less credential, clients one per role."""
    d = tmp_path / "tls"
    init_ca(d)
    issue(d, d, ["127.0.0.1"])
    for role in ROLES:
        issue(d, tmp_path / role, ["127.0.0.1"], roles=[role])
    issue(d, tmp_path / "raas+trainer", ["127.0.0.1"], roles=["raas", "trainer"])
    monkeypatch.setenv("ASTRA_TLS_DIR", str(d))
    return d


def channel(address: str, credential: Path) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(credential / "ca.pem").read_bytes(),
        private_key=(credential / "key.pem").read_bytes(),
        certificate_chain=(credential / "cert.pem").read_bytes(),
    )
    return grpc.aio.secure_channel(address, creds)


async def ended(result) -> grpc.aio.AioRpcError | None:
    """How a call ends: its error, or None when it succeeds (a stream is read to its end)."""
    try:
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


async def outcome(result) -> grpc.StatusCode:
    """The status code a call ends with (OK when it succeeds); a role refusal is checked to
    carry its ErrorInfo."""
    exc = await ended(result)
    if exc is None:
        return grpc.StatusCode.OK
    if exc.code() is DENIED:
        info, _ = error_info(exc)
        assert info is not None and info.reason == "ROLE_NOT_PERMITTED", exc
        assert info.metadata["method"] in exc.details()
        assert info.metadata["roles"] and "admin" in info.metadata["permitted"]
    return exc.code()


def scrape_refused(port: int, credential: Path) -> dict[tuple[str, str], float]:
    import ssl
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    ctx = ssl.create_default_context(cafile=str(credential / "ca.pem"))
    ctx.load_cert_chain(str(credential / "cert.pem"), str(credential / "key.pem"))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5, context=ctx) as r:
        text = r.read().decode()
    return {
        (m.labels["method"], m.labels["roles"]): m.value
        for family in text_string_to_metric_families(text)
        for m in family.samples
        if m.name == "astra_rpc_refused_total"
    }


def test_every_rpc_of_the_four_services_has_an_entry_and_no_entry_is_stale() -> None:
    methods = {
        f"/{svc.full_name}/{m.name}"
        for module in SERVICES
        for svc in module.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    }
    assert set(PERMITTED) == methods
    for method, roles in PERMITTED.items():
        assert roles <= {*ROLES, ANYONE} and ADMIN not in roles, method


def test_what_each_kind_of_certificate_may_call() -> None:
    fetch = "/astra.dataflow.v1.DataflowService/FetchBatch"
    publish = "/astra.weights.v1.WeightService/PublishVersion"
    status = "/astra.raas.v1.RolloutService/GetStatus"
    pause = "/astra.trainer.v1.TrainerService/Pause"
    unknown = "/astra.dataflow.v1.DataflowService/DropEverything"
    health = "/grpc.health.v1.Health/Check"
    for method in (fetch, publish, status, pause, unknown, health):
        assert permitted(method, frozenset())  # no roles: an operator's certificate
        assert permitted(method, frozenset({ADMIN}))
    assert permitted(fetch, frozenset({"trainer"})) and not permitted(fetch, frozenset({"raas"}))
    assert permitted(fetch, frozenset({"raas", "trainer"}))  # any one of its roles
    assert not permitted(publish, frozenset({"raas"})) and not permitted(
        pause, frozenset({"trainer"})
    )
    assert not permitted(unknown, frozenset({"trainer"}))  # a method the table lacks: closed
    # A role this version does not know confines its holder to what every certificate may call.
    stranger = roles_of_uris(["urn:astra:role:auditor", "spiffe://x/y"])
    assert stranger == {"auditor"}
    assert permitted(status, stranger) and permitted(health, stranger)
    assert not permitted(fetch, stranger)


def test_dataflow_confines_raas_and_trainer_certificates(dataset, tmp_path, ca, caplog) -> None:
    async def main_() -> None:
        config = make_config(dataset, tmp_path / "state", metrics_port=0)
        async with running_dataflow(config) as (server, df, _):
            assert server.roles.enabled

            def stub(who: str) -> df_grpc.DataflowServiceStub:
                return df_grpc.DataflowServiceStub(channels[who])

            channels = {w: channel(server.address, tmp_path / w) for w in ROLES}
            channels["none"] = channel(server.address, ca)
            channels["raas+trainer"] = channel(server.address, tmp_path / "raas+trainer")
            fetch = df_pb.FetchBatchRequest(
                policy_id="policy", num_groups=1, request_id="f1", max_wait=Duration(nanos=10**6)
            )
            announce = df_pb.AnnounceVersionRequest()
            try:
                register = stub("raas").RegisterInstance(register_request(instance_id="r1"))
                assert await outcome(register) is grpc.StatusCode.OK
                for who in ("trainer", "dataflow", "weights"):
                    got = await outcome(
                        stub(who).RegisterInstance(register_request(instance_id=who))
                    )
                    assert got is DENIED, who
                for who in ("raas", "dataflow", "weights"):
                    assert await outcome(stub(who).FetchBatch(fetch)) is DENIED, who
                    assert await outcome(stub(who).AnnounceVersion(announce)) is DENIED
                # What they may call gets past the check (to whatever the call itself answers).
                for who in ("trainer", "admin", "none", "raas+trainer"):
                    assert await outcome(stub(who).FetchBatch(fetch)) is not DENIED
                    if who != "trainer":
                        req = register_request(instance_id=f"r-{who}")
                        assert await outcome(stub(who).RegisterInstance(req)) is grpc.StatusCode.OK
                for who in channels:  # reads and health: every certificate
                    get = stub(who).GetStatus(df_pb.GetStatusRequest())
                    assert await outcome(get) is grpc.StatusCode.OK, who
                    check = health_pb2_grpc.HealthStub(channels[who]).Check
                    assert (await check(health_pb2.HealthCheckRequest())).status == 1
                # Nothing a refused call carried was taken; the server kept serving.
                status = await stub("none").GetStatus(df_pb.GetStatusRequest())
                ids = sorted(i.instance_id for i in status.instances)
                assert ids == ["r-admin", "r-none", "r-raas+trainer", "r1"], ids
                assert server.roles.refused >= 9
                # Counted on the Prometheus port (HTTPS under the run's TLS), by method and roles.
                refused = scrape_refused(df.metrics_port, ca)
                fetch_name = "/astra.dataflow.v1.DataflowService/FetchBatch"
                assert refused[(fetch_name, "raas")] == 1 and refused[(fetch_name, "weights")] == 1
                assert sum(refused.values()) == server.roles.refused
            finally:
                for c in channels.values():
                    await c.close()

    with caplog.at_level(logging.WARNING, logger="astra.servers.authz"):
        asyncio.run(asyncio.wait_for(main_(), 60))
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    fetches = [m for m in refusals if "FetchBatch" in m and "(raas)" in m]
    assert len(fetches) == 1, refusals  # once per method and roles, not per call


def test_weights_publish_is_the_trainers_and_fetch_the_receivers(tmp_path, ca) -> None:
    """PublishVersion (a client stream) and FetchVersion (a bidirectional stream)."""

    async def one(request_type):
        yield request_type()

    async def main_() -> None:
        async with serving(tmp_path / "store") as server:
            for who, publish, fetch in [
                ("raas", True, False),
                ("weights", True, False),
                ("dataflow", True, True),
                ("trainer", False, False),
                ("admin", False, False),
            ]:
                async with channel(server.address, tmp_path / who) as ch:
                    stub = w_grpc.WeightServiceStub(ch)
                    got = await outcome(stub.PublishVersion(one(w_pb.PublishVersionRequest)))
                    assert (got is DENIED) is publish, (who, got)
                    got = await outcome(stub.FetchVersion(one(w_pb.FetchVersionRequest)))
                    assert (got is DENIED) is fetch, (who, got)
                    listed = stub.ListVersions(w_pb.ListVersionsRequest(policy_id="p"))
                    assert await outcome(listed) is not DENIED

    asyncio.run(asyncio.wait_for(main_(), 60))


def test_only_dataflow_drives_a_raas(tmp_path, ca) -> None:
    async def main_() -> None:
        async with raas() as (client, _):
            address = client.address
            for who, allowed in [("dataflow", True), ("trainer", False), ("raas", False)]:
                async with channel(address, tmp_path / who) as ch:
                    stub = raas_grpc.RolloutServiceStub(ch)
                    submit = stub.SubmitGroups(raas_pb.SubmitGroupsRequest())
                    assert (await outcome(submit) is DENIED) is not allowed, who
                    collect = stub.CollectResults(
                        raas_pb.CollectResultsRequest(max_groups=1, max_wait=Duration(nanos=10**6))
                    )
                    assert (await outcome(collect) is DENIED) is not allowed, who
                    caps = stub.GetCapabilities(raas_pb.GetCapabilitiesRequest())
                    assert await outcome(caps) is grpc.StatusCode.OK

    asyncio.run(asyncio.wait_for(main_(), 60))


def test_issue_names_roles_and_show_prints_them(tmp_path) -> None:
    import json

    d = tmp_path / "ca"
    assert CliRunner().invoke(main, ["tls", "init", str(d)]).exit_code == 0
    out = tmp_path / "node"
    res = CliRunner().invoke(main, ["tls", "issue", str(d), str(out), "--role", "raas"])
    assert res.exit_code == 0, res.output
    shown = json.loads(CliRunner().invoke(main, ["tls", "show", str(out)]).output)
    assert (
        shown["roles"] == ["raas"]
        and shown["usable"]
        and shown["hosts"] == ["127.0.0.1", "localhost"]
    )
    assert json.loads(CliRunner().invoke(main, ["tls", "show", str(d)]).output)["roles"] == []
    res = CliRunner().invoke(main, ["tls", "issue", str(d), str(tmp_path / "x"), "--role", "root"])
    assert res.exit_code == 2 and "root" in res.output
    with pytest.raises(TlsConfigError, match="unknown role 'root'"):
        issue(d, tmp_path / "y", roles=["root"])


def test_child_credentials_name_the_childs_role(tmp_path) -> None:
    d = tmp_path / "tls"
    init_ca(d)
    raas_dir = child_credential(d, "raas")
    assert raas_dir == d / "nodes" / "loopback" / "raas"
    assert cert_roles((raas_dir / "cert.pem").read_bytes()) == ("raas",)
    placed = child_credential(d, "trainer", "10.1.2.3")
    assert cert_roles((placed / "cert.pem").read_bytes()) == ("trainer",)
    warmup = child_credential(d, "warmup")  # not a role of astra.authz: no roles
    assert warmup.name == "operator" and cert_roles((warmup / "cert.pem").read_bytes()) == ()
    before = (raas_dir / "cert.pem").read_bytes()
    assert child_credential(d, "raas") == raas_dir
    assert (raas_dir / "cert.pem").read_bytes() == before  # issued once, not per start
    # A trainer's or RaaS's policies: a credential of their own, confined to them.
    scoped = child_credential(d, "trainer", policies=["b/x", "a", "a"])
    assert scoped.name == "trainer.a+b%2Fx" and scoped.parent == raas_dir.parent
    assert cert_policies((scoped / "cert.pem").read_bytes()) == ["a", "b/x"]
    assert cert_roles((scoped / "cert.pem").read_bytes()) == ("trainer",)
    many = child_credential(d, "raas", policies=[f"policy-{i:03d}" for i in range(40)])
    assert len(many.name) < 30 and len(cert_policies((many / "cert.pem").read_bytes())) == 40
    assert child_credential(d, "warmup", policies=["a"]).name == "operator"  # no roles, no scope


def test_a_long_lived_client_dials_again_with_renewed_credentials(
    dataset, tmp_path, monkeypatch
) -> None:
    """A client that holds its channel for its whole life (Dataflow's to each RaaS, the
    trainer's to Dataflow) follows a renewal of its credential at its next call: the server's
    role check sees the new certificate. A call in flight on the old channel ends as it
    would have, not cancelled; then the old channel closes."""
    from astra import tls
    from astra.clients.dataflow import DataflowClient

    d = tmp_path / "node"
    init_ca(d)
    issue(d, d, ["127.0.0.1"], roles=["trainer"])
    monkeypatch.setenv("ASTRA_TLS_DIR", str(d))
    monkeypatch.setattr(tls, "RECHECK_S", 0.0)

    async def main_() -> None:
        async with running_dataflow(make_config(dataset, tmp_path / "state")) as (server, _, _):
            client = DataflowClient(server.address, timeout_s=5.0)
            try:
                register = register_request(instance_id="r1")
                assert await outcome(client.stub.RegisterInstance(register)) is DENIED
                waiting = df_pb.FetchBatchRequest(
                    policy_id="policy", num_groups=1, request_id="w", max_wait=Duration(seconds=2)
                )
                in_flight = asyncio.ensure_future(outcome(client.stub.FetchBatch(waiting)))
                await asyncio.sleep(0.3)
                issue(d, d, ["127.0.0.1"], roles=["raas"])  # renewed in place
                assert await outcome(client.stub.RegisterInstance(register)) is grpc.StatusCode.OK
                assert client.redials == 1
                old_ending = await in_flight
                assert old_ending not in (grpc.StatusCode.CANCELLED, DENIED), old_ending
                for _ in range(50):  # the old channel closes once its call is done
                    if not client._retired:
                        break
                    await asyncio.sleep(0.1)
                assert not client._retired
                assert (await client.get_status()).instances[0].instance_id == "r1"
                assert client.redials == 1  # nothing changed since: the same channel
            finally:
                await client.close()

    asyncio.run(asyncio.wait_for(main_(), 60))


def test_every_policy_scoped_method_names_a_policy_field_of_its_request() -> None:
    from astra.scopes import POLICY_FIELDS

    methods = {
        f"/{svc.full_name}/{m.name}": m
        for module in SERVICES
        for svc in module.DESCRIPTOR.services_by_name.values()
        for m in svc.methods
    }
    for method, path in POLICY_FIELDS.items():
        assert method in PERMITTED and method in methods, method
        message = methods[method].input_type
        for name in path[:-1]:
            field = message.fields_by_name[name]
            assert field.message_type is not None, (method, name)
            message = field.message_type
        assert message.fields_by_name[path[-1]].type == 9, (method, path)  # TYPE_STRING


def test_a_certificate_scoped_to_policies_acts_on_those_alone(dataset, tmp_path, ca) -> None:
    """`--policy`: a trainer's certificate for one policy fetches that policy's batches and
    publishes its weights, not another's; a RaaS's registers for its policies only. Every
    refusal is PERMISSION_DENIED with POLICY_NOT_PERMITTED, before the handler runs."""
    for who, role, policies in [
        ("trainer-policy", "trainer", ["policy"]),
        ("trainer-other", "trainer", ["other", "third"]),
        ("raas-policy", "raas", ["policy"]),
        ("raas-other", "raas", ["other"]),
    ]:
        issue(ca, tmp_path / who, ["127.0.0.1"], roles=[role], policies=policies)

    async def scoped(call) -> str:
        exc = await ended(call)
        if exc is None:
            return "ok"
        info, _ = error_info(exc)
        return info.reason if exc.code() is DENIED and info is not None else "other"

    async def one(message):
        yield message

    async def main_() -> None:
        fetch = df_pb.FetchBatchRequest(
            policy_id="policy", num_groups=1, request_id="f", max_wait=Duration(nanos=10**6)
        )
        config = make_config(dataset, tmp_path / "state")
        async with running_dataflow(config) as (server, _, _):
            for who, want in [
                ("trainer-policy", "other"),
                ("trainer-other", "POLICY_NOT_PERMITTED"),
            ]:
                async with channel(server.address, tmp_path / who) as ch:
                    got = await scoped(df_grpc.DataflowServiceStub(ch).FetchBatch(fetch))
                    assert (got == "POLICY_NOT_PERMITTED") is (want == "POLICY_NOT_PERMITTED"), who
            for who, want in [("raas-policy", "ok"), ("raas-other", "POLICY_NOT_PERMITTED")]:
                async with channel(server.address, tmp_path / who) as ch:
                    req = register_request(instance_id=who, policy_ids=["policy"])
                    got = await scoped(df_grpc.DataflowServiceStub(ch).RegisterInstance(req))
                    assert got == want, (who, got)
            assert (
                server.roles.by_caller[
                    ("/astra.dataflow.v1.DataflowService/FetchBatch", "policy scope")
                ]
                == 1
            )
        async with serving(tmp_path / "store") as server:
            for who, policy, want in [
                ("trainer-other", "policy", True),
                ("trainer-other", "third", False),
                ("trainer-policy", "policy", False),
            ]:
                async with channel(server.address, tmp_path / who) as ch:
                    stub = w_grpc.WeightServiceStub(ch)
                    header = w_pb.PublishHeader(policy_id=policy, version_id="v1", version=1)
                    got = await scoped(
                        stub.PublishVersion(one(w_pb.PublishVersionRequest(header=header)))
                    )
                    assert (got == "POLICY_NOT_PERMITTED") is want, (who, policy, got)
                    start = w_pb.FetchStart(policy_id=policy)
                    got = await scoped(
                        stub.FetchVersion(one(w_pb.FetchVersionRequest(start=start)))
                    )
                    assert (got == "POLICY_NOT_PERMITTED") is want, (who, policy, got)

    asyncio.run(asyncio.wait_for(main_(), 60))


def test_policy_scopes_are_shown_and_odd_policy_ids_round_trip(tmp_path) -> None:
    import json

    d = tmp_path / "ca"
    init_ca(d)
    out = tmp_path / "node"
    odd = "team a/π:1"
    args = ["tls", "issue", str(d), str(out), "--role", "trainer", "--policy", odd]
    assert CliRunner().invoke(main, [*args, "--policy", "b"]).exit_code == 0
    shown = json.loads(CliRunner().invoke(main, ["tls", "show", str(out)]).output)
    assert shown["roles"] == ["trainer"] and shown["policies"] == sorted([odd, "b"])
    issue(d, tmp_path / "any", ["127.0.0.1"])
    assert (
        json.loads(CliRunner().invoke(main, ["tls", "show", str(tmp_path / "any")]).output)[
            "policies"
        ]
        == []
    )
