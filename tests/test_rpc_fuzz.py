"""Seeded fuzzing of every RPC of the four services, over real sockets.

Each request is a valid one mutated at random (values at and past the bounds the protos
state, empty and huge strings, unicode, path separators in ids, NaN and infinities,
malformed arrays, oversized repeated fields, missing fields, parts of a stream out of
order) or its wire bytes corrupted. Every call must end within its deadline with a
status other than UNKNOWN or INTERNAL, and every error must carry a google.rpc.ErrorInfo
of the service's domain. Requests that break a stated bound are refused with
INVALID_ARGUMENT naming the field. Afterwards each server still serves valid requests,
its GetStatus is sane, and its background loops are alive. Seeds are fixed.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astra.common.arrays import to_array
from astra.common.group_convert import incoming_group
from astra.common.v1 import array_pb2, rollout_pb2, version_pb2
from astra.dataflow.v1 import dataflow_service_pb2 as df_pb
from astra.raas.scripted import MAX_SEQ_LEN, ScriptedGenerator
from astra.raas.v1 import rollout_service_pb2 as raas_pb
from astra.servers.weights_fetch import StreamSettings
from astra.trainer.v1 import trainer_service_pb2 as trainer_pb
from astra.weights.v1 import weight_service_pb2 as w_pb
from astra.weights.wire import parse_chunk
from tests.conftest import error_info, make_config, running_dataflow
from tests.test_dataflow_service import register_request
from tests.test_raas_scripted import group, raas
from tests.test_weights_service import _tensor_msgs, serving
from tests.test_weights_store import bf16_model, same

SEED = 20240611
CALL_S = 5.0  # deadline of one fuzzed call: none may need it
ROUNDS = 200  # mutated requests per RPC
RAW_ROUNDS = 24  # corrupted wire bytes per RPC
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
code = grpc.StatusCode

# ----- values --------------------------------------------------------------------------------

STRINGS = [
    "", " ", "x" * 129, "x" * 257, "x" * 1025, "x" * 5000, "\u00e9" * 128, "\U0001f600" * 65,
    "../../etc/passwd", "a/b", "/", ".", "..", "\\", "\x00", "a\x00b", "\n", "\u202e\u200b",
    "initial", "\uff50\uff4f\uff4c", "policy", "p", "v0", "%s%n", "-1", "NaN", "127.0.0.1:1",
    "[::1]:0", "dns:///", "C:\\x",
]  # fmt: skip
INT32 = [0, 1, -1, 2, 7, 128, 256, 257, 1024, 1025, 4096, 4097, 65536, 65537, 2**31 - 1, -(2**31)]
INT64 = [*INT32, 2**40, 2**63 - 1, -(2**63)]
DOUBLES = [0.0, -0.0, 1.0, -1.0, 0.5, 1.5, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324]
OVERSIZED = [65, 257, 1025, 4097]
DTYPES = ["", "float32", "int32", "int64", "uint8", "bool", "bfloat16", "float8_e4m3fn", "U8",
          "complex64", "object", "<i4", "x" * 200]  # fmt: skip
SHAPES = [[], [0], [-1], [3], [2, 2], [1] * 65, [2**62, 2**62], [2**31, 0], [-(2**63)]]
INT32_TYPES = {FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32}
INT64_TYPES = {FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64, FD.TYPE_UINT64, FD.TYPE_FIXED64}


def _string(rng: random.Random) -> str:
    if rng.random() < 0.2:  # random code points from assorted planes, no surrogates
        return "".join(
            chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0xD800),
                            rng.randrange(0xE000, 0x10FFFF)]))
            for _ in range(rng.randrange(1, 40))
        )  # fmt: skip
    return rng.choice(STRINGS)


def _scalar(f, rng: random.Random) -> Any:
    t = f.type
    if t == FD.TYPE_STRING:
        return _string(rng)
    if t == FD.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 3, 7, 64, 4099]))
    if t == FD.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return rng.choice(DOUBLES)
    if t == FD.TYPE_ENUM:  # proto3 enums are open: unknown numbers reach the server
        return rng.choice([*(v.number for v in f.enum_type.values), 99, -1])
    if t in INT32_TYPES:
        return rng.choice(INT32)
    if t in INT64_TYPES:
        return rng.choice(INT64)
    return rng.choice([0, 1, 2**32 - 1])


# ----- mutations -----------------------------------------------------------------------------


def _mutate_array(a: array_pb2.NDArray, rng: random.Random) -> None:
    """A malformed NDArray: wrong dtype, shape or data length, or all three."""
    for _ in range(rng.randrange(1, 4)):
        pick = rng.randrange(4)
        if pick == 0:
            a.dtype = rng.choice(DTYPES)
        elif pick == 1:
            a.ClearField("shape")
            a.shape.extend(rng.choice(SHAPES))
        elif pick == 2:
            a.data = a.data[: rng.randrange(len(a.data) + 1)] + rng.randbytes(rng.randrange(3))
        else:  # consistent bytes of another dtype
            a.dtype = rng.choice(["float32", "uint8", "bool", "float64"])
            count = math.prod(max(0, d) for d in a.shape)
            size = {"float32": 4, "uint8": 1, "bool": 1, "float64": 8}[a.dtype]
            a.data = rng.randbytes(size * count) if count <= 4096 else b""


def _mutate_duration(d: duration_pb2.Duration, rng: random.Random) -> None:
    d.seconds = rng.choice([-1, 0, 1, 31, 61, 315_576_000_000, -315_576_000_000])
    d.nanos = rng.choice([-1, 0, 1, 999_999_999, -999_999_999])


def mutate(msg: Message, rng: random.Random, depth: int = 0) -> None:
    """One random change to `msg` or to a message inside it, in place."""
    if msg.DESCRIPTOR.full_name == "astra.common.v1.NDArray":
        _mutate_array(msg, rng)
        return
    if msg.DESCRIPTOR.full_name == "google.protobuf.Duration":
        _mutate_duration(msg, rng)
        return
    fields = msg.DESCRIPTOR.fields
    if not fields:
        return
    f = rng.choice(fields)
    value = getattr(msg, f.name)
    is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
    if rng.random() < 0.15:  # a missing field
        msg.ClearField(f.name)
    elif is_map:
        _mutate_map(value, f.message_type, rng, depth)
    elif f.is_repeated:
        _mutate_repeated(value, f, rng, depth)
    elif f.message_type is not None:
        if depth < 4:
            mutate(value, rng, depth + 1)
        else:
            value.SetInParent()
    else:
        setattr(msg, f.name, _scalar(f, rng))


def _mutate_map(value, entry, rng: random.Random, depth: int) -> None:
    key_f, value_f = entry.fields_by_name["key"], entry.fields_by_name["value"]
    n = rng.choice([1, 1, 2, *OVERSIZED[:2]])
    for i in range(n):
        key = _scalar(key_f, rng) if n < 10 else f"k{i}"
        if value_f.message_type is not None:
            item = value[key]
            if depth < 4:
                mutate(item, rng, depth + 1)
        else:
            value[key] = _scalar(value_f, rng)


def _mutate_repeated(value, f, rng: random.Random, depth: int) -> None:
    pick = rng.randrange(4)
    if pick == 0:
        del value[:]
    elif pick == 1 and len(value):  # change one element
        i = rng.randrange(len(value))
        if f.message_type is not None:
            if depth < 4:
                mutate(value[i], rng, depth + 1)
        else:
            value[i] = _scalar(f, rng)
    elif pick == 2:  # oversized: copies of an element, or of a fresh value
        n = rng.choice(OVERSIZED)
        if f.message_type is not None:
            template = value[0] if len(value) else GetMessageClass(f.message_type)()
            for _ in range(n):
                value.add().CopyFrom(template)
        else:
            item = value[0] if len(value) else _scalar(f, rng)
            value.extend([item] * n)
    elif f.message_type is not None:  # one more element, maybe a duplicate
        if len(value) and rng.random() < 0.5:
            value.add().CopyFrom(value[rng.randrange(len(value))])
        else:
            item = value.add()
            if depth < 4:
                mutate(item, rng, depth + 1)
    else:
        value.append(_scalar(f, rng))


def mutated(base: Message, rng: random.Random) -> Message:
    out = type(base)()
    out.CopyFrom(base)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        mutate(out, rng)
    return out


def mutated_stream(out: list[Message], kind: type, rng: random.Random) -> list[Message]:
    """The request stream, its messages changed, dropped, repeated, swapped or of another part."""
    for _ in range(rng.choice([1, 1, 2, 3])):
        pick = rng.randrange(6)
        if pick <= 1 and out:
            i = rng.randrange(len(out))
            part = out[i].WhichOneof("part")
            if part is not None:
                mutate(getattr(out[i], part), rng)
        elif pick == 2 and out:
            del out[rng.randrange(len(out))]
        elif pick == 3 and out:
            i = rng.randrange(len(out))
            out.insert(rng.randrange(len(out) + 1), out[i])
        elif pick == 4 and len(out) > 1:
            i, j = rng.sample(range(len(out)), 2)
            out[i], out[j] = out[j], out[i]
        else:  # a message of a random part, default or mutated
            m = kind()
            part = rng.choice(m.DESCRIPTOR.oneofs_by_name["part"].fields)
            getattr(m, part.name).SetInParent()
            if rng.random() < 0.5:
                mutate(getattr(m, part.name), rng)
            out.insert(rng.randrange(len(out) + 1), m)
    return out


def corrupted(raw: bytes, rng: random.Random) -> bytes:
    """Wire bytes that may not parse: flipped, cut, extended, bad UTF-8, random."""
    pick = rng.randrange(6)
    if pick == 0 and raw:
        b = bytearray(raw)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if pick == 1 and raw:
        return raw[: rng.randrange(len(raw))]
    if pick == 2:
        return raw + rng.randbytes(rng.randrange(1, 9))
    if pick == 3:  # field 1 as a length-delimited string of invalid UTF-8
        return raw + b"\x0a\x04\xff\xfe\xc0\x80"
    if pick == 4:  # a length longer than the message, or a varint that never ends
        return raw + rng.choice([b"\x0a\x7f", b"\x08" + b"\xff" * 11, b"\x0f", b"\x80"])
    return rng.randbytes(rng.randrange(1, 64))


# ----- calls ---------------------------------------------------------------------------------


def _serialize(m: Message | bytes) -> bytes:
    return m if isinstance(m, bytes) else m.SerializeToString()


class Service:
    """Raw calls to every RPC of one service, no retries, each bounded by CALL_S.

    Request streams go through the sync API: an asyncio client whose write fails as the server
    ends the call reports INTERNAL "Internal error from Core" in place of the server's status
    (grpc/grpc#36066), and a fuzzer keeps writing where a real client would have stopped.
    """

    def __init__(self, address: str, pb: Any, name: str) -> None:
        self.pb = pb
        self.desc = pb.DESCRIPTOR.services_by_name[name]
        self.domain = self.desc.full_name.rsplit(".", 1)[0]
        options = [("grpc.max_receive_message_length", -1)]
        self.channel = grpc.aio.insecure_channel(address, options=options)
        self._sync = grpc.insecure_channel(address, options=options)
        self.methods = {}
        for m in self.desc.methods:
            path = f"/{self.desc.full_name}/{m.name}"
            if m.client_streaming:
                rpc = self._sync.stream_stream(path, request_serializer=_serialize)
            elif m.server_streaming:
                rpc = self.channel.unary_stream(path, request_serializer=_serialize)
            else:
                rpc = self.channel.unary_unary(path, request_serializer=_serialize)
            self.methods[m.name] = (m, rpc)

    async def close(self) -> None:
        await self.channel.close()
        self._sync.close()

    def request(self, method: str, **fields) -> Message:
        return getattr(self.pb, self.methods[method][0].input_type.name)(**fields)

    async def call(self, method: str, request) -> tuple[grpc.StatusCode, Any, list]:
        """(code, ErrorInfo or None, other details) of one call; raw responses are dropped."""
        m, rpc = self.methods[method]
        try:
            if m.client_streaming:
                await asyncio.wait_for(asyncio.to_thread(_drain, rpc, request), CALL_S + 5)
            elif m.server_streaming:
                await asyncio.wait_for(_drain_async(rpc(request, timeout=CALL_S)), CALL_S + 5)
            else:
                await asyncio.wait_for(rpc(request, timeout=CALL_S), CALL_S + 5)
        except grpc.RpcError as exc:
            info, others = error_info(exc)
            return exc.code(), info, [*others, exc.details()]
        except TimeoutError:
            return code.DEADLINE_EXCEEDED, None, ["the client-side backstop fired"]
        return code.OK, None, []


def _drain(rpc, messages: list) -> None:
    for _ in rpc(iter(messages), timeout=CALL_S):
        pass


async def _drain_async(call) -> None:
    async for _ in call:
        pass


def check(svc: Service, method: str, what: str, got: tuple) -> grpc.StatusCode:
    status, info, details = got
    assert status not in NEVER, f"{method} {what}: {status} {details}"
    if status != code.OK:
        assert info is not None and info.reason, f"{method} {what}: {status} without ErrorInfo"
        assert info.domain == svc.domain, (method, what, info)
    return status


def _short(m: Any) -> str:
    text = repr(m) if isinstance(m, bytes) else str(m).replace("\n", " ")
    return text if len(text) < 300 else text[:300] + "..."


async def fuzz(
    svc: Service,
    method: str,
    base: Message | list[Message],
    seed: int,
    *,
    rounds: int = ROUNDS,
    tame: Callable[[Message], None] | None = None,
    vary: Callable[[Message, int], None] | None = None,
) -> None:
    """`rounds` mutated requests and RAW_ROUNDS corrupted ones to `method`; per-call checks.

    `tame` bounds fields that only make a valid call wait (a fetch's max_wait); `vary` makes
    each request's ids fresh, so an accepted one does not turn the next into a repeat."""
    rng = random.Random(f"{SEED}/{svc.desc.name}/{method}/{seed}")
    stream = isinstance(base, list)
    for i in range(rounds + RAW_ROUNDS):
        if stream:
            req: Any = [type(m).FromString(m.SerializeToString()) for m in base]
            if vary is not None:
                vary(req, i)
            req = mutated_stream(req, type(base[0]), rng)
            if i >= rounds:
                j = rng.randrange(len(req)) if req else 0
                req = [*req[:j], corrupted(_serialize(req[j]) if req else b"", rng), *req[j + 1 :]]
        else:
            req = type(base)()
            req.CopyFrom(base)
            if vary is not None:
                vary(req, i)
            req = mutated(req, rng)
            if tame is not None:
                tame(req)
            undecodable = False
            if i >= rounds:
                req = corrupted(req.SerializeToString(), rng)
                try:
                    parsed = type(base).FromString(req)
                except DecodeError:
                    undecodable = True
                else:
                    if tame is not None:  # bytes that still parse must not wait either
                        tame(parsed)
                        req = parsed.SerializeToString()
        got = await svc.call(method, req)
        check(svc, method, _short(req), got)
        if not stream and undecodable:
            assert got[0] == code.INVALID_ARGUMENT and got[1].reason == "MALFORMED_REQUEST", got


async def expect_invalid(svc: Service, method: str, request, field: str) -> None:
    """INVALID_ARGUMENT with ErrorInfo, naming `field` in a BadRequest or the message."""
    got = await svc.call(method, request)
    status, _, details = got
    assert status == code.INVALID_ARGUMENT, (method, field, status, details)
    check(svc, method, field, got)
    named = [
        v.field
        for d in details
        if isinstance(d, error_details_pb2.BadRequest)
        for v in d.field_violations
    ]
    text = " ".join(str(d) for d in details if isinstance(d, str))
    assert any(field in n for n in named) or field in text, (method, field, named, text)


def edit(base: Message, change: Callable[[Any], None]) -> Message:
    out = type(base)()
    out.CopyFrom(base)
    change(out)
    return out


async def serving_health(channel: grpc.aio.Channel, service: str) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    resp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_S)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def run(coro, timeout_s: float = 120.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def _ids(prefix: str) -> Callable[[Message, int], None]:
    def vary(req: Message, i: int) -> None:
        for name in ("request_id", "instance_id"):
            if name in req.DESCRIPTOR.fields_by_name and getattr(req, name):
                setattr(req, name, f"{prefix}-{i}")

    return vary


# ----- Dataflow ------------------------------------------------------------------------------


def _bounded_wait(req: Message) -> None:
    """A FetchBatch that waits (default 10 s) is not a hang: keep waits short, keep negatives."""
    if not req.HasField("max_wait") or req.max_wait.ToNanoseconds() > 100_000_000:
        req.max_wait.FromMilliseconds(20)


def dataflow_bases(svc: Service) -> dict[str, Message]:
    pv = version_pb2.PolicyVersion(policy_id="policy", version=0, version_id="0")
    fetch = svc.request("FetchBatch", policy_id="policy", num_groups=2, request_id="r",
                        trainer_id="t", trainer_version=0)  # fmt: skip
    fetch.max_wait.FromMilliseconds(20)
    return {
        "RegisterInstance": register_request(
            loaded_versions=[pv], contract_version="1.0.0", incarnation="i1"
        ),
        "HeartbeatInstance": svc.request(
            "HeartbeatInstance",
            instance_id="raas-1",
            free_slots=4,
            loaded_versions=[pv],
            pending_results=0,
        ),
        "DeregisterInstance": svc.request("DeregisterInstance", instance_id="raas-gone"),
        "FetchBatch": fetch,
        "AckBatch": svc.request("AckBatch", batch_id="b-1"),
        "ExtendBatchLease": svc.request("ExtendBatchLease", batch_id="b-1"),
        "AnnounceVersion": svc.request(
            "AnnounceVersion", version=pv, weights_address="127.0.0.1:1", trainer_id="t"
        ),
        "GetStatus": svc.request("GetStatus"),
        "GetCapabilities": svc.request("GetCapabilities"),
    }


def dataflow_invalid(b: dict[str, Message]) -> list[tuple[str, Message, str]]:
    """Requests that break a bound dataflow_service.proto states, with the field at fault."""

    def labels(n: int, value: str = "v") -> Callable[[Any], None]:
        return lambda r: r.labels.update({f"k{i}": value for i in range(n)})

    cases = [
        ("RegisterInstance", lambda r: setattr(r, "instance_id", ""), "instance_id"),
        ("RegisterInstance", lambda r: setattr(r, "instance_id", "x" * 129), "instance_id"),
        ("RegisterInstance", lambda r: setattr(r, "address", ""), "address"),
        ("RegisterInstance", lambda r: setattr(r, "address", "x" * 129), "address"),
        ("RegisterInstance", lambda r: setattr(r, "capacity", 0), "capacity"),
        ("RegisterInstance", lambda r: setattr(r, "capacity", -(2**31)), "capacity"),
        ("RegisterInstance", lambda r: r.ClearField("policy_ids"), "policy_ids"),
        ("RegisterInstance", lambda r: r.policy_ids.extend(["p"] * 256), "policy_ids"),
        ("RegisterInstance", lambda r: r.policy_ids.append(""), "policy_ids"),
        ("RegisterInstance", lambda r: r.ClearField("workflows"), "workflows"),
        ("RegisterInstance", lambda r: r.workflows.append("w" * 129), "workflows"),
        ("RegisterInstance", labels(257), "labels"),
        ("RegisterInstance", labels(1, "v" * 1025), "labels"),
        ("RegisterInstance", lambda r: r.labels.update({"": "v"}), "labels"),
        ("RegisterInstance", lambda r: r.loaded_versions.add(policy_id=""), "loaded_versions"),
        ("RegisterInstance", lambda r: r.loaded_versions.add(policy_id="policy", version=-1),
         "loaded_versions"),
        ("RegisterInstance", lambda r: r.loaded_versions.extend([r.loaded_versions[0]] * 257),
         "loaded_versions"),
        ("RegisterInstance", lambda r: setattr(r, "contract_version", "1" * 129), "contract_version"),
        ("RegisterInstance", lambda r: setattr(r, "incarnation", "i" * 129), "incarnation"),
        ("HeartbeatInstance", lambda r: setattr(r, "instance_id", ""), "instance_id"),
        ("HeartbeatInstance", lambda r: setattr(r, "free_slots", -1), "free_slots"),
        ("HeartbeatInstance", lambda r: setattr(r, "pending_results", -1), "pending_results"),
        ("HeartbeatInstance", lambda r: r.loaded_versions.add(policy_id="x" * 129),
         "loaded_versions"),
        ("DeregisterInstance", lambda r: setattr(r, "instance_id", ""), "instance_id"),
        ("DeregisterInstance", lambda r: setattr(r, "instance_id", "x" * 129), "instance_id"),
        ("FetchBatch", lambda r: setattr(r, "policy_id", ""), "policy_id"),
        ("FetchBatch", lambda r: setattr(r, "num_groups", 0), "num_groups"),
        ("FetchBatch", lambda r: setattr(r, "num_groups", 65537), "num_groups"),
        ("FetchBatch", lambda r: setattr(r, "num_groups", -1), "num_groups"),
        ("FetchBatch", lambda r: setattr(r, "request_id", ""), "request_id"),
        ("FetchBatch", lambda r: setattr(r, "request_id", "r" * 129), "request_id"),
        ("FetchBatch", lambda r: setattr(r, "trainer_id", "t" * 129), "trainer_id"),
        ("FetchBatch", lambda r: r.max_wait.FromMilliseconds(-1), "max_wait"),
        ("FetchBatch", lambda r: setattr(r, "trainer_version", -1), "trainer_version"),
        ("AckBatch", lambda r: setattr(r, "batch_id", ""), "batch_id"),
        ("AckBatch", lambda r: setattr(r, "batch_id", "b" * 129), "batch_id"),
        ("ExtendBatchLease", lambda r: setattr(r, "batch_id", ""), "batch_id"),
        ("ExtendBatchLease", lambda r: setattr(r, "batch_id", "b" * 129), "batch_id"),
        ("AnnounceVersion", lambda r: r.ClearField("version"), "version.policy_id"),
        ("AnnounceVersion", lambda r: setattr(r.version, "version", -1), "version.version"),
        ("AnnounceVersion", lambda r: setattr(r.version, "version_id", "v" * 129),
         "version.version_id"),
        # A version_id names bytes in a WeightService: one path segment, "initial" reserved.
        ("AnnounceVersion", lambda r: setattr(r.version, "version_id", "a/b"),
         "version.version_id"),
        ("AnnounceVersion", lambda r: setattr(r.version, "version_id", ".."),
         "version.version_id"),
        ("AnnounceVersion", lambda r: setattr(r.version, "version_id", "initial"),
         "version.version_id"),
        ("AnnounceVersion", lambda r: setattr(r, "weights_address", ""), "weights_address"),
        ("AnnounceVersion", lambda r: setattr(r, "trainer_id", "t" * 129), "trainer_id"),
    ]  # fmt: skip
    return [(m, edit(b[m], change), field) for m, change, field in cases]


async def _dataflow_sane(svc: Service, df) -> None:
    status = df_pb.GetStatusResponse.FromString(
        await svc.methods["GetStatus"][1](df_pb.GetStatusRequest(), timeout=CALL_S)
    )
    (policy,) = status.policies
    assert policy.policy_id == "policy" and policy.current_version >= 0
    assert 0 <= policy.buffered_groups <= policy.buffer_capacity and policy.leased_groups >= 0
    assert status.gate.in_flight_groups >= 0
    assert all(v >= 0 for v in status.counters.values()), status.counters
    assert status.counters.get("collector_failures", 0) == 0
    assert 0.0 <= status.gate.staleness <= 1.0 and 0.0 <= status.gate.buffer_fill_ratio <= 1.0
    for inst in status.instances:
        assert inst.state != df_pb.INSTANCE_STATE_UNSPECIFIED and inst.capacity >= 1
    assert df._tasks and not any(t.done() for t in df._tasks), "a Dataflow loop died"


async def _batch(svc: Service, request_id: str) -> str:
    """The id of a valid, whole batch, waiting for the scripted RaaS's groups."""
    req = svc.request("FetchBatch", policy_id="policy", num_groups=2, request_id=request_id)
    req.max_wait.FromSeconds(10)
    parts = [df_pb.FetchBatchResponse.FromString(raw) async for raw in
             svc.methods["FetchBatch"][1](req, timeout=15)]  # fmt: skip
    kinds = [p.WhichOneof("part") for p in parts]
    assert kinds[0] == "header" and kinds[-1] == "footer" and set(kinds[1:-1]) == {"trajectories"}
    assert parts[0].header.num_groups == 2 and parts[-1].footer.num_trajectories == sum(
        len(p.trajectories.trajectories) for p in parts[1:-1]
    )
    return parts[0].header.batch_id


@pytest.mark.slow
def test_dataflow_survives_fuzzed_requests_on_every_rpc(dataset: Path, tmp_path: Path):
    stream = {"name": "s", "dataset": {"path": str(dataset), "num_epochs": 0},
              "policy_ids": ["policy"], "group_size": 4, "sampling": {"max_new_tokens": 8}}  # fmt: skip
    config = make_config(dataset, tmp_path / "state", streams=[stream])

    async def body() -> None:
        async with (
            running_dataflow(config) as (server, df, _client),
            raas(capacity=16, dataflow_address=server.address),
        ):
            svc = Service(server.address, df_pb, "DataflowService")
            bases = dataflow_bases(svc)
            assert set(bases) == set(svc.methods)
            # A real batch, so acknowledgements and lease extensions reach the batch book.
            batch_id = await _batch(svc, "before-fuzz")
            for name in ("AckBatch", "ExtendBatchLease"):
                bases[name].batch_id = batch_id
            for method, request, field in dataflow_invalid(bases):
                await expect_invalid(svc, method, request, field)
            for i, (method, base) in enumerate(bases.items()):
                tame = _bounded_wait if method == "FetchBatch" else None
                await fuzz(svc, method, base, i, tame=tame, vary=_ids(method))
            await _dataflow_sane(svc, df)
            # Still serving: the scripted RaaS still feeds batches, which are acknowledged;
            # a registration, its heartbeat and its departure.
            batch_id = await _batch(svc, "after-fuzz")
            ack = await svc.call("AckBatch", svc.request("AckBatch", batch_id=batch_id))
            assert ack[0] == code.OK, ack
            status = df_pb.GetStatusResponse.FromString(
                await svc.methods["GetStatus"][1](df_pb.GetStatusRequest(), timeout=CALL_S)
            )
            states = {i.instance_id: i.state for i in status.instances}
            assert states["raas-test"] == df_pb.INSTANCE_STATE_ACTIVE
            ok = register_request(instance_id="ok", address="127.0.0.1:2")
            assert (await svc.call("RegisterInstance", ok))[0] == code.OK
            ok_hb = svc.request("HeartbeatInstance", instance_id="ok", free_slots=1)
            assert (await svc.call("HeartbeatInstance", ok_hb))[0] == code.OK
            gone = svc.request("DeregisterInstance", instance_id="ok")
            assert (await svc.call("DeregisterInstance", gone))[0] == code.OK
            await serving_health(svc.channel, svc.desc.full_name)
            await _dataflow_sane(svc, df)
            await svc.close()

    run(body())


@pytest.mark.slow
def test_fuzzed_requests_on_every_rpc_leave_the_epoch_accounting_intact(tmp_path: Path):
    """Fuzzing is not only surviving: while a bounded epoch's rollouts flow, every Dataflow RPC
    gets the seeded malformed and random requests (fake instances register, heartbeat and leave;
    fetches lease real groups and never acknowledge them; versions are announced; the trainer's
    own batch is acknowledged and extended by strangers). Afterwards a trainer drains the epoch:
    each group is trained exactly once and the work table ends every group done and accepted,
    n in all, with no result dropped as unknown."""
    from tests.test_dataflow_invariants import (
        POLICY,
        Trainer,
        all_ids,
        assert_epoch_trained_once,
        dataflow_config,
        epoch_finished,
        until,
    )
    from tests.test_dataflow_invariants import raas as scripted_raas

    n = 24
    # Batches the fuzz leases (and drops) come back to the buffer within a second.
    config = dataflow_config(tmp_path, n, leases={"batch_lease_s": 1.0})

    async def body():
        # Two groups at a time, 0.4 s each: the epoch's rollouts run through most of the fuzz.
        gen = ScriptedGenerator(delay_s=0.4)
        async with (
            running_dataflow(config) as (server, df, client),
            scripted_raas(server.address, gen, capacity=8, name="raas-fuzz"),
        ):
            trainer = Trainer(client)
            svc = Service(server.address, df_pb, "DataflowService")
            bases = dataflow_bases(svc)
            await until(lambda: df.buffers[POLICY], 5.0, "the first group")
            before = df.status()["counters"]
            assert not epoch_finished(df) and before.get("groups_done", 0) < n
            for method, request, field in dataflow_invalid(bases):
                await expect_invalid(svc, method, request, field)
            held = None
            for i, (method, base) in enumerate(bases.items()):
                if method == "AckBatch":
                    # A batch the trainer holds, so acknowledgements and lease extensions
                    # reach a real, leased batch of the epoch.
                    while held is None:
                        held = await trainer.fetch(2, max_wait_s=5.0)
                    for name in ("AckBatch", "ExtendBatchLease"):
                        bases[name].batch_id = held.header.batch_id
                tame = _bounded_wait if method == "FetchBatch" else None
                await fuzz(svc, method, base, i, tame=tame, vary=_ids(method))
            assert held is not None
            during = df.status()["counters"]
            await _dataflow_sane(svc, df)
            await svc.close()
            # Rollouts came in while the fuzz ran, and fuzzed fetches leased some of them (the
            # trainer's batch is one more).
            assert during["completed_groups"] > before.get("completed_groups", 0), during
            assert during["batches_served"] > 1, during
            # The trainer acknowledges its batch: it trains those groups unless the lease ran
            # out (then they went back to the buffer and come again). A stranger's ack of it
            # (the fuzz's request bytes may still name it) consumed them for the trainer.
            try:
                ack = await client.ack_batch(held.header.batch_id)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == code.FAILED_PRECONDITION, exc
                assert error_info(exc)[0].reason == "BATCH_LEASE_EXPIRED", exc
            else:
                assert ack.consumed_groups in (0, held.header.num_groups), ack
                trainer.batches.append(held)
                trainer.consumed.extend(held.group_ids)
            # Fuzzed announcements may have moved the policy's version on: train at it.
            trainer.version = df.versions.current(POLICY)
            await trainer.drain(df, timeout_s=20.0)
            return trainer, df.status(), {r.group_id: r for r in df.store.work_rows()}

    trainer, status, rows = run(body(), timeout_s=60.0)
    assert_epoch_trained_once(trainer.consumed, n)
    assert set(rows) == all_ids(n), "the work table does not hold exactly the epoch's groups"
    assert {r.state for r in rows.values()} == {"done"}, Counter(r.state for r in rows.values())
    outcomes = Counter(r.outcome for r in rows.values())
    assert outcomes == {f"{POLICY}:accepted": n}, outcomes
    c = status["counters"]
    assert c["groups_done"] == n == c["completed_groups"] == c["consumed_groups"], c
    assert c[f"buffer.{POLICY}.accepted"] == n, c
    assert c["consumed_trajectories"] == sum(len(b.trajectories) for b in trainer.batches)
    for counter in ("unknown_results_dropped", "duplicates_dropped", "failed_groups",
                    "malformed_results", "collector_failures"):  # fmt: skip
        assert c.get(counter, 0) == 0, (counter, c)
    (policy,) = status["policies"]
    assert policy["buffered_groups"] == 0 and policy["leased_groups"] == 0, policy


# ----- RaaS ----------------------------------------------------------------------------------


def _bounded_collect(req: Message) -> None:
    """A CollectResults may wait up to 30 s for results: keep waits short, keep the invalid."""
    wait = req.max_wait.ToNanoseconds()
    if 100_000_000 < wait <= 30_000_000_000:
        req.max_wait.FromMilliseconds(20)


def _fresh_groups(req: Message, i: int) -> None:
    for j, g in enumerate(req.groups):
        g.group_id = f"fz-{i}-{j}"


def raas_bases(svc: Service) -> dict[str, Message]:
    g = group("g-0", n=2, tokens=8)
    g.prompt.token_ids.CopyFrom(to_array(np.arange(4, dtype=np.int32)))
    g.prompt.data.update({"answer": "2", "tests": [1, 2.5, None, True, {"x": "y"}]})
    g.sampling_params.stop_strings.append("\n")
    g.sampling_params.stop_token_ids.append(0)
    g.reward = ""
    g.epoch = 1
    collect = svc.request("CollectResults", max_groups=4)
    collect.max_wait.FromMilliseconds(10)
    batch = svc.request("CollectResultBatch", ack_group_ids=["g-0"], max_groups=4)
    batch.max_wait.FromMilliseconds(10)
    pv = version_pb2.PolicyVersion(policy_id="policy", version=1, version_id="1")
    return {
        "SubmitGroups": svc.request("SubmitGroups", groups=[g]),
        "CollectResults": collect,
        "AckResults": svc.request("AckResults", group_ids=["g-0"]),
        "CollectResultBatch": batch,
        "CancelGroups": svc.request("CancelGroups", group_ids=["g-0"]),
        "LoadWeights": svc.request(
            "LoadWeights", versions=[pv], weights_address="127.0.0.1:1", request_id="L1"
        ),
        "GetStatus": svc.request("GetStatus"),
        "GetCapabilities": svc.request("GetCapabilities"),
    }


def raas_invalid(b: dict[str, Message]) -> list[tuple[str, Message, str]]:
    def g0(change: Callable[[Any], None]) -> Callable[[Any], None]:
        return lambda r: change(r.groups[0])

    def sp(name: str, value: Any) -> Callable[[Any], None]:
        return g0(lambda g: setattr(g.sampling_params, name, value))

    def arr(dtype: str, shape: list[int], data: bytes) -> Callable[[Any], None]:
        return g0(lambda g: g.prompt.token_ids.CopyFrom(
            array_pb2.NDArray(dtype=dtype, shape=shape, data=data)))  # fmt: skip

    cases = [
        ("SubmitGroups", lambda r: r.ClearField("groups"), "groups"),
        ("SubmitGroups", lambda r: r.groups.extend([r.groups[0]] * 1024), "groups"),
        ("SubmitGroups", lambda r: r.groups.append(r.groups[0]), "groups[1].group_id"),
        ("SubmitGroups", g0(lambda g: setattr(g, "group_id", "")), "group_id"),
        ("SubmitGroups", g0(lambda g: setattr(g, "group_id", "g" * 257)), "group_id"),
        ("SubmitGroups", g0(lambda g: setattr(g, "workflow", "w" * 129)), "workflow"),
        ("SubmitGroups", g0(lambda g: setattr(g, "workflow", "../single_turn")), "workflow"),
        ("SubmitGroups", g0(lambda g: setattr(g, "reward", "r" * 129)), "reward"),
        ("SubmitGroups", g0(lambda g: setattr(g.prompt, "text", "x" * (1 << 20) + "x")),
         "prompt.text"),
        ("SubmitGroups", g0(lambda g: g.ClearField("policy_ids")), "policy_ids"),
        ("SubmitGroups", g0(lambda g: g.policy_ids.append("policy")), "policy_ids"),
        ("SubmitGroups", g0(lambda g: g.policy_ids.extend([f"p{i}" for i in range(64)])),
         "policy_ids"),
        ("SubmitGroups", g0(lambda g: setattr(g, "num_samples", 0)), "num_samples"),
        ("SubmitGroups", g0(lambda g: setattr(g, "num_samples", 1025)), "num_samples"),
        ("SubmitGroups", g0(lambda g: setattr(g, "num_samples", -1)), "num_samples"),
        ("SubmitGroups", sp("max_new_tokens", 0), "max_new_tokens"),
        ("SubmitGroups", sp("temperature", -1.0), "temperature"),
        ("SubmitGroups", sp("temperature", math.nan), "temperature"),
        ("SubmitGroups", sp("temperature", math.inf), "temperature"),
        ("SubmitGroups", sp("temperature", 1e-40), "temperature"),  # logits / T overflows
        ("SubmitGroups", sp("top_p", 1.5), "top_p"),
        ("SubmitGroups", sp("top_p", math.nan), "top_p"),
        ("SubmitGroups", sp("top_k", -1), "top_k"),
        ("SubmitGroups", g0(lambda g: g.sampling_params.stop_strings.extend(["s"] * 64)),
         "stop_strings"),
        ("SubmitGroups", g0(lambda g: g.sampling_params.stop_strings.append("")), "stop_strings"),
        ("SubmitGroups", g0(lambda g: g.sampling_params.stop_strings.append("s" * 1025)),
         "stop_strings"),
        ("SubmitGroups", g0(lambda g: g.sampling_params.stop_token_ids.append(-1)),
         "stop_token_ids"),
        ("SubmitGroups", g0(lambda g: g.sampling_params.stop_token_ids.extend([1] * 1024)),
         "stop_token_ids"),
        ("SubmitGroups", arr("int32", [4], b"\x00" * 15), "prompt.token_ids"),
        ("SubmitGroups", arr("float32", [4], b"\x00" * 16), "prompt.token_ids"),
        ("SubmitGroups", arr("complex64", [1], b"\x00" * 8), "prompt.token_ids"),
        ("SubmitGroups", arr("int32", [2, 2], b"\x00" * 16), "prompt.token_ids"),
        ("SubmitGroups", arr("int32", [-1], b""), "prompt.token_ids"),
        ("SubmitGroups", arr("int32", [1] * 65, b"\x00" * 4), "prompt.token_ids"),
        ("SubmitGroups", arr("int64", [2**62, 2**62], b""), "prompt.token_ids"),
        ("SubmitGroups", g0(lambda g: g.prompt.data.update({"x": math.inf})), "prompt.data"),
        ("SubmitGroups", g0(lambda g: g.prompt.data.update({"x": [math.nan]})), "prompt.data"),
        ("CollectResults", lambda r: setattr(r, "max_groups", 0), "max_groups"),
        ("CollectResults", lambda r: setattr(r, "max_groups", 4097), "max_groups"),
        ("CollectResults", lambda r: r.max_wait.FromMilliseconds(-1), "max_wait"),
        ("CollectResults", lambda r: r.max_wait.FromSeconds(31), "max_wait"),
        ("CollectResultBatch", lambda r: setattr(r, "max_groups", 0), "max_groups"),
        ("CollectResultBatch", lambda r: setattr(r, "max_groups", 4097), "max_groups"),
        ("CollectResultBatch", lambda r: r.max_wait.FromSeconds(31), "max_wait"),
        ("CollectResultBatch", lambda r: r.ack_group_ids.extend(["g"] * 4096), "ack_group_ids"),
        ("AckResults", lambda r: r.ClearField("group_ids"), "group_ids"),
        ("AckResults", lambda r: r.group_ids.extend(["g"] * 4096), "group_ids"),
        ("CancelGroups", lambda r: r.ClearField("group_ids"), "group_ids"),
        ("CancelGroups", lambda r: r.group_ids.extend(["g"] * 4096), "group_ids"),
        ("LoadWeights", lambda r: r.ClearField("versions"), "versions"),
        ("LoadWeights", lambda r: setattr(r, "weights_address", ""), "weights_address"),
        ("LoadWeights", lambda r: setattr(r, "weights_address", "a" * 257), "weights_address"),
        ("LoadWeights", lambda r: setattr(r, "request_id", ""), "request_id"),
        ("LoadWeights", lambda r: setattr(r, "request_id", "r" * 129), "request_id"),
        ("LoadWeights", lambda r: setattr(r.versions[0], "version", -1), "version"),
        ("LoadWeights", lambda r: setattr(r.versions[0], "version_id", "v" * 129), "version_id"),
        ("LoadWeights", lambda r: setattr(r.versions[0], "version_id", "../1"), "version_id"),
        ("LoadWeights", lambda r: setattr(r.versions[0], "version_id", "initial"), "version_id"),
        ("LoadWeights", lambda r: setattr(r.versions[0], "policy_id", "nope"), "policy_id"),
        ("LoadWeights", lambda r: r.versions.append(r.versions[0]), "policy_id"),
        ("LoadWeights", lambda r: r.policy_weights_addresses.update({"nope": "h:1"}),
         "policy_weights_addresses"),
        ("LoadWeights", lambda r: r.policy_weights_addresses.update({"policy": ""}),
         "policy_weights_addresses"),
        # Errors that echo a long value still fit the client's 8 KiB trailer limit.
        ("LoadWeights", lambda r: setattr(r.versions[0], "policy_id", "\U0001f600" * 3000),
         "policy_id"),
        ("LoadWeights", lambda r: r.policy_weights_addresses.update({"x" * 5000: "h:1"}),
         "policy_weights_addresses"),
    ]  # fmt: skip
    return [(m, edit(b[m], change), field) for m, change, field in cases]


async def _raas_sane(svc: Service, servicer, capacity: int) -> raas_pb.GetStatusResponse:
    status = raas_pb.GetStatusResponse.FromString(
        await svc.methods["GetStatus"][1](raas_pb.GetStatusRequest(), timeout=CALL_S)
    )
    assert status.capacity == capacity and 0 <= status.free_slots <= capacity, status
    assert status.running_groups >= 0 and status.pending_results >= 0
    assert status.free_slots == servicer.store.free_slots
    assert all(v.version >= 0 for v in status.loaded_versions)
    return status


@pytest.mark.slow
def test_raas_survives_fuzzed_requests_on_every_rpc():
    capacity = 16

    async def body() -> None:
        async with raas(capacity=capacity) as (client, servicer):
            svc = Service(client.address, raas_pb, "RolloutService")
            bases = raas_bases(svc)
            assert set(bases) == set(svc.methods)
            for method, request, field in raas_invalid(bases):
                await expect_invalid(svc, method, request, field)
            for i, (method, base) in enumerate(bases.items()):
                tame = (
                    _bounded_collect if method in ("CollectResults", "CollectResultBatch") else None
                )
                vary = _fresh_groups if method == "SubmitGroups" else _ids(method)
                await fuzz(svc, method, base, i, tame=tame, vary=vary)
            # Every accepted group finishes; then a fresh one runs and is delivered whole.
            for _ in range(500):
                if not servicer.groups.tasks:
                    break
                await asyncio.sleep(0.01)
            assert not servicer.groups.tasks, "groups still running after the fuzz"
            status = await _raas_sane(svc, servicer, capacity)
            assert status.free_slots == capacity and status.running_groups == 0
            pending = [r.result.group_id async for r in client.stub.CollectResults(
                raas_pb.CollectResultsRequest(max_groups=4096), timeout=CALL_S)]  # fmt: skip
            if pending:
                await client.ack_results(pending)
            # max_new_tokens has no bound on the wire: the scripted engine stops at its context
            # (it drew up to 2**31 tokens, 34 GB, on the event loop).
            groups = [group("after-fuzz", n=2), group("long", n=1, tokens=2**31 - 1)]
            ok = raas_pb.SubmitGroupsRequest(groups=groups)
            assert (await svc.call("SubmitGroups", ok))[0] == code.OK
            got = []
            for _ in range(100):
                got += await client.collect_results(max_groups=8, max_wait_s=0.1)
                if len({r.group_id for r in got}) == 2:
                    break
            by_id = {r.group_id: r for r in got}
            assert sorted(by_id) == ["after-fuzz", "long"]
            assert all(not r.HasField("error") for r in by_id.values())
            assert len(by_id["after-fuzz"].trajectories) == 2
            (seq,) = by_id["long"].trajectories[0].sequences
            assert seq.token_ids.shape[0] <= MAX_SEQ_LEN
            await client.ack_results(["after-fuzz", "long"])
            await _raas_sane(svc, servicer, capacity)
            await serving_health(svc.channel, svc.desc.full_name)
            await svc.close()

    run(body())


# ----- Trainer -------------------------------------------------------------------------------


def test_trainer_survives_fuzzed_requests_on_every_rpc(tmp_path: Path):
    from astra.servers.trainer_serve import start_trainer
    from astra.trainer.synthetic import MemorySink, SyntheticSource
    from tests.test_trainer_service import config

    async def body() -> None:
        cfg = config(port=0, checkpoint={"dir": str(tmp_path / "ckpt")})
        source = SyntheticSource("p", vocab_size=100)
        server, trainer = await start_trainer(cfg, source=source, sink=MemorySink(), grace_s=0)
        svc = Service(server.address, trainer_pb, "TrainerService")
        try:
            bases = {
                "GetStatus": svc.request("GetStatus"),
                "SaveCheckpoint": svc.request("SaveCheckpoint", request_id="ck"),
                "GetCapabilities": svc.request("GetCapabilities"),
                "Pause": svc.request("Pause", reason="fuzz", wait=True),
                "Resume": svc.request("Resume"),
            }
            assert set(bases) == set(svc.methods)
            invalid = [
                ("SaveCheckpoint", svc.request("SaveCheckpoint"), "request_id"),
                ("SaveCheckpoint", svc.request("SaveCheckpoint", request_id="c" * 129),
                 "request_id"),
                ("Pause", svc.request("Pause", reason="r" * 257), "reason"),
            ]  # fmt: skip
            for method, request, field in invalid:
                await expect_invalid(svc, method, request, field)
            for i, (method, base) in enumerate(bases.items()):
                # A checkpoint is a real write to disk: fewer rounds.
                rounds = 12 if method == "SaveCheckpoint" else ROUNDS
                await fuzz(svc, method, base, i, rounds=rounds)
            assert (await svc.call("Resume", bases["Resume"]))[0] == code.OK
            status = trainer_pb.GetStatusResponse.FromString(
                await svc.methods["GetStatus"][1](bases["GetStatus"], timeout=CALL_S)
            )
            assert status.policy_id == "p" and status.step == 0 and not status.paused
            assert not status.step_in_progress and status.world_size == 1
            result = await asyncio.wait_for(trainer.train_step_async(), 30)
            assert result.step == 1  # still trains
            paused = await svc.call("Pause", svc.request("Pause", reason="ok", wait=True))
            assert paused[0] == code.OK and trainer.paused
            assert (await svc.call("Resume", bases["Resume"]))[0] == code.OK and not trainer.paused
            await serving_health(svc.channel, svc.desc.full_name)
        finally:
            await svc.close()
            await server.stop(0)
            await trainer.shutdown()

    run(body())


# ----- WeightService -------------------------------------------------------------------------


def weights_bases(svc: Service, model: dict) -> dict[str, Any]:
    name = sorted(model)[0]
    data = bytes(range(200))
    header = w_pb.PublishHeader(policy_id="p", version_id="f", version=1, num_tensors=1,
                                metadata={"note": "fuzz"})  # fmt: skip
    publish = [
        w_pb.PublishVersionRequest(header=header),
        *_tensor_msgs("w", data),
        w_pb.PublishVersionRequest(file=w_pb.VersionFile(name="config.json", content=b"{}")),
        w_pb.PublishVersionRequest(commit=w_pb.PublishCommit(num_tensors=1)),
    ]
    start = w_pb.FetchStart(policy_id="p", target_version_id="v0", held_version_ids=["v0"],
                            receiver_id="rx", acknowledged_tensors=[name],
                            max_bytes_per_second=0)  # fmt: skip
    fetch = [
        w_pb.FetchVersionRequest(start=start),
        *(w_pb.FetchVersionRequest(ack=w_pb.TensorAck(name=n)) for n in sorted(model)),
    ]
    return {
        "PublishVersion": publish,
        "FetchVersion": fetch,
        "ListVersions": svc.request("ListVersions", policy_id="p", page_size=10),
        "GetVersion": svc.request("GetVersion", policy_id="p", version_id="v0"),
        "RollbackVersion": svc.request(
            "RollbackVersion",
            policy_id="p",
            source_version_id="v0",
            new_version_id="r",
            new_version=7,
            request_id="rb",
        ),
        "GetStatus": svc.request("GetStatus"),
        "GetCapabilities": svc.request("GetCapabilities"),
    }


def _fresh_policy(stream: list, i: int) -> None:
    """Each publish the first of its policy, so it reaches the tensors, files and commit."""
    stream[0].header.policy_id = f"f{i}"


def _fresh_rollback(req: Message, i: int) -> None:
    req.new_version_id, req.request_id, req.new_version = f"r{i}", f"rb{i}", 100 + i


def weights_invalid(b: dict[str, Any]) -> list[tuple[str, Any, str]]:
    publish, fetch = b["PublishVersion"], b["FetchVersion"]

    def header(change: Callable[[Any], None]) -> list:
        first = edit(publish[0], lambda r: change(r.header))
        return [first, *publish[1:]]

    def tensor(change: Callable[[Any], None]) -> list:
        return [publish[0], edit(publish[1], lambda r: change(r.tensor)), *publish[2:]]

    def start(change: Callable[[Any], None]) -> list:
        return [edit(fetch[0], lambda r: change(r.start)), *fetch[1:]]

    cases = [
        ("ListVersions", lambda r: setattr(r, "policy_id", ""), "policy_id"),
        ("ListVersions", lambda r: setattr(r, "policy_id", "p" * 129), "policy_id"),
        ("ListVersions", lambda r: setattr(r, "page_size", -1), "page_size"),
        ("ListVersions", lambda r: setattr(r, "page_size", 1001), "page_size"),
        ("ListVersions", lambda r: setattr(r, "page_token", "t" * 129), "page_token"),
        ("ListVersions", lambda r: setattr(r, "page_token", "!!"), "page_token"),
        ("ListVersions", lambda r: setattr(r, "page_token", "bm9wZQ=="), "page_token"),
        ("GetVersion", lambda r: setattr(r, "policy_id", ""), "policy_id"),
        ("GetVersion", lambda r: setattr(r, "version_id", ""), "version_id"),
        ("GetVersion", lambda r: setattr(r, "version_id", "v" * 129), "version_id"),
        ("GetVersion", lambda r: setattr(r, "version_id", "../v0"), "version_id"),
        ("GetVersion", lambda r: setattr(r, "version_id", ".."), "version_id"),
        ("GetVersion", lambda r: setattr(r, "version_id", "initial"), "version_id"),
        ("RollbackVersion", lambda r: setattr(r, "policy_id", ""), "policy_id"),
        ("RollbackVersion", lambda r: setattr(r, "source_version_id", "a/b"), "source_version_id"),
        ("RollbackVersion", lambda r: setattr(r, "new_version_id", ""), "new_version_id"),
        ("RollbackVersion", lambda r: setattr(r, "new_version_id", "x" * 129), "new_version_id"),
        ("RollbackVersion", lambda r: setattr(r, "new_version", -1), "new_version"),
        ("RollbackVersion", lambda r: setattr(r, "request_id", ""), "request_id"),
        ("RollbackVersion", lambda r: setattr(r, "request_id", "q" * 129), "request_id"),
    ]  # fmt: skip
    out: list[tuple[str, Any, str]] = [(m, edit(b[m], ch), f) for m, ch, f in cases]
    out += [
        ("PublishVersion", header(lambda h: setattr(h, "policy_id", "")), "header.policy_id"),
        ("PublishVersion", header(lambda h: setattr(h, "policy_id", "p" * 129)),
         "header.policy_id"),
        ("PublishVersion", header(lambda h: setattr(h, "version_id", "a/b")), "header.version_id"),
        ("PublishVersion", header(lambda h: setattr(h, "version_id", "")), "header.version_id"),
        ("PublishVersion", header(lambda h: setattr(h, "version", -1)), "header.version"),
        ("PublishVersion", header(lambda h: setattr(h, "num_tensors", -1)), "header.num_tensors"),
        ("PublishVersion", header(lambda h: setattr(h, "base_version_id", "x" * 129)),
         "header.base_version_id"),
        ("PublishVersion", header(lambda h: h.metadata.update({f"k{i}": "" for i in range(65)})),
         "header.metadata"),
        ("PublishVersion", header(lambda h: h.metadata.update({"": "v"})), "header.metadata"),
        ("PublishVersion", header(lambda h: h.metadata.update({"k": "v" * 4097})),
         "header.metadata"),
        ("PublishVersion", tensor(lambda t: t.ClearField("shape") or t.shape.extend([1] * 65)),
         "tensor.shape"),
        ("PublishVersion", tensor(lambda t: t.shape.__setitem__(0, -1)), "tensor.shape"),
        ("PublishVersion", tensor(lambda t: setattr(t, "name", "")), "name"),
        ("PublishVersion", tensor(lambda t: setattr(t, "name", "n" * 1025)), "name"),
        ("PublishVersion", tensor(lambda t: t.MergeFrom(w_pb.TensorHeader(size_bytes=7, encoded_size_bytes=7))), "tensor.size_bytes"),
        ("PublishVersion", tensor(lambda t: setattr(t, "encoding", 2)), "tensor.encoding"),
        ("PublishVersion", tensor(lambda t: setattr(t, "encoding", 99)), "tensor.encoding"),
        ("PublishVersion", tensor(lambda t: setattr(t, "encoded_size_bytes", 3)),
         "tensor.encoded_size_bytes"),
        ("PublishVersion", [publish[0], *publish[1:-1], edit(publish[-1],
          lambda r: setattr(r.commit, "num_tensors", 2))], "commit.num_tensors"),
        ("FetchVersion", start(lambda s: setattr(s, "policy_id", "")), "start.policy_id"),
        ("FetchVersion", start(lambda s: setattr(s, "target_version_id", "../x")),
         "start.target_version_id"),
        ("FetchVersion", start(lambda s: s.held_version_ids.extend(["v0"] * 64)),
         "start.held_version_ids"),
        ("FetchVersion", start(lambda s: setattr(s, "receiver_id", "r" * 129)),
         "start.receiver_id"),
        ("FetchVersion", start(lambda s: setattr(s, "max_bytes_per_second", 4095)),
         "start.max_bytes_per_second"),
        ("FetchVersion", start(lambda s: setattr(s, "max_bytes_per_second", -1)),
         "start.max_bytes_per_second"),
        # A name within 255 characters but not within the filesystem's 255 bytes.
        ("PublishVersion", [*header(lambda h: setattr(h, "policy_id", "files"))[:-2],
          w_pb.PublishVersionRequest(file=w_pb.VersionFile(name="\u00e9" * 128)), publish[-1]],
         "file name"),
        ("FetchVersion", [fetch[1], fetch[0]], "start"),
        ("FetchVersion", [], "start"),
        ("PublishVersion", [publish[1], *publish], "header"),
    ]  # fmt: skip
    return out


async def _weights_sane(svc: Service, server) -> w_pb.GetStatusResponse:
    status = w_pb.GetStatusResponse.FromString(
        await svc.methods["GetStatus"][1](w_pb.GetStatusRequest(), timeout=CALL_S)
    )
    assert status.active_fetches == 0 == server.servicer.active_fetches
    assert all(v >= 0 for v in status.counters.values()), status.counters
    for info in status.current_versions:
        got = await svc.call("GetVersion", w_pb.GetVersionRequest(
            policy_id=info.policy_id, version_id=info.version_id))  # fmt: skip
        assert got[0] == code.OK, got
    return status


@pytest.mark.slow
def test_weight_service_survives_fuzzed_requests_on_every_rpc(tmp_path: Path):
    from astra.clients.weights_stream import Receiver, publish_version

    model = bf16_model(1, n=3, size=1024)
    settings = StreamSettings(ack_timeout_s=2.0, first_message_timeout_s=2.0)

    async def body() -> None:
        async with serving(tmp_path / "store", settings) as server:
            await publish_version(server.address, "p", "v0", 0, model)
            svc = Service(server.address, w_pb, "WeightService")
            bases = weights_bases(svc, model)
            assert set(bases) == set(svc.methods)
            for method, request, field in weights_invalid(bases):
                await expect_invalid(svc, method, request, field)
            for i, (method, base) in enumerate(bases.items()):
                vary = {"RollbackVersion": _fresh_rollback, "PublishVersion": _fresh_policy}.get(
                    method
                )
                await fuzz(svc, method, base, i, vary=vary)
            await _weights_sane(svc, server)
            # v0 is intact, a new version publishes and every receiver gets it bit for bit.
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False)
            assert (await receiver.fetch("v0")).identity == "v0"
            assert same(receiver.current_path, model)
            await receiver.close()
            nxt = bf16_model(2, n=3, size=1024)
            done = await publish_version(server.address, "q", "after-fuzz", 0, nxt)
            assert done.version.current  # a new policy: the fuzz may have set p's to 2**63-1
            receiver = Receiver(server.address, "q", tmp_path / "rx-q", durable=False)
            assert (await receiver.fetch()).identity == "after-fuzz"
            assert same(receiver.current_path, nxt)
            await receiver.close()
            await _weights_sane(svc, server)
            await serving_health(svc.channel, svc.desc.full_name)
            await svc.close()

    run(body())


# ----- what Dataflow takes from a RaaS -------------------------------------------------------


def _result() -> rollout_pb2.GroupResult:
    out = rollout_pb2.GroupResult(group_id="s/0/1", instance_id="raas-1")
    for k in range(2):
        t = out.trajectories.add(trajectory_id=f"s/0/1/{k}", group_id="s/0/1", sample_index=k,
                                 reward=1.0, agent_rewards={"a": 1.0})  # fmt: skip
        t.sequences.add(
            policy_id="policy",
            prompt_length=2,
            token_ids=to_array(np.arange(5, dtype=np.int32)),
            logprobs=to_array(-np.ones(5, dtype=np.float32)),
            loss_mask=to_array(np.array([0, 0, 1, 1, 1], dtype=np.uint8)),
            weight_versions=to_array(np.array([-1, -1, 0, 0, 1], dtype=np.int64)),
            finish_reason=rollout_pb2.FINISH_REASON_STOP,
            reward=1.0,
        )
    return out


def test_malformed_group_results_are_refused_never_raised():
    """A RaaS's results are Dataflow's input too: each is valid or refused (`invalid`)."""
    rng = random.Random(f"{SEED}/results")
    base = _result()
    valid = incoming_group(base, "raas-1", base.SerializeToString())
    assert valid.invalid is None and len(valid.per_policy["policy"]) == 2
    outcomes = {"valid": 0, "invalid": 0, "error": 0}
    for _ in range(400):
        msg = mutated(base, rng)
        got = incoming_group(msg, "raas-1", msg.SerializeToString())
        outcomes["invalid" if got.invalid else "error" if got.error else "valid"] += 1
        for records in got.per_policy.values():
            for r in records:
                assert math.isfinite(r.reward), msg
    assert outcomes["invalid"] > 100, outcomes


# ----- wire-level corner cases ---------------------------------------------------------------


def test_chunk_fast_path_agrees_with_protobuf_or_falls_back():
    """Non-minimal varints are valid protobuf: the fast chunk parser must not raise on them
    (an empty chunk with a two-byte length was IndexError, so INTERNAL), and what it reads
    is what protobuf reads."""
    rng = random.Random(f"{SEED}/chunks")
    cases = [b"\x1a\x80\x00", b"\x1a\x81\x00\x08", b"\x1a\x02\x08\x80", b"\x1a\x00\x00",
             b"\x1a\x82\x00\x12\x00", b"\x1a\x04\x08\x81\x00\x12"]  # fmt: skip
    cases += [b"\x1a" + rng.randbytes(rng.randrange(8)) for _ in range(5000)]
    for raw in cases:
        got = parse_chunk(raw)
        if got is not None:
            msg = w_pb.PublishVersionRequest.FromString(raw)
            assert (msg.chunk.offset, msg.chunk.data) == (got.offset, bytes(got.data)), raw


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xff\xff", b"\x0a\x02\xff\xfe", b"\x0a\x7f", b"\x08" + b"\xff" * 11],
    ids=["corrupt", "bad-utf8", "cut-short", "endless-varint"],
)
def test_a_request_that_does_not_parse_is_invalid_argument(config, raw: bytes):
    async def body() -> None:
        async with running_dataflow(config) as (server, _df, _client):
            svc = Service(server.address, df_pb, "DataflowService")
            for method in ("RegisterInstance", "FetchBatch", "GetStatus"):
                try:
                    svc.request(method).FromString(raw)
                except DecodeError:
                    pass
                else:
                    continue  # an unknown field of a message without fields 1 parses
                status, info, details = await svc.call(method, raw)
                assert status == code.INVALID_ARGUMENT, (method, status, details)
                assert info is not None and info.reason == "MALFORMED_REQUEST", (method, info)
            await svc.close()

    run(body())
