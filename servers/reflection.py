"""gRPC server reflection, v1 and v1alpha, serving the contracts with their comments.

grpcio-reflection serves only grpc.reflection.v1alpha, from the process's descriptor
pool: generated Python stubs carry no source comments, so `grpcurl describe` showed
the shape of a method but none of the operating rules the protos write down. This
servicer answers from servers/contracts.binpb instead (every proto under proto/ with
its imports and source info, written by tools/codegen.py), under both service names
(v1 and v1alpha messages are the same on the wire). Any symbol resolves: packages'
messages, enums, enum values, fields, services and methods. Files it does not hold
(grpc.health.v1's) come from the descriptor pool, without comments.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Iterable
from importlib.resources import files
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as rpb

log = logging.getLogger(__name__)
SERVICE_NAMES = ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection")
METHOD = "ServerReflectionInfo"


class Contracts:
    """The FileDescriptorSet, indexed: file by name, file by every symbol it defines."""

    def __init__(self, data: bytes) -> None:
        fds = descriptor_pb2.FileDescriptorSet.FromString(data)
        self.files = {f.name: f for f in fds.file}
        self.symbols: dict[str, str] = {}
        for f in fds.file:
            prefix = f"{f.package}." if f.package else ""
            for m in f.message_type:
                self._message(prefix, m, f.name)
            for e in f.enum_type:
                self._enum(prefix, e, f.name)
            for s in f.service:
                self.symbols[prefix + s.name] = f.name
                for method in s.method:
                    self.symbols[f"{prefix}{s.name}.{method.name}"] = f.name
            for x in f.extension:
                self.symbols[prefix + x.name] = f.name

    def _message(self, prefix: str, m: descriptor_pb2.DescriptorProto, file: str) -> None:
        name = prefix + m.name
        self.symbols[name] = file
        for field in m.field:
            self.symbols[f"{name}.{field.name}"] = file
        for oneof in m.oneof_decl:
            self.symbols[f"{name}.{oneof.name}"] = file
        for nested in m.nested_type:
            self._message(f"{name}.", nested, file)
        for e in m.enum_type:
            self._enum(f"{name}.", e, file)

    def _enum(self, prefix: str, e: descriptor_pb2.EnumDescriptorProto, file: str) -> None:
        self.symbols[prefix + e.name] = file
        for value in e.value:  # enum values live in the enclosing scope
            self.symbols[prefix + value.name] = file

    def closure(self, name: str) -> list[bytes]:
        """`name` and every file it imports, transitively, serialized; `name` first."""
        out, todo, seen = [], [name], set()
        while todo:
            current = todo.pop(0)
            if current in seen or current not in self.files:
                continue
            seen.add(current)
            out.append(self.files[current].SerializeToString())
            todo.extend(self.files[current].dependency)
        return out


@functools.cache
def load_contracts() -> Contracts:
    """The contracts, read and indexed once per process (every server of it shares them)."""
    return Contracts(files("astra.servers").joinpath("contracts.binpb").read_bytes())


def _pool_closure(descriptor: Any) -> list[bytes]:
    out, todo, seen = [], [descriptor], set()
    while todo:
        d = todo.pop(0)
        if d.name in seen:
            continue
        seen.add(d.name)
        proto = descriptor_pb2.FileDescriptorProto()
        d.CopyToProto(proto)
        out.append(proto.SerializeToString())
        todo.extend(d.dependencies)
    return out


class Reflection:
    """Answers reflection requests about this server's services."""

    def __init__(self, services: Iterable[str], contracts: Contracts | None = None) -> None:
        self.services = sorted({*services, *SERVICE_NAMES})
        self.contracts = contracts or load_contracts()
        self.pool = descriptor_pool.Default()

    def answer(self, req: rpb.ServerReflectionRequest) -> rpb.ServerReflectionResponse:
        kind = req.WhichOneof("message_request")
        found: list[bytes] = []
        if kind == "list_services":
            listed = [rpb.ServiceResponse(name=n) for n in self.services]
            return rpb.ServerReflectionResponse(
                original_request=req, list_services_response=rpb.ListServiceResponse(service=listed)
            )
        if kind == "file_by_filename":
            found = self.contracts.closure(req.file_by_filename)
            if not found:
                found = self._from_pool(self.pool.FindFileByName, req.file_by_filename)
        elif kind == "file_containing_symbol":
            symbol = req.file_containing_symbol.lstrip(".")
            if symbol in self.contracts.symbols:
                found = self.contracts.closure(self.contracts.symbols[symbol])
            else:
                found = self._from_pool(self.pool.FindFileContainingSymbol, symbol)
        elif kind == "all_extension_numbers_of_type":
            name = req.all_extension_numbers_of_type.lstrip(".")
            if name in self.contracts.symbols:  # no contract declares extensions
                return rpb.ServerReflectionResponse(
                    original_request=req,
                    all_extension_numbers_response=rpb.ExtensionNumberResponse(base_type_name=name),
                )
        if found:
            return rpb.ServerReflectionResponse(
                original_request=req,
                file_descriptor_response=rpb.FileDescriptorResponse(file_descriptor_proto=found),
            )
        return rpb.ServerReflectionResponse(
            original_request=req,
            error_response=rpb.ErrorResponse(
                error_code=grpc.StatusCode.NOT_FOUND.value[0],
                error_message=f"{kind}: not found",
            ),
        )

    def _from_pool(self, find: Any, name: str) -> list[bytes]:
        try:
            return _pool_closure(find(name))
        except KeyError:
            return []

    async def info(
        self, requests: AsyncIterator[rpb.ServerReflectionRequest], context: Any
    ) -> AsyncIterator[rpb.ServerReflectionResponse]:
        async for req in requests:
            yield self.answer(req)

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        """The same method under both service names."""
        method = grpc.stream_stream_rpc_method_handler(
            self.info,
            request_deserializer=rpb.ServerReflectionRequest.FromString,
            response_serializer=rpb.ServerReflectionResponse.SerializeToString,
        )
        return [grpc.method_handlers_generic_handler(n, {METHOD: method}) for n in SERVICE_NAMES]
