"""The version store: identities, full-every-K, planning across missed versions, GC, rollback, restarts."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from astra.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from astra.weights.checkpoint import apply_delta
from astra.weights.checksum import adler32_hex
from astra.weights.layout import load_tensors
from astra.weights.store import Store, StoreConfig
from astra.weights.store_fetch import open_source

FAST = {"durable": False}
# Every tensor staged in its own file, as a test of resuming an interrupted publish needs with
# these small tensors: a store holds tensors under 256 KiB in RAM until the commit by default
# (sent again after an interruption; tests/test_weights_ram_stage.py).
FILE_STAGED = {"ram_stage_bytes": 0}


def bf16_model(seed: int, n: int = 4, size: int = 4096) -> dict:
    rng = np.random.default_rng(seed)
    return {
        f"layers.{i}.w": (
            "BF16",
            (size // 64, 64),
            rng.integers(0, 1 << 16, size, np.uint16).tobytes(),
        )
        for i in range(n)
    }


def sparse_update(model: dict, seed: int, fraction: float = 0.01) -> dict:
    """Flips low mantissa bits of about `fraction` of each bf16 tensor's elements."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (dtype, shape, data) in model.items():
        values = np.frombuffer(data, np.uint16).copy()
        picked = rng.choice(values.size, max(1, int(values.size * fraction)), replace=False)
        values[picked] ^= rng.integers(1, 8, picked.size).astype(np.uint16)
        out[name] = (dtype, shape, values.tobytes())
    return out


def chain_of(n: int, seed: int = 0, size: int = 4096) -> list[dict]:
    models = [bf16_model(seed, size=size)]
    for i in range(1, n):
        models.append(sparse_update(models[-1], seed * 1000 + i))
    return models


def same(directory: Path, model: dict) -> bool:
    loaded = load_tensors(directory)
    return loaded.keys() == model.keys() and all(
        (loaded[n].dtype, loaded[n].shape, bytes(loaded[n].data)) == (d, tuple(s), bytes(b))
        for n, (d, s, b) in model.items()
    )


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "receivers.json"
    }


def full_copy(store: Store, policy: str, identity: str) -> Path:
    return store.cache.full_dir(policy, store.get(policy, identity))


def test_identities_are_immutable_and_republishing_is_idempotent(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(**FAST))
    m0, m1 = chain_of(2)
    record, existed = store.publish("p", "v0", 0, m0, files={"config.json": b"{}"})
    assert (record.kind, existed) == ("full", False)
    assert record.file_sha256 and all(len(h) == 64 for h in record.file_sha256.values())
    before = tree(tmp_path)
    again, existed = store.publish("p", "v0", 0, m0, files={"config.json": b"{}"})
    assert existed and again.identity == "v0" and tree(tmp_path) == before
    for other in ({**m0, **{"layers.0.w": m1["layers.0.w"]}}, m1):
        with pytest.raises(AlreadyExists) as err:
            store.publish("p", "v0", 0, other, files={"config.json": b"{}"})
        assert err.value.reason == "VERSION_CONTENT_MISMATCH"
    with pytest.raises(AlreadyExists):
        store.publish("p", "v0", 0, m0, files={"config.json": b"{ }"})
    assert tree(tmp_path) == before, "a refused publish writes nothing"
    for bad in ("", "initial", "a/b", "..", "x" * 129):
        with pytest.raises(InvalidArgument):
            store.publish("p", bad, 1, m1)
    with pytest.raises(FailedPrecondition) as err:
        store.publish("p", "older", 0, m1)
    assert err.value.reason == "VERSION_NOT_NEWER"


def test_full_every_k_and_plans_cross_missed_versions_and_roots(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(full_every=4, max_chain=9, **FAST))
    models = chain_of(11)
    for i, m in enumerate(models):
        store.publish("p", f"v{i}", i, m)
    kinds = [store.get("p", f"v{i}").kind for i in range(11)]
    assert kinds == ["full", "delta", "delta", "delta"] * 2 + ["full", "delta", "delta"]
    assert all(store.get("p", f"v{i}").has_delta for i in range(1, 11)), "roots keep a bridge"
    full_size = sum(len(b) for _, _, b in models[10].values())
    for held, base in [(["v1"], "v1"), (["v3", "v1"], "v3"), (["v9", "v0"], "v9"), (["v2"], "v2")]:
        src = open_source(store, "p", "v10", held)
        try:
            assert (src.plan.kind, src.plan.base) == ("delta", base)
            sent = sum(t.encoded_size for t in src.tensors())
            assert sent < full_size / 5, "missed versions cost a delta, not a full copy"
            out = tmp_path / f"applied-{base}"
            apply_delta(full_copy(store, "p", base), src.version.path, out, durable=False)
            assert same(out, models[10])
        finally:
            src.close()
    backwards = open_source(store, "p", "v2", ["v9"])
    assert backwards.plan.kind == "delta"
    apply_delta(
        full_copy(store, "p", "v9"), backwards.version.path, tmp_path / "back", durable=False
    )
    assert same(tmp_path / "back", models[2])
    backwards.close()
    for held, kind in [([], "full"), (["nope"], "full"), (["v10"], "none")]:
        with _closing(store, "v10", held) as src:
            assert src.plan.kind == kind
    src = open_source(store, "p", "v10", ["v0"])  # 10 deltas away, max_chain is 9
    assert src.plan.kind == "full" and same(src.version.path, models[10])
    src.close()
    # Every cache entry above was built under its own lock; none is left once built, so the
    # table does not grow with the versions of a long run.
    assert store.cache._locks == {}


def test_the_cache_lock_of_a_key_excludes_and_goes_once_unused(tmp_path: Path) -> None:
    import threading
    import time

    cache = Store(tmp_path, StoreConfig(**FAST)).cache
    inside, order = threading.Event(), []

    def hold() -> None:
        with cache._lock("k"):
            inside.set()
            time.sleep(0.2)
            order.append("first out")

    def wait() -> None:
        inside.wait(5)
        with cache._lock("k"):
            order.append("second in")

    threads = [threading.Thread(target=hold), threading.Thread(target=wait)]
    for t in threads:
        t.start()
    with cache._lock("other"):  # another key is not held up meanwhile
        assert inside.wait(5)
        assert set(cache._locks) == {"k", "other"}
    for t in threads:
        t.join(5)
    assert order == ["first out", "second in"] and cache._locks == {}


class _closing:
    def __init__(self, store: Store, target: str, held: list[str]) -> None:
        self.src = open_source(store, "p", target, held)

    def __enter__(self):
        return self.src

    def __exit__(self, *exc: object) -> None:
        self.src.close()


def test_layout_change_is_stored_full_and_ends_the_delta_run(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(**FAST))
    m0, m1 = chain_of(2)
    store.publish("p", "v0", 0, m0)
    grown = {**m1, "extra": ("F32", (3,), np.arange(3, dtype=np.float32).tobytes())}
    record, _ = store.publish("p", "v1", 1, grown)
    assert (record.kind, record.has_delta) == ("full", False)
    with _closing(store, "v1", ["v0"]) as src:
        assert src.plan.kind == "full"
    assert same(full_copy(store, "p", "v1"), grown)


def test_gc_keeps_held_versions_and_their_roots_then_collects(tmp_path: Path) -> None:
    config = StoreConfig(full_every=3, keep_versions=2, receiver_ttl_s=0.5, **FAST)
    store = Store(tmp_path, config)
    models = chain_of(10)
    store.publish("p", "v0", 0, models[0])
    store.publish("p", "v1", 1, models[1])
    store.register_receiver("p", "r1", ["v1"])
    for i in range(2, 10):
        store.publish("p", f"v{i}", i, models[i])
    ids = [r.identity for r in store.list_versions("p")]
    assert ids == [f"v{i}" for i in range(9, -1, -1)], "v1 is held, so v0 (its root) onward stays"
    with _closing(store, "v9", ["v1"]) as src:
        assert src.plan.kind == "delta"
    time.sleep(0.6)  # the registration lapses
    store.publish("p", "v10", 10, sparse_update(models[9], 99))
    ids = [r.identity for r in store.list_versions("p")]
    assert ids == ["v10", "v9"], "collected up to the root of the newest kept versions"
    assert store.get("p", "v9").kind == "full"
    with pytest.raises(NotFound):
        store.get("p", "v1")
    with pytest.raises(AlreadyExists):
        store.publish("p", "v1", 11, models[0])  # a collected identity keeps its content
    assert same(full_copy(store, "p", "v10"), sparse_update(models[9], 99))


def test_rollback_is_a_new_identity_and_idempotent(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(full_every=3, **FAST))
    models = chain_of(5)
    for i, m in enumerate(models):
        store.publish("p", f"v{i}", i, m, files={"config.json": f'{{"v": {i}}}'.encode()})
    record = store.rollback("p", "v1", "rb", 7, "req-1")
    assert (record.identity, record.version, record.rollback_of) == ("rb", 7, "v1")
    assert store.current("p").identity == "rb" and record.base == "v4"
    assert same(full_copy(store, "p", "rb"), models[1])
    assert store.read_files("p", record) == {"config.json": b'{"v": 1}'}
    assert store.rollback("p", "v1", "rb", 7, "req-1") is record
    with pytest.raises(AlreadyExists):
        store.rollback("p", "v2", "rb2", 8, "req-1")
    with pytest.raises(NotFound):
        store.rollback("p", "missing", "rb3", 9, "req-3")
    with _closing(store, "rb", ["v4"]) as src:
        assert src.plan.kind == "delta", "receivers roll back with a delta too"


def test_restart_rebuilds_state_and_resumes_a_staged_publish(tmp_path: Path) -> None:
    store = Store(tmp_path, StoreConfig(full_every=2, **FAST, **FILE_STAGED))
    models = chain_of(4)
    for i in range(3):
        store.publish("p", f"v{i}", i, models[i])
    session = store.begin_publish("p", "v3", 3)
    name, (dtype, shape, data) = sorted(models[3].items())[0]
    sink = session.begin_tensor(name, dtype, shape, adler32_hex(data))
    sink.write(0, data)
    sink.finish()
    session.close()
    pdir = store.policy_dir("p")
    (pdir / "versions" / ".v3.staging-0123456789ab").mkdir()  # a crash mid-rename
    (pdir / "current.json").write_text('{"identity": "v0"}')  # a crash before the pointer moved
    reopened = Store(tmp_path, StoreConfig(full_every=2, **FAST))
    assert [r.identity for r in reopened.list_versions("p")] == ["v2", "v1", "v0"]
    assert '"v2"' in (pdir / "current.json").read_text()
    assert not list((pdir / "versions").glob(".*"))
    session = reopened.begin_publish("p", "v3", 3)
    try:
        assert session.held == [name]
        for n, (d, s, b) in sorted(models[3].items())[1:]:
            sink = session.begin_tensor(n, d, s, adler32_hex(b))
            sink.write(0, b)
            sink.finish()
        record, _ = session.commit(len(models[3]))
    finally:
        session.close()
    assert record.kind == "delta" and same(full_copy(reopened, "p", "v3"), models[3])


CRASHER = """
import sys
from astra.weights.store import Store, StoreConfig
from tests.test_weights_store import chain_of
store = Store(sys.argv[1], StoreConfig(full_every=3))
held = store.list_versions("p") if store.policies() else []  # killed before v0: a bare policy
start = held[0].version + 1 if held else 0
print("ready", flush=True)
for i, m in enumerate(chain_of(40, seed=5, size=1 << 17)):
    if i >= start:
        store.publish("p", f"v{i}", i, m, files={"config.json": b"{}"})
"""


def test_kill_9_mid_publish_leaves_versions_absent_or_complete(tmp_path: Path) -> None:
    expected = chain_of(41, seed=5, size=1 << 17)
    for delay in (0.2, 0.3, 0.3):  # kill at different points, restarting each time
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASHER, str(tmp_path)],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).parent.parent,
        )
        try:
            assert proc.stdout.readline().strip() == b"ready"
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            proc.stdout.close()
        store = Store(tmp_path, StoreConfig(full_every=3))
        assert not list(store.policy_dir("p").glob("versions/.*")), "half-written versions are gone"
        # Killed before the first publish began (a loaded machine): no policy yet, nothing torn.
        records = store.list_versions("p") if store.policies() else []
        for record in records[:3]:
            assert same(full_copy(store, "p", record.identity), expected[record.version])
        if records:
            assert store.current("p").identity == records[0].identity
    n = records[0].version + 1 if records else 0
    store.publish("p", f"v{n}", n, expected[n], files={"config.json": b"{}"})
    assert same(full_copy(store, "p", f"v{n}"), expected[n])


def test_concurrent_rollbacks_with_one_request_id_commit_once(tmp_path: Path) -> None:
    """Two callers race the same request_id for different new identities: one commits, the
    other is told REQUEST_ID_REUSED (the check and the commit are one step)."""
    from concurrent.futures import ThreadPoolExecutor

    from astra.errors import AlreadyExists

    store = Store(tmp_path, StoreConfig(**FAST))
    models = chain_of(3, size=1 << 16)
    for i, m in enumerate(models):
        store.publish("p", f"v{i}", i, m)

    def rollback(new_identity: str):
        try:
            return store.rollback("p", "v0", new_identity, 3, request_id="once")
        except AlreadyExists as exc:
            return exc.reason

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rollback, ["r-a", "r-b"]))
    committed = [r for r in results if not isinstance(r, str)]
    assert len(committed) == 1 and results.count("REQUEST_ID_REUSED") == 1, results
    ids = [r.identity for r in store.list_versions("p")]
    assert ("r-a" in ids) != ("r-b" in ids)
