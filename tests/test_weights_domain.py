"""astra.weights' stream bodies and views without a server: publish parts -> acks and commit,
fetch plan/tensors/acks/done with its window and refusals, version pages and receivers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from astra.errors import AstraError, DataLoss, Unavailable
from astra.weights.checksum import adler32_hex
from astra.weights.fetch_stream import (
    Ack,
    ChunkOut,
    Done,
    FetchRequest,
    FileOut,
    Planned,
    StreamSettings,
    TensorOut,
    serve_fetch,
)
from astra.weights.publish_stream import (
    ChunkPart,
    CommitPart,
    Committed,
    OtherPart,
    TensorAcked,
    TensorPart,
    receive_parts,
)
from astra.weights.store import Store, StoreConfig
from astra.weights.views import heads, receiver_versions, version_page


def run(coro, timeout_s: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def model(v: float) -> dict:
    return {n: ("F32", (4,), np.full(4, v + i, np.float32).tobytes()) for i, n in enumerate("ab")}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path, StoreConfig(durable=False, hot_bytes=0))


async def listed(*parts):
    for part in parts:
        yield part


def tensor(name: str, data: bytes) -> TensorPart:
    return TensorPart(name, adler32_hex(data), len(data), lambda: ("F32", (4,), None))


def test_a_publish_acks_each_tensor_then_commits(store: Store) -> None:
    a, b = (np.full(4, x, np.float32).tobytes() for x in (1, 2))

    async def body():
        session = store.begin_publish("p", "v1", 1)
        try:
            parts = listed(
                tensor("a", a), ChunkPart(0, a[:8]), ChunkPart(8, a[8:]),
                tensor("b", b), ChunkPart(0, b), CommitPart(2),
            )  # fmt: skip
            return [r async for r in receive_parts(session, 2, parts)]
        finally:
            session.close()

    replies = run(body())
    assert replies[:2] == [TensorAcked("a"), TensorAcked("b")]
    assert isinstance(replies[2], Committed) and not replies[2].already_existed
    assert store.chain("p").head.identity == "v1"


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ([ChunkPart(0, b"x")], "UNEXPECTED_CHUNK"),
        (["a4", CommitPart(1)], "TRUNCATED_TENSOR"),  # a's first 4 bytes only
        (["a", CommitPart(2)], "PUBLISH_INCOMPLETE"),  # the header said 1
        (["a"], "PUBLISH_INCOMPLETE"),  # no commit
        ([OtherPart()], "UNEXPECTED_HEADER"),
    ],
)
def test_a_bad_publish_is_refused_with_its_reason(store: Store, parts, reason) -> None:
    data = np.ones(4, np.float32).tobytes()
    expand = {"a": [tensor("a", data), ChunkPart(0, data)], "a4": [tensor("a", data), ChunkPart(0, data[:4])]}  # fmt: skip
    flat = [p for part in parts for p in (expand[part] if isinstance(part, str) else [part])]

    async def body():
        session = store.begin_publish("p", "v1", 1)
        try:
            return [r async for r in receive_parts(session, 1, listed(*flat))]
        finally:
            session.close()

    with pytest.raises(AstraError) as err:
        run(body())
    assert err.value.reason == reason
    assert "p" not in store.policies() or store.chain("p").head is None


def start(**kw) -> FetchRequest:
    base = dict(policy_id="p", target_version_id="", held_version_ids=[],
                acknowledged_tensors=[], max_bytes_per_second=0, receiver_id="")  # fmt: skip
    return FetchRequest(**{**base, **kw})


async def fetch(store: Store, request: FetchRequest, refuse: str = "", settings=None):
    """Runs a fetch whose receiver acknowledges each tensor once its chunks arrived."""
    acks: asyncio.Queue = asyncio.Queue()

    async def ack_stream():
        while (ack := await acks.get()) is not None:
            yield ack

    out, pending = [], None
    async for part in serve_fetch(store, request, ack_stream(), settings or StreamSettings()):
        out.append(part)
        if isinstance(part, TensorOut):
            pending = part.tensor.name
        elif isinstance(part, ChunkOut | FileOut | Done) and pending:
            await acks.put(Ack(pending, 1 if pending == refuse else 0, "bad"))
            pending = None
    return out


def test_a_fetch_sends_the_plan_every_tensor_and_done(store: Store) -> None:
    store.publish("p", "v1", 1, model(1))
    out = run(fetch(store, start(receiver_id="r1")))
    plan = out[0]
    assert isinstance(plan, Planned) and plan.is_head and plan.num_tensors == 2
    assert [p.tensor.name for p in out if isinstance(p, TensorOut)] == ["a", "b"]
    assert out[-1] == Done(2)
    assert receiver_versions(store) == {"p/r1": "v1"}


def test_acknowledged_tensors_are_skipped_only_with_an_explicit_target(store: Store) -> None:
    store.publish("p", "v1", 1, model(1))
    resumed = run(fetch(store, start(target_version_id="v1", acknowledged_tensors=["a"])))
    assert [p.tensor.name for p in resumed if isinstance(p, TensorOut)] == ["b"]
    again = run(fetch(store, start(acknowledged_tensors=["a"])))
    assert again[0].num_tensors == 2


def test_a_refused_tensor_ends_the_fetch_with_data_loss(store: Store, monkeypatch) -> None:
    store.publish("p", "v1", 1, model(1))
    refused = []
    monkeypatch.setattr(store, "refused", lambda *args: refused.append(args[-1]))
    with pytest.raises(DataLoss) as err:
        run(fetch(store, start(), refuse="a"))
    assert err.value.reason == "CHECKSUM_MISMATCH" and refused == ["a"]


def test_a_receiver_that_stops_acknowledging_times_out(store: Store) -> None:
    store.publish("p", "v1", 1, model(1))

    async def body():
        async def silent():
            await asyncio.sleep(30)
            yield Ack("a", 0)

        settings = StreamSettings(window_bytes=1, ack_timeout_s=0.1)
        return [p async for p in serve_fetch(store, start(), silent(), settings)]

    with pytest.raises(Unavailable) as err:
        run(body())
    assert err.value.reason == "ACK_TIMEOUT"


def test_version_pages_heads_and_receivers(store: Store) -> None:
    for v in range(1, 6):
        store.publish("p", f"v{v}", v, model(v))
    page, below = version_page(store, "p", None, 2)
    assert [r.version for r in page] == [5, 4] and below == 4
    page, below = version_page(store, "p", below, 10)
    assert [r.version for r in page] == [3, 2, 1] and below is None
    assert [h.identity for h in heads(store)] == ["v5"]
    store.register_receiver("p", "r", ["v2", "v3", "gone"])
    assert receiver_versions(store) == {"p/r": "v3"}
