"""Server reflection (servers/reflection.py): v1 and v1alpha both answer, every contract symbol
resolves (services, methods, messages, fields, enum values), and the files carry the protos'
comments, so the operating rules reach grpcurl users."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from tests.conftest import running_dataflow

SYMBOLS = [
    "astra.dataflow.v1.DataflowService",
    "astra.dataflow.v1.DataflowService.RegisterInstance",
    "astra.dataflow.v1.RegisterInstanceRequest",
    "astra.dataflow.v1.RegisterInstanceRequest.loaded_versions",
    "astra.dataflow.v1.InstanceStatus.last_refusal",
    "astra.raas.v1.RolloutService.SubmitGroups",
    "astra.weights.v1.WeightService.PublishVersion",
]


async def _ask(address: str, service: str, requests: list) -> list[rpb.ServerReflectionResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        return [r async for r in call(iter(requests))]


def _comments(answer: rpb.ServerReflectionResponse) -> str:
    first = descriptor_pb2.FileDescriptorProto.FromString(
        answer.file_descriptor_response.file_descriptor_proto[0]
    )
    return "\n".join(loc.leading_comments for loc in first.source_code_info.location)


@pytest.mark.parametrize(
    "service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]
)
def test_both_versions_resolve_every_symbol_with_its_comments(config, service) -> None:
    async def go() -> None:
        async with running_dataflow(config) as (server, _df, _client):
            listed, *found = await _ask(
                server.address,
                service,
                [rpb.ServerReflectionRequest(list_services="")]
                + [rpb.ServerReflectionRequest(file_containing_symbol=s) for s in SYMBOLS],
            )
            names = {s.name for s in listed.list_services_response.service}
            assert {"astra.dataflow.v1.DataflowService", "grpc.health.v1.Health"} <= names
            assert {"grpc.reflection.v1.ServerReflection"} <= names
            for symbol, answer in zip(SYMBOLS, found, strict=True):
                assert answer.WhichOneof("message_response") == "file_descriptor_response", symbol
                protos = [
                    descriptor_pb2.FileDescriptorProto.FromString(p)
                    for p in answer.file_descriptor_response.file_descriptor_proto
                ]
                package = symbol.split(".")[1]  # the file first, then all it imports
                assert protos[0].name.startswith(f"astra/{package}/v1/"), (symbol, protos[0].name)
                assert set(protos[0].dependency) <= {p.name for p in protos}, symbol
            # The operating rules, as written in the proto, come through.
            assert "Submits it answered with a refusal" in _comments(found[4])
            missing, by_file = await _ask(
                server.address,
                service,
                [
                    rpb.ServerReflectionRequest(file_containing_symbol="astra.nope.Nothing"),
                    rpb.ServerReflectionRequest(
                        file_by_filename="astra/dataflow/v1/dataflow_service.proto"
                    ),
                ],
            )
            assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
            first = by_file.file_descriptor_response.file_descriptor_proto[0]
            assert descriptor_pb2.FileDescriptorProto.FromString(first).name == (
                "astra/dataflow/v1/dataflow_service.proto"
            )
            assert "Submits it answered with a refusal" in _comments(by_file)

    asyncio.run(go())
