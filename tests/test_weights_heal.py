"""Corruption in the WeightService store heals or ends, never loops: a damaged cache entry is
dropped and rebuilt from the versions it was built from; a version whose stored forms are
damaged is marked bad, named by its real path, and the next publish is stored full.

A real WeightService on 127.0.0.1:0 and a real receiver (astra.clients.weights_stream)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from astra.clients.weights_stream import Receiver, publish_version
from astra.errors import DataLoss, FailedPrecondition
from astra.weights.records import dirname_for
from tests.test_weights_service import run, serving
from tests.test_weights_store import chain_of, same

CONFIG = {"config.json": b'{"model_type": "toy"}'}


def flip_last_byte(directory: Path) -> Path:
    """Damages the last tensor's data in the directory's (last) shard; returns the shard."""
    shard = sorted(directory.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def policy_dir(store: Path) -> Path:
    return store / "policies" / dirname_for("p")


def test_a_damaged_cache_entry_is_dropped_and_rebuilt_from_its_versions(tmp_path: Path) -> None:
    """The damaged cached full copy of a delta version was served again at every attempt: the
    receiver's fetch ended in DATA_LOSS after all of them, and so did every later fetch."""
    models = chain_of(2, seed=5)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            for i, m in enumerate(models):
                await publish_version(server.address, "p", f"v{i}", i, m, CONFIG)
            entry = policy_dir(tmp_path / "store") / "cache" / "full" / dirname_for("v1")
            assert entry.is_dir()
            flip_last_byte(entry)
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False)
            fetched = await receiver.fetch("v1")  # from nothing: a full copy, from the cache
            assert fetched.identity == "v1" and fetched.plan == "full"
            assert same(receiver.current_path, models[1])
            assert fetched.attempts == 2  # the refused one, then the rebuilt entry
            assert server.store.counters["cache_entries_dropped"] == 1
            assert server.store.bad_versions("p") == {}

    run(body())


def test_a_version_whose_stored_delta_is_damaged_is_marked_bad_and_the_next_is_stored_full(
    tmp_path: Path,
) -> None:
    """With its cached full copy gone and its delta damaged, v1 could not be rebuilt: the next
    publish (which encodes against v1) failed with DATA_LOSS at every try, so the trainer
    could publish nothing more."""
    models = chain_of(3, seed=6)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            for i, m in enumerate(models[:2]):
                await publish_version(server.address, "p", f"v{i}", i, m, CONFIG)
            pdir = policy_dir(tmp_path / "store")
            shutil.rmtree(pdir / "cache" / "full" / dirname_for("v1"))
            delta = pdir / "versions" / dirname_for("v1") / "delta"
            flip_last_byte(delta)
            result = await publish_version(server.address, "p", "v2", 2, models[2], CONFIG)
            assert result.version.version_id == "v2"
            assert server.store.get("p", "v2").kind == "full"
            (why,) = server.store.bad_versions("p").values()
            assert str(delta) in why and "/cache/tmp/" not in why, why
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False)
            fetched = await receiver.fetch("v2")
            assert fetched.identity == "v2" and same(receiver.current_path, models[2])
            other = Receiver(server.address, "p", tmp_path / "rx2", durable=False)
            with pytest.raises(FailedPrecondition) as bad:
                await other.fetch("v1")
            assert bad.value.reason == "VERSION_BAD" and str(delta) in bad.value.message

    run(body())


def test_a_damaged_stored_full_version_is_marked_bad_and_refused_with_its_path(
    tmp_path: Path,
) -> None:
    """A stored full version whose bytes no longer match its record was streamed again at every
    attempt; now the first refusal marks it bad and the next attempt is refused at once."""
    models = chain_of(1, seed=7)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0], CONFIG)
            shard = flip_last_byte(
                policy_dir(tmp_path / "store") / "versions" / dirname_for("v0") / "full"
            )
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False)
            with pytest.raises((FailedPrecondition, DataLoss)) as bad:
                await receiver.fetch("v0")
            assert isinstance(bad.value, FailedPrecondition), bad.value
            assert bad.value.reason == "VERSION_BAD" and str(shard) in bad.value.message

    run(body())


def test_a_damaged_cached_base_is_never_encoded_against(tmp_path: Path) -> None:
    """The next publish encoded its delta against the cached full copy of the head without
    checking it: a damaged copy made a delta no receiver could ever decode. Now the base is
    checked as it is read; a damaged cache entry is dropped and the new version stored full."""
    models = chain_of(3, seed=8)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            for i, m in enumerate(models[:2]):
                await publish_version(server.address, "p", f"v{i}", i, m, CONFIG)
        entry = policy_dir(tmp_path / "store") / "cache" / "full" / dirname_for("v1")
        assert entry.is_dir()
        flip_last_byte(entry)
        # A new process: no copy of v1 in RAM, the base is read from the damaged entry.
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v2", 2, models[2], CONFIG)
            assert server.store.get("p", "v2").kind == "full"
            assert server.store.counters["cache_entries_dropped"] == 1
            assert server.store.bad_versions("p") == {}  # v1's stored forms are sound
            for target in ("v2", "v1"):
                receiver = Receiver(server.address, "p", tmp_path / f"rx-{target}", durable=False)
                fetched = await receiver.fetch(target)
                assert fetched.attempts == 1
                assert same(receiver.current_path, models[int(target[1])])

    run(body())
