"""In-memory receivers: versions fetched into RAM, verified per tensor, swapped in one assignment."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from astra.clients.weights_stream import Receiver, publish_version
from astra.errors import DataLoss
from astra.servers.weights_fetch import StreamSettings
from astra.weights.memory import MemoryVersion
from astra.weights.store_fetch import FetchSource
from tests.test_weights_service import run, serving
from tests.test_weights_store import chain_of, same

T = 20


def held_equals(held: MemoryVersion | None, model: dict) -> bool:
    return (
        held is not None
        and held.keys() == model.keys()
        and all(
            (held[n].dtype, held[n].shape, held[n].data.tobytes()) == (d, tuple(s), b)
            for n, (d, s, b) in model.items()
        )
    )


def test_memory_receiver_is_bit_exact_and_takes_later_versions_as_deltas(tmp_path: Path) -> None:
    models = chain_of(5, seed=21)
    config = b'{"model_type": "toy"}'

    async def body() -> None:
        small_chunks = StreamSettings(chunk_bytes=1000)  # every tensor spans many chunks
        async with (
            serving(tmp_path / "store", small_chunks, full_every=3) as server,
            Receiver(server.address, "p", None, in_memory=True) as receiver,
        ):
            full_size = sum(len(b) for _, _, b in models[0].values())
            seen: list[MemoryVersion] = []
            for i, m in enumerate(models):
                await publish_version(server.address, "p", f"v{i}", i, m, {"config.json": config})
                fetched = await receiver.fetch()
                assert fetched.path is None and fetched.held is receiver.current
                assert fetched.identity == f"v{i}" and receiver.current.version == i
                assert held_equals(receiver.current, m)
                assert receiver.current.files == {"config.json": config}
                if i:
                    assert fetched.plan == "delta" and fetched.base == f"v{i - 1}"
                    assert fetched.bytes_received < full_size / 10
                seen.append(receiver.current)
            # A reader that took an older version keeps it whole: buffers are never rewritten.
            assert held_equals(seen[0], models[0]) and held_equals(seen[2], models[2])
            assert set(receiver.local.held()) == {"v3", "v4"}, "keeps 2 by default"
            again = await receiver.fetch("v4")
            assert again.plan == "none" and again.held is seen[-1]

    run(body())


def test_memory_receiver_refuses_a_corrupt_delta_and_keeps_the_previous_version(
    tmp_path: Path,
) -> None:
    models = chain_of(2, seed=22)

    async def body() -> None:
        async with serving(tmp_path / "store", full_every=1) as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            receiver = Receiver(server.address, "p", None, in_memory=True, backoff_s=0.01)
            await receiver.fetch()
            before = receiver.current
            await publish_version(server.address, "p", "v1", 1, models[1])
            shard = next((server.store.version_dir("p", "v1") / "delta").glob("*.safetensors"))
            raw = bytearray(shard.read_bytes())
            raw[-20] ^= 0xFF  # one byte inside the last frame
            shard.write_bytes(bytes(raw))
            with pytest.raises(DataLoss) as err:
                await receiver.fetch()
            assert err.value.metadata.get("tensor", "").startswith("layers.")
            assert receiver.current is before and held_equals(before, models[0])
            await receiver.close()

    run(body())


def test_memory_receiver_resumes_after_a_corrupt_chunk_from_the_last_acknowledged_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = chain_of(1, seed=23)[0]
    original = FetchSource.chunks
    sent: list[str] = []

    def flip_third(self, name, chunk_bytes, start=0):
        for piece in original(self, name, chunk_bytes, start):
            sent.append(name)
            if len(set(sent)) == 3 and sent.count(name) == 1:
                bad = bytearray(piece)
                bad[len(bad) // 2] ^= 0x01
                piece = memoryview(bytes(bad))
            yield piece

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, model)
            monkeypatch.setattr(FetchSource, "chunks", flip_third)
            async with Receiver(
                server.address, "p", None, in_memory=True, backoff_s=0.01
            ) as receiver:
                result = await asyncio.wait_for(receiver.fetch(), T)
                assert result.attempts == 2 and result.tensors_resumed >= 1
                assert result.tensors_received + result.tensors_resumed == len(model)
                assert held_equals(receiver.current, model)

    run(body())


def test_memory_receiver_takes_no_directory() -> None:
    with pytest.raises(ValueError, match="in-memory"):
        Receiver("127.0.0.1:1", "p", "/tmp/x", in_memory=True)
    with pytest.raises(ValueError, match="directory"):
        Receiver("127.0.0.1:1", "p", None)


def test_buffers_of_pruned_versions_are_reused_unless_a_reader_holds_them(tmp_path: Path) -> None:
    models = chain_of(6, seed=24)

    async def body() -> None:
        async with (
            serving(tmp_path / "store") as server,
            Receiver(server.address, "p", None, in_memory=True, keep_versions=1) as receiver,
        ):
            pool = receiver.local.pool
            await publish_version(server.address, "p", "v0", 0, models[0])
            await receiver.fetch()
            await publish_version(server.address, "p", "v1", 1, models[1])
            await receiver.fetch()
            kept_version = receiver.current  # a reader keeps all of v1
            await publish_version(server.address, "p", "v2", 2, models[2])
            await receiver.fetch()
            kept_bytes = receiver.current["layers.0.w"].data  # one keeps a tensor of v2
            kept_view = memoryview(receiver.current["layers.1.w"].data)  # one a buffer
            for i in (3, 4, 5):
                await publish_version(server.address, "p", f"v{i}", i, models[i])
                result = await receiver.fetch()
                assert result.plan == "delta" and held_equals(receiver.current, models[i])
                del result
            assert pool.reused >= 4, "later deltas write into earlier versions' buffers"
            assert kept_bytes.tobytes() == models[2]["layers.0.w"][2]
            assert kept_view.tobytes() == models[2]["layers.1.w"][2]
            assert held_equals(kept_version, models[1]), "a held version is never recycled"

    run(body())


def test_a_memory_receiver_carries_what_it_holds_to_a_new_address(tmp_path: Path) -> None:
    models = chain_of(2, seed=25)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            first = Receiver(server.address, "p", None, in_memory=True)
            await first.fetch()
            await first.close()
            await publish_version(server.address, "p", "v1", 1, models[1])
            async with Receiver(server.address, "p", None, in_memory=first.local) as second:
                result = await second.fetch()
                assert result.plan == "delta" and result.base == "v0"
                assert held_equals(second.current, models[1])

    run(body())


@pytest.mark.parametrize("in_memory", [True, False], ids=["memory", "disk"])
def test_a_delta_stream_that_ends_before_its_tensors_is_never_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_memory: bool
) -> None:
    """A service that says FetchDone after fewer changed tensors than its plan names: the
    receiver must not fill the gap with its base's tensors (a mix of two versions)."""
    models = chain_of(2, seed=23)
    full_list = FetchSource.tensors

    def fewer_at_first(self):
        calls = getattr(self, "_calls", 0)
        self._calls = calls + 1
        tensors = full_list(self)
        return tensors[:1] if calls == 0 else tensors  # sends one, then says "done" for all

    async def body() -> None:
        async with serving(tmp_path / "store", full_every=4) as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            directory = None if in_memory else tmp_path / "rx"
            receiver = Receiver(
                server.address, "p", directory, in_memory=in_memory, backoff_s=0.01,
                max_attempts=2, durable=False,
            )  # fmt: skip
            await receiver.fetch()
            await publish_version(server.address, "p", "v1", 1, models[1])
            monkeypatch.setattr(FetchSource, "tensors", fewer_at_first)
            with pytest.raises(DataLoss) as err:
                await receiver.fetch()
            assert err.value.reason == "INCOMPLETE_FETCH"
            if in_memory:
                assert held_equals(receiver.current, models[0])
            else:
                assert same(receiver.current_path, models[0])
            monkeypatch.setattr(FetchSource, "tensors", full_list)
            fetched = await receiver.fetch()  # the real stream completes what was staged
            assert fetched.plan == "delta"
            if in_memory:
                assert held_equals(receiver.current, models[1])
            else:
                assert same(receiver.current_path, models[1])
            await receiver.close()

    run(body())
