"""DataflowService over a real socket: health, reflection, membership, bad input on every RPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from astra.common.v1 import version_pb2
from astra.dataflow.v1 import dataflow_service_pb2 as pb
from tests.conftest import error_info, running_dataflow


def register_request(**over) -> pb.RegisterInstanceRequest:
    fields = {
        "instance_id": "raas-1",
        "address": "127.0.0.1:1",
        "capacity": 8,
        "policy_ids": ["policy"],
        "workflows": ["single_turn"],
        "labels": {"region": "test"},
    }
    fields.update(over)
    return pb.RegisterInstanceRequest(**fields)


async def expect_error(call, code: grpc.StatusCode, reason: str, field: str | None = None):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    exc = info.value
    assert exc.code() == code, exc.details()
    detail, others = error_info(exc)
    assert detail is not None and detail.reason == reason, detail
    assert detail.domain == "astra.dataflow.v1"
    if field is not None:
        violations = [
            v.field
            for o in others
            if isinstance(o, error_details_pb2.BadRequest)
            for v in o.field_violations
        ]
        assert field in violations, (violations, exc.details())
        assert field in exc.details()
    return exc, others


async def expect_invalid_field(call, field: str):
    """`call` fails with INVALID_ARGUMENT, reason INVALID_FIELD, naming `field`."""
    return await expect_error(call, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD", field)


def test_health_reflection_and_capabilities(config):
    async def body():
        async with running_dataflow(config) as (_server, _df, client):
            health = health_pb2_grpc.HealthStub(client.channel)
            for service in ("", "astra.dataflow.v1.DataflowService"):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(client.channel)
            call = refl.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            resp = await call.read()
            await call.done_writing()
            names = {s.name for s in resp.list_services_response.service}
            assert {"astra.dataflow.v1.DataflowService", "grpc.health.v1.Health"} <= names
            caps = await client.get_capabilities()
            assert caps.capabilities.contract_version.startswith("1.")

    asyncio.run(body())


def test_register_heartbeat_deregister_and_status(config):
    async def body():
        async with running_dataflow(config) as (_s, _df, client):
            first = await client.register_instance(register_request())
            assert not first.already_registered
            assert first.heartbeat_interval.ToNanoseconds() == 200_000_000
            again = await client.register_instance(register_request())
            assert again.already_registered
            await client.heartbeat_instance(
                pb.HeartbeatInstanceRequest(
                    instance_id="raas-1",
                    free_slots=3,
                    loaded_versions=[version_pb2.PolicyVersion(policy_id="policy", version=0)],
                )
            )
            status = await client.get_status()
            (inst,) = status.instances
            assert inst.instance_id == "raas-1" and inst.labels["region"] == "test"
            assert status.dataflow_id == first.dataflow_id
            # The address is dead, so whatever was dispatched comes back on deregistration.
            await client.deregister_instance("raas-1")
            again = await client.deregister_instance("raas-1")  # idempotent
            assert again.requeued_groups == 0
            status = await client.get_status()
            assert status.pool_empty
            assert status.gate.in_flight_groups == 0
            assert status.instances[0].state == pb.INSTANCE_STATE_LEFT
            # Forgotten instance: a heartbeat tells it to register again.
            await expect_error(
                lambda: client.heartbeat_instance(
                    pb.HeartbeatInstanceRequest(instance_id="raas-1")
                ),
                grpc.StatusCode.NOT_FOUND,
                "INSTANCE_NOT_REGISTERED",
            )

    asyncio.run(body())


BAD_REGISTRATIONS = [
    ({"instance_id": ""}, "instance_id"),
    ({"instance_id": "x" * 129}, "instance_id"),
    ({"address": ""}, "address"),
    ({"capacity": 0}, "capacity"),
    ({"policy_ids": []}, "policy_ids"),
    ({"policy_ids": ["policy", ""]}, "policy_ids[1]"),
    ({"workflows": []}, "workflows"),
    ({"incarnation": "x" * 129}, "incarnation"),
    ({"contract_version": "v" * 129}, "contract_version"),
    ({"labels": {"": "x"}}, "labels"),
    ({"labels": {"k": "x" * 1025}}, "labels[k]"),
    (
        {"loaded_versions": [{"policy_id": "policy", "version": 0}] * 257},
        "loaded_versions",
    ),
]


def test_every_rpc_rejects_bad_input_and_keeps_serving(config):
    async def body():
        async with running_dataflow(config) as (_s, _df, client):
            stub = client.stub
            for over, field in BAD_REGISTRATIONS:
                await expect_invalid_field(
                    lambda o=over: stub.RegisterInstance(register_request(**o)), field
                )
            await expect_error(
                lambda: stub.RegisterInstance(register_request(policy_ids=["other"])),
                grpc.StatusCode.FAILED_PRECONDITION,
                "NO_COMMON_POLICY",
            )
            await expect_invalid_field(
                lambda: stub.HeartbeatInstance(pb.HeartbeatInstanceRequest()), "instance_id"
            )
            await stub.RegisterInstance(register_request())
            await expect_invalid_field(
                lambda: stub.HeartbeatInstance(
                    pb.HeartbeatInstanceRequest(instance_id="raas-1", free_slots=-1)
                ),
                "free_slots",
            )
            await expect_invalid_field(
                lambda: stub.DeregisterInstance(pb.DeregisterInstanceRequest()), "instance_id"
            )

            def fetch(**change):
                req = pb.FetchBatchRequest(policy_id="policy", num_groups=1, request_id="r")
                for k, v in change.items():
                    setattr(req, k, v)
                return stub.FetchBatch(req)

            await expect_error(
                lambda: fetch(policy_id="nope"), grpc.StatusCode.NOT_FOUND, "POLICY_NOT_FOUND"
            )
            for change, field in [
                ({"policy_id": ""}, "policy_id"),
                ({"num_groups": 0}, "num_groups"),
                ({"num_groups": 70000}, "num_groups"),
                ({"request_id": ""}, "request_id"),
                ({"trainer_version": -1}, "trainer_version"),
                ({"trainer_id": "t" * 129}, "trainer_id"),
            ]:
                await expect_invalid_field(lambda c=change: fetch(**c), field)
            neg = pb.FetchBatchRequest(policy_id="policy", num_groups=1, request_id="r2")
            neg.max_wait.FromNanoseconds(-1_000_000)
            await expect_invalid_field(lambda: stub.FetchBatch(neg), "max_wait")
            await expect_invalid_field(lambda: stub.AckBatch(pb.AckBatchRequest()), "batch_id")
            await expect_error(
                lambda: stub.AckBatch(pb.AckBatchRequest(batch_id="unknown")),
                grpc.StatusCode.NOT_FOUND,
                "BATCH_NOT_FOUND",
            )

            def announce(policy="policy", version=1, address="127.0.0.1:9"):
                return stub.AnnounceVersion(
                    pb.AnnounceVersionRequest(
                        version=version_pb2.PolicyVersion(policy_id=policy, version=version),
                        weights_address=address,
                    )
                )

            await expect_error(
                lambda: announce(policy="nope"), grpc.StatusCode.NOT_FOUND, "POLICY_NOT_FOUND"
            )
            await expect_invalid_field(lambda: announce(version=-1), "version.version")
            await expect_invalid_field(lambda: announce(address=""), "weights_address")
            await expect_error(
                lambda: announce(version=5), grpc.StatusCode.FAILED_PRECONDITION, "VERSION_NOT_NEXT"
            )
            # Still serving, state intact.
            status = await client.get_status()
            assert [i.instance_id for i in status.instances] == ["raas-1"]

    asyncio.run(body())


def test_announce_version_is_monotonic_and_idempotent(config):
    async def body():
        async with running_dataflow(config) as (_s, _df, client):
            r1 = await client.announce_version("policy", 1, "127.0.0.1:9")
            assert r1.current_version == 1 and not r1.already_announced
            r1b = await client.announce_version("policy", 1, "127.0.0.1:9")
            assert r1b.already_announced and r1b.current_version == 1
            r2 = await client.announce_version("policy", 2, "127.0.0.1:9")
            assert r2.current_version == 2
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.announce_version("policy", 1, "127.0.0.1:9")
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            status = await client.get_status()
            assert status.policies[0].current_version == 2

    asyncio.run(body())


def test_fetch_batch_with_empty_pool_is_unavailable_with_reason(config):
    async def body():
        async with running_dataflow(config) as (_s, _df, client):
            req = pb.FetchBatchRequest(policy_id="policy", num_groups=1, request_id="r")
            req.max_wait.FromNanoseconds(200_000_000)
            exc, others = await expect_error(
                lambda: client.stub.FetchBatch(req),
                grpc.StatusCode.UNAVAILABLE,
                "BATCH_NOT_READY",
            )
            assert "pool empty" in exc.details()
            assert any(isinstance(o, error_details_pb2.RetryInfo) for o in others)
            status = await client.get_status()
            assert status.pool_empty
            assert status.gate.mode == pb.GATE_MODE_THROTTLED

    asyncio.run(body())


def test_prometheus_metrics_are_served(dataset, tmp_path):
    import urllib.request

    from tests.conftest import make_config

    config = make_config(dataset, tmp_path / "state", metrics_port=0)

    async def body():
        async with running_dataflow(config) as (_s, df, client):
            await client.register_instance(register_request())
            url = f"http://127.0.0.1:{df.metrics_port}/metrics"
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(url, timeout=5).read().decode()
            )
            assert 'astra_dataflow_instances{state="INSTANCE_STATE_ACTIVE"} 1.0' in text
            assert 'astra_dataflow_buffered_groups{policy="policy"}' in text
            assert "astra_dataflow_events_total" in text

    asyncio.run(body())
