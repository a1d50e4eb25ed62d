"""The servers enforce the numeric bounds the proto comments state on request fields.

tests/test_contracts.py checks that every request field states its bound; this checks the
four services keep them. Every request field of every RPC (at any depth, stream parts
included) is read from the stubs' descriptors, its comment from proto/ (the comment parser of
tests/test_contracts.py), and every bound stated in a form BOUND_FORMS reads becomes two calls
on a real server:

* at the bound (a string of exactly the maximum or minimum length, a repeated field or map
  with exactly that many entries, an integer at the end of its range, a duration of the
  maximum): not refused for that field. The call may fail for another reason (an unknown
  policy, an unreachable address, no free slots), but not INVALID_ARGUMENT naming the field
  for a reason other than those in NOT_A_BOUND;
* one past it (one character, entry, unit or nanosecond): INVALID_ARGUMENT with a
  google.rpc.ErrorInfo of the service's domain, naming the field in a BadRequest field
  violation, the ErrorInfo metadata or the message.

Stated bounds the parser does not read are listed, with the reason, in UNPARSED; a test fails
when a comment states one that is neither read nor listed. Cases where a server does not do
what the comment says are expected failures (strict), each saying what the server does.
The servers start once per module on one event loop thread, so the cases stay fast.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.rpc import error_details_pb2

from astra.dataflow.v1 import dataflow_service_pb2 as df_pb
from astra.raas.v1 import rollout_service_pb2 as raas_pb
from astra.trainer.v1 import trainer_service_pb2 as trainer_pb
from astra.weights.checksum import adler32_hex
from astra.weights.v1 import weight_service_pb2 as w_pb
from tests.conftest import make_config, running_dataflow
from tests.test_contracts import _messages
from tests.test_dataflow_service import register_request
from tests.test_raas_scripted import group, raas
from tests.test_rpc_fuzz import (
    Service,
    _fresh_groups,
    _fresh_policy,
    _fresh_rollback,
    _ids,
    check,
    dataflow_bases,
    raas_bases,
    weights_bases,
)
from tests.test_weights_service import serving
from tests.test_weights_store import bf16_model

code = grpc.StatusCode
SERVICES = {
    "DataflowService": df_pb,
    "RolloutService": raas_pb,
    "TrainerService": trainer_pb,
    "WeightService": w_pb,
}
# Messages whose fields are not walked: free-form, or a bound of their own (Duration below).
OPAQUE = {
    "google.protobuf.Struct",
    "google.protobuf.Duration",
    "google.protobuf.Timestamp",
    "google.rpc.Status",
}
# Reasons an at-bound call may be refused for, naming the field, that are not its bound.
NOT_A_BOUND = {"UNKNOWN_POLICY", "UNKNOWN_WORKFLOW", "UNKNOWN_REWARD", "UNKNOWN_TENSOR"}
MIB = 1 << 20

# ----- the bounds, read from the comments -----------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """`kind` of the field at `path` lies in lo..hi (None: no such end).

    kinds: len (characters of a string), bytes (of a string or bytes field), count (entries of
    a repeated field or map), item_len / item_value (each entry of a repeated field), key_len /
    value_len (each key / value of a map), value (an integer), nanos (a Duration)."""

    service: str
    rpc: str
    path: str
    kind: str
    lo: int | None
    hi: int | None
    comment: str = field(compare=False, repr=False)

    @property
    def id(self) -> str:
        short = self.service.removesuffix("Service")
        return f"{short}.{self.rpc}.{self.path.replace('[0]', '')}.{self.kind}"


# What the parser reads, for the docs and for test_every_stated_bound_is_read_or_listed.
BOUND_FORMS = (
    "N-M characters | N-M bytes | at most N characters | at most N MiB | at most N (a string)",
    "N-M | at most N | at least one (a repeated field's entries; a map's entries)",
    "each N-M characters | N-M characters each | each >= N | every entry >= N (entries)",
    "keys N-M characters | values at most N | N-M characters (a map's keys, values)",
    "N-M | >= N | at least N | must not be negative (an integer)",
    "at most N s | negative is INVALID_ARGUMENT (a Duration)",
)
# A comment that states a numeric bound in some form.
STATES_A_BOUND = re.compile(r"\d+\s*-\s*\d+|at most \d|>= ?-?\d|at least|negative|exactly", re.I)
# Request fields whose comment states a bound this test does not read, and why.
UNPARSED = {
    "NDArray.dtype": "a set of names, not a number",
    "NDArray.data": "tied to dtype and shape; the message size limit is not a number",
    "SamplingParams.temperature": "a float range (0 or >= 1e-4)",
    "TensorHeader.dtype": "a set of names, not a number",
    "TensorHeader.adler32": "a checksum: exactly 8 hex digits that must match the bytes",
    "VersionFile.sha256": "a digest: exactly 64 hex digits that must match the file's bytes",
}


# Bounds whose at-bound value a valid request cannot carry: only their past-bound case runs.
NOT_AT_THE_BOUND = {
    "Weight.ListVersions.page_token.len": "only tokens the service issued are valid",
    "Rollout.SubmitGroups.groups.prompt.token_ids.shape.count": "a prompt's token_ids are [T]",
}


def _plain(comment: str) -> str:
    text = re.sub(r"\s+", " ", comment.replace("//", " "))
    return re.sub(r"(?<=\d),(?=\d{3})", "", text)  # 1,000,000


def _range(m: re.Match | None) -> tuple[int, int] | None:
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def parse_bounds(f: FieldDescriptor, comment: str) -> list[tuple[str, int | None, int | None]]:
    """(kind, lo, hi) of every bound `comment` states on `f`, in the forms of BOUND_FORMS."""
    text = _plain(comment)
    out: list[tuple[str, int | None, int | None]] = []
    is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
    if is_map:
        if r := _range(re.search(r"keys (\d+)-(\d+) characters", text)):
            out.append(("key_len", *r))
            if m := re.search(r"values at most (\d+)", text):
                out.append(("value_len", None, int(m.group(1))))
        elif r := _range(re.search(r"(\d+)-(\d+) characters", text)):
            out.append(("value_len", *r))
        if m := re.search(r"(?<!values )at most (\d+)\b(?! characters)", text):
            out.append(("count", None, int(m.group(1))))
        return out
    if f.is_repeated:
        each = re.search(r"each (\d+)-(\d+) characters|(\d+)-(\d+) characters each", text)
        if each:
            lo, hi = (each.group(1), each.group(2)) if each.group(1) else each.group(3, 4)
            out.append(("item_len", int(lo), int(hi)))
            text = text.replace(each.group(0), "")
        if m := re.search(r"(?:each|every entry) >= (-?\d+)", text):
            out.append(("item_value", int(m.group(1)), None))
        if f.message_type is not None:  # "(policy ids 1-128 characters)": the entries' own
            text = re.sub(r"\([^)]*\)", "", text)
        if r := _range(re.search(r"(\d+)-(\d+)(?! characters| bytes)", text)):
            out.append(("count", *r))
        elif m := re.search(r"at most (\d+)\b(?! \w*iB)", text, re.I):
            lo = 1 if re.search(r"at least one", text) else None
            out.append(("count", lo, int(m.group(1))))
        elif re.search(r"at least one", text):
            out.append(("count", 1, None))
        return out
    if f.type == FieldDescriptor.TYPE_STRING:
        if m := re.search(r"(\d+)-(\d+) (characters|bytes)", text):
            out.append(("len" if m.group(3) == "characters" else "bytes", *_range(m)))
        elif m := re.search(r"at most (\d+) MiB", text):
            out.append(("bytes", None, int(m.group(1)) * MIB))
        elif m := re.search(r"at most (\d+)\b", text):
            out.append(("len", None, int(m.group(1))))
    elif f.type == FieldDescriptor.TYPE_BYTES:
        if m := re.search(r"at most (\d+) MiB", text):
            out.append(("bytes", None, int(m.group(1)) * MIB))
    elif f.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64):
        if r := _range(re.search(r"(\d+)-(\d+)", text)):
            out.append(("value", *r))
        elif m := re.search(r">= ?(-?\d+)|at least (\d+)", text):
            out.append(("value", int(m.group(1) or m.group(2)), None))
        elif re.search(r"must not be negative", text, re.I):
            out.append(("value", 0, None))
    elif f.message_type is not None and f.message_type.full_name == "google.protobuf.Duration":
        if m := re.search(r"at most (\d+) s\b", text):
            out.append(("nanos", None, int(m.group(1)) * 10**9))
        if re.search(r"negative is INVALID_ARGUMENT", text):
            out.append(("nanos", 0, None))
    return out


def request_fields(desc: Descriptor, prefix: str = "") -> Iterator[tuple[str, FieldDescriptor]]:
    """(path, field) of every field a request can carry; a repeated message's as name[0]."""
    for f in desc.fields:
        yield prefix + f.name, f
        sub = f.message_type
        if sub is None or sub.GetOptions().map_entry or sub.full_name in OPAQUE:
            continue
        yield from request_fields(sub, f"{prefix}{f.name}{'[0]' if f.is_repeated else ''}.")


def _comment(msgs: dict, f: FieldDescriptor) -> str:
    owner = f.containing_type
    for _, _, name, comment, file in msgs[owner.name]:
        if name == f.name:
            assert file == Path(owner.file.name).name, (owner.full_name, file)
            return comment
    raise AssertionError(f"{owner.full_name}.{f.name} not found in proto/")


def stated_bounds() -> tuple[list[Bound], list[str]]:
    """Every bound read from the comments of request fields, and the fields whose comment
    states one that was not read (Message.field)."""
    msgs = _messages()
    bounds, unread = [], []
    for service, pb in SERVICES.items():
        for method in pb.DESCRIPTOR.services_by_name[service].methods:
            for path, f in request_fields(method.input_type):
                comment = _comment(msgs, f)
                found = parse_bounds(f, comment)
                bounds += [Bound(service, method.name, path, *b, _plain(comment)) for b in found]
                if not found and STATES_A_BOUND.search(_plain(comment)):
                    unread.append(f"{f.containing_type.name}.{f.name}")
    return bounds, unread


BOUNDS, UNREAD = stated_bounds()


@dataclass(frozen=True)
class Case:
    bound: Bound
    end: str  # "max" or "min"
    at: bool  # at the bound, or one past it
    n: int  # the length, count or value sent

    @property
    def id(self) -> str:
        limit = self.bound.hi if self.end == "max" else self.bound.lo
        return f"{self.bound.id}-{self.end}{limit}-{'at' if self.at else 'past'}"


def cases() -> list[Case]:
    out = []
    for b in BOUNDS:
        if b.hi is not None:
            out += [Case(b, "max", True, b.hi), Case(b, "max", False, b.hi + 1)]
        if b.lo is not None and (b.lo > 0 or b.kind in ("value", "item_value")):
            past = b.lo - 1
            if past == 0 and b.kind == "value" and re.search(r"\b0 means|default", b.comment):
                past = -1  # 0 is the documented default or "none", not past the range
            out += [Case(b, "min", True, b.lo), Case(b, "min", False, past)]
    return [c for c in out if not (c.at and c.bound.id in NOT_AT_THE_BOUND)]


# Expected failures: case id -> what the server does instead.
# Cases the servers do not meet yet, each with why (strict: one that starts to pass fails).
XFAIL: dict[str, str] = {}

CASES = cases()


def _param(c: Case):
    reason = XFAIL.get(c.id)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(c, id=c.id, marks=marks)


# ----- the servers, once per module, on one event loop thread ----------------------------------


class Loop:
    """An event loop on its own thread; `run` runs a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = self.run(self._stack())

    @staticmethod
    async def _stack() -> AsyncExitStack:
        return AsyncExitStack()

    def run(self, coro, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(coro, timeout_s), self.loop
        ).result()

    def close(self) -> None:
        try:
            self.run(self.stack.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@dataclass
class Target:
    """A running service: its address, raw calls, a valid request per RPC, and per RPC what
    makes a request's ids fresh (`vary`) or what must happen before it is sent (`prepare`)."""

    address: str
    svc: Service
    bases: dict[str, Any]
    vary: dict[str, Callable[[Any, int], None]] = field(default_factory=dict)
    prepare: dict[str, Callable[[Any], Awaitable[None]]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def WeightService(loop: Loop, tmp_path_factory) -> Target:
    model = bf16_model(1, n=2, size=256)

    async def start() -> Target:
        from astra.clients.weights_stream import publish_version

        server = await loop.stack.enter_async_context(serving(tmp_path_factory.mktemp("w")))
        await publish_version(server.address, "p", "v0", 0, model)
        svc = Service(server.address, w_pb, "WeightService")
        loop.stack.push_async_callback(svc.close)
        bases = weights_bases(svc, model)
        # A full copy, so the service reads the acknowledgements: the start, then one per tensor.
        bases["FetchVersion"][0].start.ClearField("held_version_ids")
        bases["FetchVersion"][0].start.ClearField("acknowledged_tensors")
        vary = {"PublishVersion": _fresh_policy, "RollbackVersion": _fresh_rollback}
        return Target(server.address, svc, bases, vary)

    return loop.run(start())


@pytest.fixture(scope="module")
def DataflowService(loop: Loop, tmp_path_factory) -> Target:
    root = tmp_path_factory.mktemp("df")
    dataset = root / "prompts.jsonl"
    dataset.write_text('{"prompt": "1+1=", "answer": "2"}\n')

    # The fake instances' addresses answer nothing: no probe may find one dead meanwhile.
    pool = {"heartbeat_timeout_s": 600.0, "probe_interval_s": 600.0}
    config = make_config(dataset, root / "state", pool=pool)

    async def start() -> Target:
        server, _, _ = await loop.stack.enter_async_context(running_dataflow(config))
        svc = Service(server.address, df_pb, "DataflowService")
        loop.stack.push_async_callback(svc.close)
        bases = dataflow_bases(svc)
        vary = {m: _ids(m) for m in bases if m != "HeartbeatInstance"}
        ports = itertools.count(10_000)

        fresh_id = _ids("RegisterInstance")

        def fresh_instance(req: Message, i: int) -> None:
            """A registration at a registered instance's address would replace it."""
            fresh_id(req, i)
            req.address = f"127.0.0.1:{next(ports)}"

        async def registered(req: Message) -> None:
            """Heartbeats come from registered instances."""
            reg = register_request(instance_id=req.instance_id, address=f"127.0.0.1:{next(ports)}")
            await svc.call("RegisterInstance", reg)

        vary["RegisterInstance"] = fresh_instance
        return Target(server.address, svc, bases, vary, {"HeartbeatInstance": registered})

    return loop.run(start())


@pytest.fixture(scope="module")
def RolloutService(loop: Loop) -> Target:
    async def start() -> Target:
        client, _ = await loop.stack.enter_async_context(raas(capacity=1024))
        svc = Service(client.address, raas_pb, "RolloutService")
        loop.stack.push_async_callback(svc.close)
        # One finished, never acknowledged result, so a CollectResults returns at once.
        await client.submit_groups([group("ready", n=1, tokens=2)])
        while not await client.collect_results(max_groups=1, max_wait_s=0.1):
            pass
        bases = raas_bases(svc)  # the scripted engine loads weights without fetching them
        vary = {m: _ids(m) for m in bases}
        vary["SubmitGroups"] = _fresh_groups
        return Target(client.address, svc, bases, vary)

    return loop.run(start())


@pytest.fixture(scope="module")
def TrainerService(loop: Loop, tmp_path_factory) -> Target:
    from astra.servers.trainer_serve import start_trainer
    from astra.trainer.synthetic import MemorySink, SyntheticSource
    from tests.test_trainer_service import config

    async def start() -> Target:
        cfg = config(port=0, checkpoint={"dir": str(tmp_path_factory.mktemp("ckpt"))})
        source = SyntheticSource("p", vocab_size=100)
        server, trainer = await start_trainer(cfg, source=source, sink=MemorySink(), grace_s=0)
        loop.stack.push_async_callback(trainer.shutdown)
        loop.stack.push_async_callback(server.stop, 0)
        svc = Service(server.address, trainer_pb, "TrainerService")
        loop.stack.push_async_callback(svc.close)
        bases = {
            "SaveCheckpoint": svc.request("SaveCheckpoint", request_id="ck"),
            "Pause": svc.request("Pause", reason="bounds", wait=False),
        }
        return Target(server.address, svc, bases, {m: _ids(m) for m in bases})

    return loop.run(start())


# ----- building a request with one field at a given size --------------------------------------

_serial = itertools.count()


def _text(name: str, n: int) -> str:
    """n characters a field of this name takes: host:port for addresses."""
    if "address" in name and n >= 3:
        return "a" * (n - 2) + ":1"
    return "x" * n


def _numel(shape) -> int:
    return math.prod(max(d, 0) for d in shape)


def _locate(request: Any, path: str) -> tuple[Message, FieldDescriptor]:
    """The message holding the last field of `path`, and that field; a stream's part first."""
    parts = path.split(".")
    if isinstance(request, list):  # a request stream: the first message of that part
        head = parts.pop(0)
        msg = next(getattr(m, head) for m in request if m.WhichOneof("part") == head)
    else:
        msg = request
    for p in parts[:-1]:
        name, index = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", p).groups()
        sub = getattr(msg, name)
        if index is not None:
            while len(sub) <= int(index):
                sub.add()
            sub = sub[int(index)]
        msg = sub
    return msg, msg.DESCRIPTOR.fields_by_name[parts[-1]]


def _distinct(template: Message, i: int) -> Message:
    """A copy of a repeated message entry with its ids made unique."""
    out = type(template)()
    out.CopyFrom(template)
    for name in ("group_id", "policy_id"):
        if name in out.DESCRIPTOR.fields_by_name:
            setattr(out, name, f"{getattr(out, name)}-{i}")
    return out


def _set(msg: Message, f: FieldDescriptor, kind: str, n: int) -> None:
    value = getattr(msg, f.name)
    if kind in ("len", "bytes"):
        setattr(msg, f.name, bytes(n) if f.type == FieldDescriptor.TYPE_BYTES else _text(f.name, n))
    elif kind == "value":
        setattr(msg, f.name, n)
    elif kind == "nanos":
        value.FromNanoseconds(n)
    elif kind == "key_len":
        value[_text("key", n)] = "v"
    elif kind == "value_len":
        value["policy" if "address" in f.name else "key"] = _text(f.name, n)
    elif kind == "item_len":
        value.append(_text(f.name, n))
    elif kind == "item_value" and f.name == "shape":
        del value[:]
        value.append(n)
    elif kind == "item_value":
        value.append(n)
    elif kind == "count" and f.message_type is not None and f.message_type.GetOptions().map_entry:
        value.clear()
        value.update({f"k{i}": "v" for i in range(n)})
    elif kind == "count" and f.name == "shape":  # as many dimensions, the same elements
        numel = _numel(value)
        del value[:]
        value.extend([1] * (n - 1) + [numel] if n else [])
    elif kind == "count" and f.message_type is not None:  # copies of the first, fresh ids
        del value[n:]
        for i in range(len(value), n):
            value.add().CopyFrom(_distinct(value[0], i))
    elif kind == "count":  # distinct entries
        del value[n:]
        string = f.type == FieldDescriptor.TYPE_STRING
        value.extend(f"{i:x}" if string else i for i in range(len(value), n))
    else:
        raise AssertionError(kind)


def _consistent(request: Any, path: str) -> None:
    """Arrays and tensors whose shape or bytes changed made whole again."""
    if isinstance(request, list):
        for m, nxt in zip(list(request), request[1:], strict=False):
            if m.WhichOneof("part") != "tensor" or nxt.WhichOneof("part") != "chunk":
                continue
            h, chunk = m.tensor, nxt.chunk
            if path.startswith("chunk."):
                del h.shape[:]
                h.shape.append(len(chunk.data))
            else:
                chunk.data = bytes(_numel(h.shape))
            h.size_bytes = h.encoded_size_bytes = len(chunk.data)
            h.adler32 = adler32_hex(chunk.data)
            if not chunk.data:  # an empty tensor has no chunk
                request.remove(nxt)
    elif path.endswith("token_ids.shape"):
        arr, _ = _locate(request, path)
        arr.data = bytes(_numel(arr.shape) * 4)  # int32


def build(target: Target, c: Case) -> Any:
    b = c.bound
    base = target.bases[b.rpc]
    if isinstance(base, list):
        request: Any = [type(m).FromString(m.SerializeToString()) for m in base]
    else:
        request = type(base).FromString(base.SerializeToString())
    if b.rpc in target.vary:
        target.vary[b.rpc](request, next(_serial))
    msg, f = _locate(request, b.path)
    _set(msg, f, b.kind, c.n)
    _consistent(request, b.path)
    return request


def _named(got: tuple, leaf: str) -> bool:
    """The error names `leaf`: in a BadRequest field violation, ErrorInfo metadata or message."""
    _, info, details = got
    texts = [
        v.field
        for d in details
        if isinstance(d, error_details_pb2.BadRequest)
        for v in d.field_violations
    ]
    texts += [d for d in details if isinstance(d, str)]
    if info is not None:
        texts += list(info.metadata.values())
    return any(leaf in re.findall(r"\w+", t) for t in texts)


# ----- the tests -------------------------------------------------------------------------------


def test_every_stated_bound_is_read_or_listed():
    assert sorted(UNREAD) == sorted(UNPARSED), "bounds neither read nor listed in UNPARSED"
    assert {b.service for b in BOUNDS} == set(SERVICES)
    ids = {c.id for c in CASES}
    assert len(ids) == len(CASES)
    assert set(XFAIL) <= ids, "an expected failure names no case"
    assert set(NOT_AT_THE_BOUND) <= {b.id for b in BOUNDS}, "an exception names no bound"


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_stated_bound_is_enforced(case: Case, loop: Loop, request) -> None:
    target: Target = request.getfixturevalue(case.bound.service)
    b = case.bound
    leaf = b.path.rsplit(".", 1)[-1].removesuffix("[0]")
    req = build(target, case)
    if b.rpc in target.prepare:
        loop.run(target.prepare[b.rpc](req))
    got = loop.run(target.svc.call(b.rpc, req))
    check(target.svc, b.rpc, case.id, got)
    status, info, details = got
    if case.at:
        refused = status == code.INVALID_ARGUMENT and _named(got, leaf)
        assert not (refused and info.reason not in NOT_A_BOUND), (status, info, details)
    else:
        assert status == code.INVALID_ARGUMENT, (status, info, details)
        assert _named(got, leaf), (leaf, info, details)
