"""Publishing xor+zstd frames against the version the sender published last."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest

from astra.clients.weights import WeightClient
from astra.clients.weights_publish import publish_version
from astra.clients.weights_stream import Receiver
from astra.errors import AlreadyExists
from astra.weights.checksum import adler32_hex
from astra.weights.delta import encode_xor_zstd
from astra.weights.layout import Version
from astra.weights.v1 import weight_service_pb2 as pb
from tests.conftest import error_info
from tests.test_weights_service import _expect, _stream, run, serving
from tests.test_weights_store import FILE_STAGED, bf16_model, chain_of, same, sparse_update, tree


def full_bytes(model: dict) -> int:
    return sum(len(b) for _, _, b in model.values())


@pytest.mark.parametrize(
    "hot_bytes", [0, 1 << 16, 1 << 20], ids=["base-on-disk", "over-budget", "base-in-ram"]
)
def test_delta_publishes_move_frames_and_fetch_bit_exact(tmp_path: Path, hot_bytes: int) -> None:
    models = chain_of(5, seed=31, size=1 << 15)

    async def body() -> None:
        async with serving(tmp_path / "store", full_every=3, hot_bytes=hot_bytes) as server:
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False)
            first = await publish_version(server.address, "p", "v0", 0, models[0])
            assert first.delta_base == "" and first.bytes_sent == full_bytes(models[0])
            await receiver.fetch()
            for i in range(1, 5):
                result = await publish_version(
                    server.address, "p", f"v{i}", i, models[i], base=(f"v{i - 1}", models[i - 1])
                )
                assert result.delta_base == f"v{i - 1}" and result.version.version_id == f"v{i}"
                assert 0 < result.bytes_sent < full_bytes(models[i]) / 10
                fetched = await receiver.fetch()
                assert fetched.plan == "delta" and same(receiver.current_path, models[i])
                # What the store keeps is its own, complete: every tensor checks out.
                async with WeightClient(server.address) as client:
                    got = await client.get_version("p", f"v{i}")
                assert {t.name: t.adler32 for t in got.tensors} == {
                    n: adler32_hex(b) for n, (_, _, b) in models[i].items()
                }
            with Version(server.store.cache.full_dir("p", server.store.chain("p").head)) as v:
                assert {n: e.checksum for n, e in v.entries.items()} == {
                    n: adler32_hex(b) for n, (_, _, b) in models[4].items()
                }
            assert server.store.chain("p").get("v4").kind == "delta"
            in_ram = server.store.counters["publish_base_in_memory"]
            in_budget = hot_bytes >= full_bytes(models[0])
            assert in_ram == (4 if in_budget else 0), "each delta decoded against the RAM copy"
            assert ("p" in server.store.hot) == in_budget
            await receiver.close()

    run(body())


def test_a_base_that_is_not_current_or_differs_is_published_raw(tmp_path: Path) -> None:
    models = chain_of(4, seed=32)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            await publish_version(server.address, "p", "v1", 1, models[1])
            # The sender's base is v0, the service's current is v1: refused, then sent raw.
            stale = await publish_version(
                server.address, "p", "v2", 2, models[2], base=("v0", models[0])
            )
            assert stale.delta_base == "" and stale.version.version_id == "v2"
            # The sender names v2 but its copy is other bytes: frames fail their checksums.
            wrong = {n: (d, s, bytes(len(b))) for n, (d, s, b) in models[2].items()}
            differs = await publish_version(
                server.address, "p", "v3", 3, models[3], base=("v2", wrong)
            )
            assert differs.delta_base == "" and differs.bytes_sent >= full_bytes(models[3])
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                await rx.fetch("v3")
                assert same(rx.current_path, models[3])

    run(body())


def _delta_tensor(name: str, frame: bytes, size: int, adler: str) -> list:
    h = pb.TensorHeader(name=name, dtype="BF16", shape=[size // 128, 64], adler32=adler)
    h.encoding = pb.TENSOR_ENCODING_XOR_ZSTD
    h.size_bytes, h.encoded_size_bytes = size, len(frame)
    return [
        pb.PublishVersionRequest(tensor=h),
        pb.PublishVersionRequest(chunk=pb.TensorChunk(offset=0, data=frame)),
    ]


def test_bad_frames_are_refused_naming_the_tensor_and_nothing_is_committed(
    tmp_path: Path,
) -> None:
    m0 = bf16_model(33)
    m1 = chain_of(2, seed=33)[1]
    code = grpc.StatusCode
    name = "layers.0.w"
    old, new = m0[name][2], m1[name][2]
    frame = encode_xor_zstd(np.frombuffer(new, np.uint8), np.frombuffer(old, np.uint8))

    def header(base: str = "v0") -> pb.PublishVersionRequest:
        h = pb.PublishHeader(policy_id="p", version_id="v1", version=1, num_tensors=1)
        h.base_version_id = base
        return pb.PublishVersionRequest(header=h)

    async def body() -> None:
        async with serving(tmp_path / "store") as server, WeightClient(server.address) as client:
            stub = client.stub
            await publish_version(server.address, "p", "v0", 0, m0)
            ok = adler32_hex(new)
            no_base = header("")
            await _expect(
                _stream(stub.PublishVersion, [no_base, *_delta_tensor(name, frame, len(new), ok)]),
                code.INVALID_ARGUMENT,
                "INVALID_TENSOR",
            )
            await _expect(
                _stream(stub.PublishVersion, [header("v9")]),
                code.FAILED_PRECONDITION,
                "PUBLISH_BASE_NOT_CURRENT",
            )
            await _expect(
                _stream(stub.PublishVersion, [header("../x")]),
                code.INVALID_ARGUMENT,
                "INVALID_IDENTITY",
            )
            sizeless = b"\x28\xb5\x2f\xfd" + bytes(40)  # a frame header declaring no size
            await _expect(
                _stream(stub.PublishVersion, [header(), *_delta_tensor(name, sizeless, 4096, ok)]),
                code.INVALID_ARGUMENT,
                "INVALID_TENSOR",
                tensor=name,
            )
            cut = frame[: len(frame) // 2]  # half a frame
            await _expect(
                _stream(stub.PublishVersion, [header(), *_delta_tensor(name, cut, len(new), ok)]),
                code.DATA_LOSS,
                "CORRUPT_DELTA",
                tensor=name,
            )
            bad_sum = "0" * 8
            await _expect(
                _stream(
                    stub.PublishVersion, [header(), *_delta_tensor(name, frame, len(new), bad_sum)]
                ),
                code.DATA_LOSS,
                "CHECKSUM_MISMATCH",
                tensor=name,
            )
            huge = pb.PublishVersionRequest(tensor=pb.TensorHeader(
                name=name, dtype="BF16", shape=[len(new) // 128, 64], adler32=ok,
                encoding=pb.TENSOR_ENCODING_XOR_ZSTD, size_bytes=len(new),
                encoded_size_bytes=2 * len(new),
            ))  # fmt: skip
            await _expect(
                _stream(stub.PublishVersion, [header(), huge]),
                code.INVALID_ARGUMENT,
                "INVALID_TENSOR",
            )
            page = await client.list_versions("p")
            assert [v.version_id for v in page.versions] == ["v0"], "nothing committed"
            # The server keeps serving: the same version, sent right, commits as a delta.
            result = await publish_version(server.address, "p", "v1", 1, m1, base=("v0", m0))
            assert result.delta_base == "v0" and result.version.kind == pb.VERSION_KIND_DELTA

    run(body())


def test_an_interrupted_delta_publish_resumes_with_the_tensors_already_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from astra.clients import weights_publish

    models = chain_of(2, seed=34, size=1 << 15)
    original = weights_publish._Preparer.get

    async def dies_at_the_third_tensor(self, order, i):
        if i == 2:
            await asyncio.sleep(0.3)  # the service acknowledges the first two
            raise ConnectionResetError("the trainer died")
        return await original(self, order, i)

    async def body() -> None:
        async with serving(tmp_path / "store", **FILE_STAGED) as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            monkeypatch.setattr(weights_publish._Preparer, "get", dies_at_the_third_tensor)
            with pytest.raises(ConnectionResetError):
                await publish_version(
                    server.address, "p", "v1", 1, models[1], base=("v0", models[0])
                )
            monkeypatch.setattr(weights_publish._Preparer, "get", original)
            result = await publish_version(
                server.address, "p", "v1", 1, models[1], base=("v0", models[0])
            )
            assert result.delta_base == "v0" and result.tensors_skipped == 2
            assert result.tensors_sent == len(models[1]) - 2
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                await rx.fetch("v1")
                assert same(rx.current_path, models[1])

    run(body())


def test_a_service_that_predates_delta_publishes_gets_raw_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from astra.errors import invalid_field
    from astra.servers import weights_publish as servicer

    def raw_only(h, delta_base=""):  # what check_publish_tensor did before base_version_id
        if h.encoding not in (pb.TENSOR_ENCODING_UNSPECIFIED, pb.TENSOR_ENCODING_RAW):
            raise invalid_field(
                "tensor.encoding", "publishes send raw tensors", reason="INVALID_TENSOR"
            )
        return h.dtype, tuple(h.shape), None

    models = chain_of(2, seed=36)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            monkeypatch.setattr(servicer, "check_publish_tensor", raw_only)
            result = await publish_version(
                server.address, "p", "v1", 1, models[1], base=("v0", models[0])
            )
            assert result.delta_base == "" and result.version.version_id == "v1"

    run(body())


def test_after_a_rollback_the_ram_copy_is_gone_and_publishes_still_decode_right(
    tmp_path: Path,
) -> None:
    models = chain_of(4, seed=37)

    async def body() -> None:
        async with serving(tmp_path / "store") as server, WeightClient(server.address) as client:
            store = server.store
            await publish_version(server.address, "p", "v0", 0, models[0])
            await publish_version(server.address, "p", "v1", 1, models[1], base=("v0", models[0]))
            assert store.hot["p"].identity == "v1"
            rb = pb.RollbackVersionRequest(
                policy_id="p", source_version_id="v0", new_version_id="r2", new_version=2,
                request_id="rb-1",
            )  # fmt: skip
            await client.rollback_version(rb)
            assert "p" not in store.hot, "the RAM copy was v1's; the current version is r2 (= v0)"
            # The trainer's last publish was v1: refused as a base, sent raw, stored right.
            late = await publish_version(
                server.address, "p", "v3", 3, models[2], base=("v1", models[1])
            )
            assert late.delta_base == ""
            assert store.hot["p"].identity == "v3"
            # v3 is current and in RAM: the next publish is a delta against it again.
            again = await publish_version(
                server.address, "p", "v4", 4, models[3], base=("v3", models[2])
            )
            assert again.delta_base == "v3"
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                for identity, model in (("r2", models[0]), ("v3", models[2]), ("v4", models[3])):
                    await rx.fetch(identity)
                    assert same(rx.current_path, model), identity

    run(body())


def test_a_ram_copy_that_went_wrong_is_dropped_and_never_encoded_against(tmp_path: Path) -> None:
    """If the service's RAM copy of the current version ever differs from what it stored, a
    sender's frame fails its checksum against it: the copy is dropped, so the raw publish that
    follows encodes the stored delta against the verified bytes on disk."""
    models = chain_of(2, seed=38)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                await rx.fetch("v0")
                hot = server.store.hot["p"]
                hot._arrays["layers.1.w"][100] ^= 0x40  # the RAM copy goes wrong
                result = await publish_version(
                    server.address, "p", "v1", 1, models[1], base=("v0", models[0])
                )
                assert result.delta_base == "", "refused as a delta, then sent raw"
                assert server.store.counters["ram_base_mismatches"] == 1
                assert "p" not in server.store.hot or server.store.hot["p"].identity == "v1"
                fetched = await rx.fetch("v1")
                assert fetched.plan == "delta" and same(rx.current_path, models[1])

    run(body())


def test_a_raw_publish_checks_the_ram_copy_it_encodes_against(tmp_path: Path) -> None:
    """Raw tensors are encoded against the RAM copy of the current version, whose bytes are
    checksummed on the way against what is stored: a copy gone wrong yields no frame (the commit
    encodes that tensor from disk) and is dropped."""
    models = chain_of(2, seed=39)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                await rx.fetch("v0")
                server.store.hot["p"]._arrays["layers.2.w"][7] ^= 0x01
                await publish_version(server.address, "p", "v1", 1, models[1])  # raw
                assert server.store.counters["ram_base_mismatches"] == 1
                assert "p" not in server.store.hot or server.store.hot["p"].identity == "v1"
                fetched = await rx.fetch("v1")
                assert fetched.plan == "delta" and same(rx.current_path, models[1])

    run(body())


def _delta_republish(policy: str, identity: str, version: int, model: dict, base: tuple) -> list:
    """A whole PublishVersion stream of `model` as xor+zstd frames against `base`."""
    base_id, base_model = base
    h = pb.PublishHeader(policy_id=policy, version_id=identity, version=version)
    h.num_tensors, h.base_version_id = len(model), base_id
    msgs = [pb.PublishVersionRequest(header=h)]
    for name, (_, _, data) in sorted(model.items()):
        old = np.frombuffer(base_model[name][2], np.uint8)
        frame = encode_xor_zstd(np.frombuffer(data, np.uint8), old)
        msgs += _delta_tensor(name, frame, len(data), adler32_hex(data))
    return [*msgs, pb.PublishVersionRequest(commit=pb.PublishCommit(num_tensors=len(model)))]


def _sync_publish(address: str, msgs: list) -> tuple[grpc.StatusCode, str, list]:
    """(code, ErrorInfo reason, responses) of one PublishVersion stream, sent whole on the
    sync API (which reports the service's status when it ends the call early)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            "/astra.weights.v1.WeightService/PublishVersion",
            request_serializer=pb.PublishVersionRequest.SerializeToString,
            response_deserializer=pb.PublishVersionResponse.FromString,
        )
        try:
            out = list(call(iter(msgs), timeout=30))
        except grpc.RpcError as exc:
            info, _ = error_info(exc)
            return exc.code(), info.reason if info is not None else "", []
    return grpc.StatusCode.OK, "", out


@pytest.mark.parametrize("sender_base", ["v1", "v2"], ids=["base-v1", "base-v2-itself"])
def test_a_delta_republish_with_other_content_is_refused_and_changes_nothing(
    tmp_path: Path, sender_base: str
) -> None:
    """One identity, one content, whatever the encoding: v2 published as frames against v1
    (content A), then v2 again as frames (against v1, the base it was built on, or against v2,
    the current version) with content B is refused, ALREADY_EXISTS (VERSION_CONTENT_MISMATCH),
    and nothing on disk, in the listing or in what a receiver gets changes; the same republish
    with content A succeeds as the existing version and changes nothing either."""
    v1, a = chain_of(2, seed=40)
    b = sparse_update(a, 41)  # other bytes, same names, dtypes and shapes
    assert all(a[n][2] != b[n][2] for n in a)
    held = {"v1": v1, "v2": a}  # what the sender holds as its base
    store_dir = tmp_path / "store"

    async def body() -> None:
        async with serving(store_dir) as server, WeightClient(server.address) as client:
            await publish_version(server.address, "p", "v1", 1, v1)
            first = await publish_version(server.address, "p", "v2", 2, a, base=("v1", v1))
            assert first.delta_base == "v1" and not first.already_existed
            assert server.store.chain("p").get("v2").kind == "delta"

            async def snapshot() -> tuple:
                listed = await client.list_versions("p")
                got = await client.get_version("p", "v2")
                return tree(store_dir), listed, got, server.store.chain("p").get("v2")

            before = await snapshot()
            base = (sender_base, held[sender_base])
            # On the wire: the frames of B never become v2 (the service refuses them outright,
            # or sends the sender back to raw tensors, which are then compared).
            status, reason, out = await asyncio.to_thread(
                _sync_publish, server.address, _delta_republish("p", "v2", 2, b, base)
            )
            assert (status, reason) in {
                (grpc.StatusCode.ALREADY_EXISTS, "VERSION_CONTENT_MISMATCH"),
                (grpc.StatusCode.FAILED_PRECONDITION, "PUBLISH_BASE_NOT_CURRENT"),
            }, (status, reason, out)
            assert await snapshot() == before
            # The trainer's publish (frames, then raw when the frames are refused): refused.
            with pytest.raises(AlreadyExists) as err:
                await publish_version(server.address, "p", "v2", 2, b, base=base)
            assert err.value.code == "ALREADY_EXISTS"
            assert err.value.reason == "VERSION_CONTENT_MISMATCH", err.value
            assert err.value.metadata["identity"] == "v2"
            assert await snapshot() == before, "a refused republish changed the store"
            # The same content again: the existing version, nothing written.
            again = await publish_version(server.address, "p", "v2", 2, a, base=base)
            assert again.already_existed and again.version.version_id == "v2"
            assert again.version.current and again.version.version == 2
            assert await snapshot() == before, "an idempotent republish changed the store"
            # What receivers get is A, bit for bit, whether they come from v1 or from nothing.
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                await rx.fetch("v1")
                fetched = await rx.fetch("v2")
                assert fetched.identity == "v2" and same(rx.current_path, a)
            async with Receiver(server.address, "p", tmp_path / "rx2", durable=False) as rx:
                await rx.fetch("v2")
                assert same(rx.current_path, a)

    run(body())


def test_tensors_either_side_of_the_inline_size_publish_and_fetch_bit_exact(tmp_path: Path) -> None:
    # Below INLINE_BYTES a tensor is staged, verified and fetched on the event loop's thread,
    # above it on workers (astra.weights.publish_sink, clients.weights_pipeline): both paths,
    # raw and as deltas, to a durable receiver on disk and to one in memory.
    from astra.clients.weights_pipeline import INLINE_BYTES as FETCH_INLINE
    from astra.weights.publish_sink import INLINE_BYTES

    assert FETCH_INLINE == INLINE_BYTES
    rng = np.random.default_rng(7)
    sizes = {"tiny": 48, "under": INLINE_BYTES // 2 - 64, "over": INLINE_BYTES // 2 + 64}
    sizes["large"] = 3 * INLINE_BYTES  # several chunks with chunk_bytes below
    first = {
        n: ("BF16", (k,), rng.integers(0, 1 << 16, k, np.uint16).tobytes())
        for n, k in sizes.items()
    }
    models = [first]
    for i in range(1, 4):
        models.append(sparse_update(models[-1], seed=i, fraction=0.05))

    async def body() -> None:
        async with serving(tmp_path / "store", full_every=3) as server:
            on_disk = Receiver(server.address, "p", tmp_path / "rx", durable=True)
            in_ram = Receiver(server.address, "p", None, in_memory=True)
            base = None
            for i, model in enumerate(models):
                result = await publish_version(
                    server.address, "p", f"v{i}", i, model, base=base, chunk_bytes=200_000
                )
                assert result.delta_base == ("" if i == 0 else f"v{i - 1}")
                base = (f"v{i}", model)
                disk, ram = await on_disk.fetch(), await in_ram.fetch()
                assert (disk.plan, ram.plan) == (("full", "full") if i == 0 else ("delta", "delta"))
                assert same(on_disk.current_path, model)
                assert ram.held is not None
                assert {n: bytes(t.data) for n, t in ram.held.items()} == {
                    n: b for n, (_, _, b) in model.items()
                }
                async with WeightClient(server.address) as client:
                    got = await client.get_version("p", f"v{i}")
                assert {t.name: t.adler32 for t in got.tensors} == {
                    n: adler32_hex(b) for n, (_, _, b) in model.items()
                }
            await on_disk.close()
            await in_ram.close()

    run(body())


def test_a_trainer_sink_publishes_every_version_through_its_one_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WeightServiceSink keeps one WeightClient: no channel (and connection) per version."""
    import astra.clients.weights_publish as publishing
    from astra.clients.trainer_sources import WeightServiceSink

    models = chain_of(3, seed=36)

    def no_new_channel(*args: object, **kwargs: object) -> None:
        raise AssertionError("a publish opened a channel of its own")

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            sink = WeightServiceSink(server.address, "p", {"config.json": b"{}"})
            monkeypatch.setattr(publishing, "WeightClient", no_new_channel)
            try:
                for i, m in enumerate(models):
                    await sink.publish(i, f"v{i}", m)
            finally:
                await sink.close()
            assert server.store.current("p").identity == "v2"
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                await rx.fetch()
                assert same(rx.current_path, models[2])

    run(body())
