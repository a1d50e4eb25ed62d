"""Small tensors of a publish are held in RAM and written together at the commit: one shard with
each tensor's Adler-32, the same bytes out, the large tensors still staged (and resumed) one file
each, and an interrupted publish sends the small ones again."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from astra.errors import ResourceExhausted
from astra.weights.checksum import adler32_hex
from astra.weights.layout import Version
from astra.weights.store import Store, StoreConfig
from tests.test_weights_store import full_copy, same

BIG = 512 << 10  # above INLINE_BYTES (256 KiB): staged in its own file


def model(seed: int, sizes: dict[str, int]) -> dict:
    rng = np.random.default_rng(seed)
    return {
        n: ("U8", (size,), rng.integers(0, 256, size, np.uint8).tobytes())
        for n, size in sizes.items()
    }


def send_all(session: Any, tensors: dict) -> None:
    """Every tensor into the session, verified, and their stage files synced."""
    for name, (dtype, shape, data) in sorted(tensors.items()):
        sink = session.begin_tensor(name, dtype, shape, adler32_hex(data))
        sink.write(0, data)
        sink.finish()
    session.stage.flush()


def stage_all(store: Store, identity: str, version: int, tensors: dict) -> None:
    """Streams every tensor of a publish, verified, and stops before the commit."""
    session = store.begin_publish("p", identity, version)
    try:
        send_all(session, tensors)
        staged = sorted(p.name for p in session.stage.path.glob("t-*.bin"))
        assert len(staged) == sum(len(d) >= BIG for _, _, d in tensors.values()), staged
    finally:
        session.close()


def test_small_tensors_are_one_shard_with_their_checksums(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(full_every=1, durable=False))
    m = model(0, {f"norm.{i}": 4096 + i for i in range(6)} | {"big": BIG})
    record, _ = store.publish("p", "v0", 0, m)
    assert record.kind == "full"
    with Version(store.version_dir("p", "v0") / "full") as version:
        small = {version.weight_map[n] for n in m if n != "big"}
        assert len(small) == 1 and version.weight_map["big"] not in small
        for name, (_, _, data) in m.items():
            entry = version.entries[name]
            assert entry.checksum == adler32_hex(data)
            assert bytes(version.view(name)) == data
    m1 = model(1, {n: len(d) for n, (_, _, d) in m.items()})
    store.publish("p", "v1", 1, m1)  # against a base whose small tensors share a file
    assert same(full_copy(store, "p", "v1"), m1)


def test_an_interrupted_publish_resends_small_tensors_and_resumes_large_ones(
    tmp_path: Path,
) -> None:
    config = StoreConfig(full_every=2, durable=False)
    store = Store(tmp_path, config)
    sizes = {"a": 1000, "b": 3000, "big": BIG}
    store.publish("p", "v0", 0, model(0, sizes))
    m1 = model(1, sizes)
    stage_all(store, "v1", 1, m1)
    store = Store(tmp_path, config)  # as after a restart
    session = store.begin_publish("p", "v1", 1)
    try:
        assert session.held == ["big"], "the small ones were only in RAM"
    finally:
        session.close()
    record, existed = store.publish("p", "v1", 1, m1)
    assert not existed and record.kind == "delta"
    assert same(full_copy(store, "p", "v1"), m1)


def test_past_the_ram_bound_small_tensors_get_a_file_each(tmp_path: Path) -> None:
    config = StoreConfig(full_every=1, durable=False, ram_stage_bytes=10_000)
    store = Store(tmp_path, config)
    m = model(2, {f"t{i}": 4000 for i in range(5)})
    session = store.begin_publish("p", "v0", 0)
    try:
        send_all(session, m)
        assert len(session.stage.in_ram) == 2, "two of 4,000 bytes fit under 10,000"
        assert len(list(session.stage.path.glob("t-*.bin"))) == 3
        record, _ = session.commit(len(m))
    finally:
        session.close()
    with Version(store.version_dir("p", "v0") / "full") as version:
        assert len(set(version.weight_map.values())) == 4, "one packed shard, three of their own"
    assert same(full_copy(store, "p", record.identity), m)


def test_a_full_disk_while_packing_is_disk_full_and_the_next_publish_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from astra.weights import publish_stage

    store = Store(tmp_path, StoreConfig(durable=False))
    m = model(3, {"a": 100, "b": 200})

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(publish_stage, "write_packed_shard", full_disk)  # the packed shard
    with pytest.raises(ResourceExhausted) as err:
        store.publish("p", "v0", 0, m)
    assert err.value.reason == "DISK_FULL"
    monkeypatch.undo()
    record, existed = store.publish("p", "v0", 0, m)
    assert not existed and same(full_copy(store, "p", record.identity), m)
