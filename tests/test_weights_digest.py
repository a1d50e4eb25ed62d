"""Per-tensor content digests: BLAKE3 for new records, SHA-256 records of earlier releases still
recognised (idempotent republish, tombstones, a staged publish resumed)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
import pytest

from astra.errors import AlreadyExists
from astra.weights.checksum import adler32_hex
from astra.weights.digest import digest_body, digest_of, kind_of, normalized
from astra.weights.store import Store, StoreConfig
from tests.test_weights_store import FAST, FILE_STAGED, chain_of, same, sparse_update, tree


def legacy_content_digest(version: int, model: dict, files: dict, metadata: dict) -> str:
    """A version's content digest as releases before BLAKE3 computed it (bare SHA-256 hex)."""
    body = {
        "version": version,
        "tensors": {
            n: [d, list(s), hashlib.sha256(b).hexdigest()] for n, (d, s, b) in model.items()
        },
        "files": {n: hashlib.sha256(c).hexdigest() for n, c in files.items()},
        "metadata": metadata,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def to_legacy_record(version_dir: Path, model: dict) -> None:
    """Rewrites record.json as a release before BLAKE3 wrote it: `sha256`, bare hex."""
    path = version_dir / "record.json"
    body = json.loads(path.read_text())
    for name, t in body["tensors"].items():
        del t["digest"]
        t["sha256"] = hashlib.sha256(model[name][2]).hexdigest()
    path.write_text(json.dumps(body, indent=1) + "\n")


def test_digests_are_tagged_and_bare_hex_is_sha256() -> None:
    data = b"astra" * 1000
    assert digest_of(data) == "blake3:" + blake3.blake3(data).hexdigest()
    assert digest_of(data, "sha256") == "sha256:" + hashlib.sha256(data).hexdigest()
    bare = hashlib.sha256(data).hexdigest()
    assert normalized(bare) == "sha256:" + bare and kind_of(bare) == "sha256"
    assert digest_body("sha256:" + bare) == bare, "SHA-256 enters a content digest as before"
    assert digest_body(digest_of(data)).startswith("blake3:")
    with pytest.raises(ValueError):
        kind_of("md5:00")


def test_new_records_hold_blake3_digests_of_each_tensors_bytes(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(**FAST))
    m0, m1 = chain_of(2)
    store.publish("p", "v0", 0, m0)
    record, _ = store.publish("p", "v1", 1, m1)
    assert record.kind == "delta"
    for name, (_, _, data) in m1.items():
        assert record.tensors[name].digest == "blake3:" + blake3.blake3(data).hexdigest()
    on_disk = json.loads((store.version_dir("p", "v1") / "record.json").read_text())
    assert all("digest" in t and "sha256" not in t for t in on_disk["tensors"].values())
    reopened = Store(tmp_path, StoreConfig(**FAST))
    assert reopened.get("p", "v1").tensors == record.tensors


def test_a_version_recorded_with_sha256_is_republished_idempotently(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(**FAST))
    m0, m1 = chain_of(2)
    store.publish("p", "v0", 0, m0, files={"config.json": b"{}"})
    store.publish("p", "v1", 1, m1, files={"config.json": b"{}"})
    to_legacy_record(store.version_dir("p", "v0"), m0)
    to_legacy_record(store.version_dir("p", "v1"), m1)
    store = Store(tmp_path, StoreConfig(**FAST))
    old = store.get("p", "v1")
    assert {kind_of(t.digest) for t in old.tensors.values()} == {"sha256"}
    assert old.content_digest() == legacy_content_digest(1, m1, {"config.json": b"{}"}, {})
    before = tree(tmp_path)
    again, existed = store.publish("p", "v1", 1, m1, files={"config.json": b"{}"})
    assert existed and again.tensors == old.tensors and tree(tmp_path) == before
    changed = {**m1, "layers.0.w": sparse_update(m1, 7)["layers.0.w"]}
    with pytest.raises(AlreadyExists) as err:
        store.publish("p", "v1", 1, changed, files={"config.json": b"{}"})
    assert err.value.reason == "VERSION_CONTENT_MISMATCH"
    assert tree(tmp_path) == before
    m2 = sparse_update(m1, 3)
    record, existed = store.publish("p", "v2", 2, m2)  # a delta against the SHA-256 record
    assert not existed and record.kind == "delta"
    assert {kind_of(t.digest) for t in record.tensors.values()} == {"blake3"}
    assert same(store.cache.full_dir("p", record), m2)


def test_a_tombstone_left_by_a_sha256_release_admits_only_the_same_content(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(**FAST))
    m0, m1 = chain_of(2)
    store.publish("p", "v0", 0, m0)
    tombstones = store.policy_dir("p") / "tombstones.json"
    tombstones.write_text(json.dumps({"gone": legacy_content_digest(5, m1, {}, {})}))
    with pytest.raises(AlreadyExists) as err:
        store.publish("p", "gone", 5, sparse_update(m1, 11))
    assert err.value.reason == "VERSION_CONTENT_MISMATCH"
    record, existed = store.publish("p", "gone", 5, m1)
    assert not existed and same(store.cache.full_dir("p", record), m1)


@pytest.mark.parametrize("how", ["stream", "in_process"])
def test_a_publish_staged_by_a_sha256_release_resumes(tmp_path: Path, how: str) -> None:
    store = Store(tmp_path, StoreConfig(full_every=4, **FAST, **FILE_STAGED))
    m0, m1 = chain_of(2)
    store.publish("p", "v0", 0, m0)
    session = store.begin_publish("p", "v1", 1)
    names = sorted(m1)
    for name in names[:2]:
        dtype, shape, data = m1[name]
        sink = session.begin_tensor(name, dtype, shape, adler32_hex(data))
        sink.write(0, data)
        sink.finish()
    session.close()
    (manifest,) = (store.policy_dir("p") / "staging").glob("*/tensors.jsonl")
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted(line["name"] for line in lines) == names[:2]
    for line in lines:  # as the release before wrote it
        del line["digest"]
        line["sha256"] = hashlib.sha256(m1[line["name"]][2]).hexdigest()
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    store = Store(tmp_path, StoreConfig(full_every=4, **FAST, **FILE_STAGED))
    if how == "in_process":  # hashes the held tensors again to compare them with the stage
        record, _ = store.publish("p", "v1", 1, m1)
    else:
        session = store.begin_publish("p", "v1", 1)
        try:
            assert session.held == names[:2], "the staged tensors are kept"
            for name in names[2:]:
                dtype, shape, data = m1[name]
                sink = session.begin_tensor(name, dtype, shape, adler32_hex(data))
                sink.write(0, data)
                sink.finish()
            record, _ = session.commit(len(m1))
        finally:
            session.close()
    kinds = {n: kind_of(t.digest) for n, t in record.tensors.items()}
    assert kinds == {n: "sha256" if n in names[:2] else "blake3" for n in names}, (
        "kept, not sent again"
    )
    assert same(store.cache.full_dir("p", record), m1)
    # The in-process publish of the same identity hashes each tensor as its record did.
    again, existed = store.publish("p", "v1", 1, m1)
    assert existed and again.tensors == record.tensors
