"""A version's extra files (config.json, tokenizer files): a receiver gets one that equals its
base's by name and SHA-256 (VersionFile.same_as_base), the store links an unchanged file in
instead of writing it again, and bytes read back from disk are checked against their SHA-256."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
import numpy as np
import pytest

from astra.clients.weights import WeightClient
from astra.clients.weights_publish import publish_version
from astra.clients.weights_stream import Receiver
from astra.errors import DataLoss
from astra.weights.store import Store, StoreConfig
from astra.weights.v1 import weight_service_pb2 as pb
from tests.test_weights_service import _expect, _stream, run, serving
from tests.test_weights_store import chain_of, same

TOKENIZER = np.random.default_rng(7).integers(0, 256, 1 << 20, np.uint8).tobytes()


def files_of(i: int) -> dict[str, bytes]:
    return {"config.json": f'{{"step": {i}}}'.encode(), "tokenizer.json": TOKENIZER}


def held_files(rx: Receiver) -> dict[str, bytes]:
    current = rx.current
    if current is not None:
        return dict(current.files)
    path = rx.current_path
    return {name: (path / name).read_bytes() for name in ("config.json", "tokenizer.json")}


@pytest.mark.parametrize("in_memory", [False, True], ids=["disk", "memory"])
def test_a_receiver_gets_an_unchanged_file_by_name_only(tmp_path: Path, in_memory: bool) -> None:
    models = chain_of(3, seed=51)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            where = None if in_memory else tmp_path / "rx"
            async with Receiver(
                server.address, "p", where, durable=False, in_memory=in_memory
            ) as rx:
                await publish_version(server.address, "p", "v0", 0, models[0], files_of(0))
                await rx.fetch()  # a full copy: every file with its content
                counters = server.store.counters
                assert counters["fetch_files_same_as_base"] == 0
                for i in (1, 2):
                    await publish_version(server.address, "p", f"v{i}", i, models[i], files_of(i))
                    result = await rx.fetch()
                    assert result.plan == "delta"
                    assert counters["fetch_files_same_as_base"] == i, "the tokenizer, by name"
                    assert held_files(rx) == files_of(i)

    run(body())


def test_a_receiver_that_does_not_ask_gets_every_file(tmp_path: Path) -> None:
    models = chain_of(2, seed=52)

    async def body() -> None:
        rx_dir = tmp_path / "rx"
        async with (
            serving(tmp_path / "store") as server,
            Receiver(server.address, "p", rx_dir, durable=False) as rx,
        ):
            rx.same_as_base_files = False  # as a receiver written before the field
            for i in (0, 1):
                await publish_version(server.address, "p", f"v{i}", i, models[i], files_of(i))
                await rx.fetch()
            assert server.store.counters["fetch_files_same_as_base"] == 0
            assert held_files(rx) == files_of(1)

    run(body())


def test_a_base_whose_copy_differs_gets_the_content_on_the_next_attempt(tmp_path: Path) -> None:
    models = chain_of(2, seed=53)

    async def body() -> None:
        rx_dir = tmp_path / "rx"
        async with (
            serving(tmp_path / "store") as server,
            Receiver(server.address, "p", rx_dir, durable=False) as rx,
        ):
            await publish_version(server.address, "p", "v0", 0, models[0], files_of(0))
            await rx.fetch()
            (rx.current_path / "tokenizer.json").write_bytes(b"rotten")  # the held copy
            await publish_version(server.address, "p", "v1", 1, models[1], files_of(1))
            result = await rx.fetch()
            assert result.attempts == 2 and not rx.same_as_base_files
            assert held_files(rx) == files_of(1) and same(rx.current_path, models[1])

    run(body())


def test_a_publish_names_an_unchanged_file_only_against_a_base_that_has_it(
    tmp_path: Path,
) -> None:
    models = chain_of(4, seed=54)
    digest = hashlib.sha256(TOKENIZER).hexdigest()

    async def body() -> None:
        async with serving(tmp_path / "store") as server, WeightClient(server.address) as client:
            counters = server.store.counters
            await publish_version(server.address, "p", "v0", 0, models[0], files_of(0))
            header = pb.PublishHeader(policy_id="p", version_id="v1", version=1, num_tensors=0)
            ref = pb.VersionFile(name="tokenizer.json", same_as_base=True, sha256=digest)
            msgs = [pb.PublishVersionRequest(header=header), pb.PublishVersionRequest(file=ref)]
            call = _stream(client.stub.PublishVersion, msgs)  # no base_version_id
            info = await _expect(call, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FILE")
            assert info.metadata["field"] == "file.same_as_base"
            # Against v0, which has it: sent by digest, stored whole.
            result = await publish_version(
                server.address, "p", "v1", 1, models[1], files_of(1),
                base=("v0", models[0]), unchanged_files=["tokenizer.json"],
            )  # fmt: skip
            assert result.delta_base == "v0" and counters["publish_files_same_as_base"] == 1
            assert server.store.read_files("p", server.store.get("p", "v1")) == files_of(1)
            # config.json changed since v1: refused by digest, then published raw.
            result = await publish_version(
                server.address, "p", "v2", 2, models[2], files_of(2),
                base=("v1", models[1]), unchanged_files=["config.json", "tokenizer.json"],
            )  # fmt: skip
            assert result.delta_base == "", "FILE_NOT_IN_BASE: sent again with every file"
            assert server.store.read_files("p", server.store.get("p", "v2")) == files_of(2)
            # The base's stored tokenizer rots: a publish by digest falls back the same way, and
            # the new version holds good bytes of its own (not a link to the rotten inode).
            v2 = server.store.version_dir("p", "v2") / server.store.get("p", "v2").primary
            (v2 / "tokenizer.json").write_bytes(b"rotten")
            result = await publish_version(
                server.address, "p", "v3", 3, models[3], files_of(3),
                base=("v2", models[2]), unchanged_files=["tokenizer.json"],
            )  # fmt: skip
            assert result.delta_base == ""
            assert server.store.read_files("p", server.store.get("p", "v3")) == files_of(3)

    run(body())


def test_a_trainer_sink_sends_its_files_once(tmp_path: Path) -> None:
    from astra.clients.trainer_sources import WeightServiceSink

    models = chain_of(3, seed=56)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            sink = WeightServiceSink(server.address, "p", files_of(0))
            try:
                for i, m in enumerate(models):
                    await sink.publish(i, f"v{i}", m)
            finally:
                await sink.close()
            assert server.store.counters["publish_files_same_as_base"] == 2 * 2
            for i in range(3):
                assert server.store.read_files("p", server.store.get("p", f"v{i}")) == files_of(0)

    run(body())


def test_unchanged_files_are_linked_and_rot_is_not_carried_on(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(full_every=8, durable=False))
    models = chain_of(3, seed=55)
    for i in (0, 1):
        store.publish("p", f"v{i}", i, models[i], files=files_of(i))
    stored = {i: store.version_dir("p", f"v{i}") / store.get("p", f"v{i}").primary for i in (0, 1)}
    assert (stored[0] / "tokenizer.json").samefile(stored[1] / "tokenizer.json")
    assert not (stored[0] / "config.json").samefile(stored[1] / "config.json")
    (stored[1] / "tokenizer.json").write_bytes(b"rotten")  # both versions' copy: one inode
    with pytest.raises(DataLoss) as err:
        store.read_files("p", store.get("p", "v1"))
    assert err.value.reason == "FILE_CHECKSUM_MISMATCH"
    assert err.value.metadata["file"] == "tokenizer.json"
    store.publish("p", "v2", 2, models[2], files=files_of(2))
    assert store.read_files("p", store.get("p", "v2")) == files_of(2), "written, not linked"
