"""Tombstones of collected versions: an append-only log, one line per collected version, that
survives a restart, skips a torn last line and still reads a store's older tombstones.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astra.errors import AlreadyExists
from astra.weights.store import Store, StoreConfig
from astra.weights.tombstones import LEGACY, LOG, Tombstones
from tests.test_weights_store import chain_of, sparse_update

CONFIG = StoreConfig(full_every=3, keep_versions=2, durable=False)


def published(tmp_path: Path, n: int) -> tuple[Store, list[dict]]:
    store = Store(tmp_path, CONFIG)
    models = chain_of(n)
    for i, m in enumerate(models):
        store.publish("p", f"v{i}", i, m)
    return store, models


def test_each_collected_version_is_one_line_and_nothing_is_rewritten(tmp_path: Path) -> None:
    store, _ = published(tmp_path, 12)
    kept = {r.identity for r in store.list_versions("p")}
    log = store.policy_dir("p") / LOG
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    names = [e["identity"] for e in lines]
    assert sorted(names) == sorted({f"v{i}" for i in range(12)} - kept)
    assert len(names) == len(set(names)), "a version's tombstone is written once"
    assert not (store.policy_dir("p") / LEGACY).exists()
    assert store.counters["versions_collected"] == len(names)


def test_a_collected_identity_keeps_its_content_after_a_restart(tmp_path: Path) -> None:
    _, models = published(tmp_path, 10)
    reopened = Store(tmp_path, CONFIG)
    with pytest.raises(AlreadyExists) as err:
        reopened.publish("p", "v0", 20, sparse_update(models[0], 5))
    assert err.value.reason == "VERSION_CONTENT_MISMATCH"
    record, existed = reopened.publish("p", "v99", 20, sparse_update(models[0], 5))
    assert not existed and record.identity == "v99", "only the collected identity is refused"


def test_a_torn_last_line_is_skipped_and_the_legacy_file_still_counts(tmp_path: Path) -> None:
    pdir = tmp_path / "p"
    pdir.mkdir()
    (pdir / LEGACY).write_text(json.dumps({"old": "d-old"}))
    (pdir / LOG).write_text(
        json.dumps({"identity": "a", "digest": "d-a"}) + '\n{"identity": "b", "dig'
    )
    stones = Tombstones(lambda policy: tmp_path / policy)
    assert dict(stones.get("p")) == {"old": "d-old", "a": "d-a"}
    stones.add("p", {"c": "d-c"})
    assert dict(Tombstones(lambda policy: tmp_path / policy).get("p")) == {
        "old": "d-old",
        "a": "d-a",
        "c": "d-c",
    }, "a line appended after a torn one reads back"
    (pdir / LEGACY).write_text(json.dumps({"old": "d-old", "x": "d-x"}))  # changed by hand
    assert stones.get("p")["x"] == "d-x", "a file changed under the store is read again"
