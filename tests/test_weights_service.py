"""WeightService over real gRPC: publish/fetch bit-exact, fan-out, deltas, bad input, CLI."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from astra.clients.weights import WeightClient
from astra.clients.weights_stream import Receiver, publish_version
from astra.errors import AlreadyExists, DataLoss
from astra.servers.weights_fetch import StreamSettings
from astra.servers.weights_serve import start_weights
from astra.weights.checkpoint import write_full
from astra.weights.checksum import adler32_hex
from astra.weights.cli import weights
from astra.weights.store import StoreConfig
from astra.weights.v1 import weight_service_pb2 as pb
from tests.conftest import error_info
from tests.test_weights_store import FILE_STAGED, bf16_model, chain_of, same, sparse_update

T = 20  # seconds: every wait in these tests is bounded


@asynccontextmanager
async def serving(store_dir: Path, settings: StreamSettings | None = None, **config):
    config = StoreConfig(durable=False, **config)
    server = await start_weights(store_dir, config=config, settings=settings)
    try:
        yield server
    finally:
        await server.stop(0)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


def test_publish_then_fetch_is_bit_exact_and_later_versions_come_as_deltas(tmp_path: Path) -> None:
    models = chain_of(6, seed=3)
    config = b'{"model_type": "toy"}'

    async def body() -> None:
        small_chunks = StreamSettings(chunk_bytes=1000)  # every tensor spans many chunks
        async with serving(tmp_path / "store", small_chunks, full_every=3) as server:
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False)
            full_size = sum(len(b) for _, _, b in models[0].values())
            for i, m in enumerate(models):
                result = await publish_version(
                    server.address, "p", f"v{i}", i, m, {"config.json": config}, chunk_bytes=4096
                )
                assert result.version.version_id == f"v{i}" and result.version.current
                fetched = await receiver.fetch()
                assert fetched.identity == f"v{i}" and same(receiver.current_path, m)
                assert (receiver.current_path / "config.json").read_bytes() == config
                if i:
                    assert fetched.plan == "delta" and fetched.bytes_received < full_size / 10
            repeat = await publish_version(
                server.address, "p", "v5", 5, models[5], {"config.json": config}
            )
            assert repeat.already_existed and repeat.version.version_id == "v5"
            again = await receiver.fetch("v5")
            assert again.plan == "none" and again.tensors_received == 0
            async with WeightClient(server.address) as client:
                page = await client.list_versions("p", page_size=4)
                assert [v.version_id for v in page.versions] == ["v5", "v4", "v3", "v2"]
                rest = await client.list_versions("p", page_size=4, page_token=page.next_page_token)
                assert [v.version_id for v in rest.versions] == ["v1", "v0"]
                assert not rest.next_page_token
                got = await client.get_version("p", "v3")
                assert got.version.kind == pb.VERSION_KIND_FULL and len(got.tensors) == 4
                assert got.tensors[0].adler32 == adler32_hex(models[3][got.tensors[0].name][2])
                status = await client.get_status()
                assert status.current_versions[0].version_id == "v5"
                assert f"p/{receiver.receiver_id}" in status.receivers
                caps = await client.get_capabilities()
                assert {"chain_compose", "publish_xor_zstd"} <= set(caps.capabilities.features)
            await receiver.close()

    run(body())


def test_eight_concurrent_receivers_share_one_encoding(tmp_path: Path) -> None:
    models = chain_of(4, seed=4)

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            receivers = [
                Receiver(server.address, "p", tmp_path / f"rx{i}", durable=False) for i in range(8)
            ]
            await asyncio.gather(*(r.fetch() for r in receivers))
            for i in (1, 2, 3):  # the receivers miss v1 and v2
                await publish_version(server.address, "p", f"v{i}", i, models[i])
            results = await asyncio.gather(*(r.fetch() for r in receivers))
            assert all(r.plan == "delta" and r.base == "v0" for r in results)
            assert all(same(r.current_path, models[3]) for r in receivers)
            assert server.store.counters["composed_deltas"] == 1, "encoded once for all eight"
            for r in receivers:
                await r.close()

    run(body())


async def _expect(call, code: grpc.StatusCode, reason: str, tensor: str | None = None):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(call, T)
    info, _ = error_info(err.value)
    assert err.value.code() == code and info is not None and info.reason == reason, err.value
    assert info.domain == "astra.weights.v1"
    if tensor is not None:
        assert info.metadata["tensor"] == tensor
    return info


async def _stream(stub_method, messages):
    call = stub_method()
    for m in messages:
        await call.write(m)
    await call.done_writing()
    return [r async for r in call]


def _tensor_msgs(name: str, data: bytes, adler: str | None = None, cut: int | None = None):
    h = pb.TensorHeader(
        name=name, dtype="U8", shape=[len(data)], adler32=adler or adler32_hex(data)
    )
    h.size_bytes = h.encoded_size_bytes = len(data)
    body = data if cut is None else data[:cut]
    return [
        pb.PublishVersionRequest(tensor=h),
        pb.PublishVersionRequest(chunk=pb.TensorChunk(offset=0, data=body)),
    ]


def test_every_rpc_refuses_bad_input_and_the_server_keeps_serving(tmp_path: Path) -> None:
    m0 = bf16_model(1)
    code = grpc.StatusCode

    async def body() -> None:
        async with (
            serving(tmp_path / "store", **FILE_STAGED) as server,
            WeightClient(server.address) as client,
        ):
            stub = client.stub
            await publish_version(server.address, "p", "v0", 0, m0)
            await _expect(client.list_versions("nope"), code.NOT_FOUND, "POLICY_NOT_FOUND")
            await _expect(
                client.list_versions("p", page_size=5000), code.INVALID_ARGUMENT, "INVALID_FIELD"
            )
            await _expect(
                client.list_versions("p", page_token="!!"), code.INVALID_ARGUMENT, "INVALID_FIELD"
            )
            await _expect(client.get_version("p", "v9"), code.NOT_FOUND, "VERSION_NOT_FOUND")
            await _expect(client.get_version("p", "a/b"), code.INVALID_ARGUMENT, "INVALID_IDENTITY")
            rb = pb.RollbackVersionRequest(
                policy_id="p",
                source_version_id="gone",
                new_version_id="r",
                new_version=5,
                request_id="q",
            )
            await _expect(client.rollback_version(rb), code.NOT_FOUND, "VERSION_NOT_FOUND")
            rb.source_version_id, rb.request_id = "v0", ""
            await _expect(client.rollback_version(rb), code.INVALID_ARGUMENT, "INVALID_FIELD")
            ack = pb.FetchVersionRequest(ack=pb.TensorAck(name="x"))
            await _expect(
                _stream(stub.FetchVersion, [ack]), code.INVALID_ARGUMENT, "FETCH_START_REQUIRED"
            )
            await _expect(
                _stream(stub.FetchVersion, []), code.INVALID_ARGUMENT, "FETCH_START_REQUIRED"
            )
            for start, c, reason in [
                (pb.FetchStart(policy_id="nope"), code.NOT_FOUND, "POLICY_NOT_FOUND"),
                (pb.FetchStart(policy_id="p", target_version_id="v7"), code.NOT_FOUND, "VERSION_NOT_FOUND"),
                (pb.FetchStart(policy_id="p", target_version_id="initial"), code.INVALID_ARGUMENT, "INVALID_IDENTITY"),
                (pb.FetchStart(policy_id="p", max_bytes_per_second=-1), code.INVALID_ARGUMENT, "INVALID_FIELD"),
                (pb.FetchStart(policy_id="p", max_bytes_per_second=1), code.INVALID_ARGUMENT, "INVALID_FIELD"),
            ]:  # fmt: skip
                await _expect(
                    _stream(stub.FetchVersion, [pb.FetchVersionRequest(start=start)]), c, reason
                )
            header = pb.PublishHeader(policy_id="p", version_id="v1", version=1, num_tensors=1)
            hdr = pb.PublishVersionRequest(header=header)
            commit = pb.PublishVersionRequest(commit=pb.PublishCommit(num_tensors=1))
            data = bytes(range(200))
            chunk = _tensor_msgs("w", data)[1]
            long_meta = pb.PublishHeader(policy_id="p", version_id="v1", version=1)
            long_meta.metadata["note"] = "x" * 4097
            many_dims = pb.TensorHeader(name="w", dtype="U8", shape=[1] * 65, adler32="00000001")
            many_dims.size_bytes = many_dims.encoded_size_bytes = 1
            cases = [
                ([chunk], code.INVALID_ARGUMENT, "PUBLISH_HEADER_REQUIRED", None),
                ([pb.PublishVersionRequest(header=long_meta)], code.INVALID_ARGUMENT, "INVALID_FIELD", None),
                ([hdr, pb.PublishVersionRequest(tensor=many_dims)], code.INVALID_ARGUMENT, "INVALID_TENSOR", None),
                ([pb.PublishVersionRequest(header=pb.PublishHeader(policy_id="p", version_id="initial"))],
                 code.INVALID_ARGUMENT, "INVALID_IDENTITY", None),
                ([hdr, *_tensor_msgs("w", data, adler="00000001")], code.DATA_LOSS, "CHECKSUM_MISMATCH", "w"),
                ([hdr, *_tensor_msgs("w", data, cut=50), commit], code.INVALID_ARGUMENT, "TRUNCATED_TENSOR", "w"),
                ([hdr, *_tensor_msgs("w", data)], code.INVALID_ARGUMENT, "PUBLISH_INCOMPLETE", None),
                ([hdr, chunk], code.INVALID_ARGUMENT, "UNEXPECTED_CHUNK", None),
            ]  # fmt: skip
            for msgs, c, reason, tensor in cases:
                await _expect(_stream(stub.PublishVersion, msgs), c, reason, tensor)
            conflict = {**m0, "layers.0.w": sparse_update(m0, 1)["layers.0.w"]}
            with pytest.raises(AlreadyExists) as err:
                await publish_version(server.address, "p", "v0", 0, conflict)
            assert err.value.reason == "VERSION_CONTENT_MISMATCH"
            # still serving: the staged "w" from the incomplete publish resumes
            resumed = await _stream(stub.PublishVersion, [hdr, commit])
            assert list(resumed[0].accepted.held_tensors) == ["w"] and resumed[-1].HasField(
                "committed"
            )
            assert (await client.get_status()).current_versions[0].version_id == "v1"

    run(body())


class ThreadServer:
    """A WeightService on its own event loop thread, for clients that run their own loop."""

    def __init__(self, store_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        make = start_weights(store_dir, config=StoreConfig(durable=False))
        self.server = asyncio.run_coroutine_threadsafe(make, self.loop).result(T)
        self.address = self.server.address

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(T)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(T)


def test_cli_publish_list_fetch_rollback(tmp_path: Path) -> None:
    models = chain_of(3, seed=8)
    for i, m in enumerate(models):
        write_full(tmp_path / f"d{i}", m, {"model_type": "toy"}, version=f"v{i}", durable=False)
    server = ThreadServer(tmp_path / "store")

    def cli(*args):
        result = CliRunner().invoke(weights, [str(a) for a in args])
        return result.exit_code, (
            json.loads(result.stdout) if result.exit_code == 0 else result.output
        )

    try:
        s = ("--server", server.address, "--policy", "p")
        for i in range(3):
            rc, out = cli("publish", *s, "--identity", f"v{i}", "--version", i, tmp_path / f"d{i}")
            assert rc == 0 and out["version"]["version_id"] == f"v{i}", out
        rc, out = cli("list", *s)
        assert rc == 0 and [v["version_id"] for v in out["versions"]] == ["v2", "v1", "v0"]
        rx = tmp_path / "rx"
        rc, out = cli(
            "fetch", *s, "--identity", "v1", "--out", rx, "--held", tmp_path / "d0", "--no-fsync"
        )
        assert rc == 0 and out["plan"] == "delta" and same(rx / "current", models[1]), out
        rc, out = cli("rollback", *s, "--to", "v0", "--identity", "back")
        assert rc == 0 and out["version"]["version"] == "3", out
        rc, out = cli("fetch", *s, "--out", rx, "--no-fsync")
        assert rc == 0 and out["identity"] == "back" and same(rx / "current", models[0])
        assert cli("fetch", *s, "--identity", "zzz", "--out", rx)[0] == 1
        assert cli("rollback", *s, "--to", "initial", "--identity", "x")[0] == 2
        assert cli("list", "--server", "127.0.0.1:1", "--policy", "p")[0] == 1
    finally:
        server.close()


def test_receiver_error_names_the_tensor_and_keeps_the_previous_version(tmp_path: Path) -> None:
    models = chain_of(2, seed=9)

    async def body() -> None:
        async with serving(tmp_path / "store", full_every=1) as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False, backoff_s=0.01)
            await receiver.fetch()
            await publish_version(server.address, "p", "v1", 1, models[1])
            store = server.store
            stored = store.version_dir("p", "v1") / "delta"
            shard = next(stored.glob("*.safetensors"))
            raw = bytearray(shard.read_bytes())
            raw[-20] ^= 0xFF  # one byte inside the last frame
            shard.write_bytes(bytes(raw))
            with pytest.raises(DataLoss) as err:
                await receiver.fetch()
            assert err.value.metadata.get("tensor", "").startswith("layers.")
            assert same(receiver.current_path, models[0]), "the previous version stays current"
            assert not (tmp_path / "rx" / "versions" / "v1").exists()
            await receiver.close()

    run(body())


def test_acknowledged_tensors_count_only_with_an_explicit_target(tmp_path: Path) -> None:
    """FetchStart.acknowledged_tensors is honoured only with target_version_id (the proto):
    with "" the service must send every tensor, not a plan of zero tensors."""
    import numpy as np

    from astra.servers.weights_fetch import StreamSettings, fetch_stream
    from astra.weights.store import Store, StoreConfig

    store = Store(tmp_path, StoreConfig(durable=False, hot_bytes=0))

    def model(v):
        return {
            n: ("F32", (4,), np.full(4, v + i, np.float32).tobytes()) for i, n in enumerate("ab")
        }

    store.publish("p", "v1", 1, model(1))
    store.publish("p", "v2", 2, model(5))

    async def body():
        async def requests():
            yield pb.FetchVersionRequest(
                start=pb.FetchStart(policy_id="p", acknowledged_tensors=["a", "b"])
            )
            await asyncio.sleep(30)

        stream = fetch_stream(store, requests(), StreamSettings(ack_timeout_s=1))
        first = await anext(stream)
        await stream.aclose()
        return first.plan

    plan = asyncio.run(asyncio.wait_for(body(), 10))
    assert plan.target.version_id == "v2" and plan.num_tensors == 2


def test_a_tensor_too_large_for_any_model_is_refused_in_band(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path / "store") as server, WeightClient(server.address) as client:
            hdr = pb.PublishVersionRequest(
                header=pb.PublishHeader(policy_id="p", version_id="v1", version=1, num_tensors=1)
            )
            huge = pb.TensorHeader(name="w", dtype="F64", shape=[2**61], adler32="00000001")
            huge.size_bytes = huge.encoded_size_bytes = 2**63 - 1
            await _expect(
                _stream(client.stub.PublishVersion, [hdr, pb.PublishVersionRequest(tensor=huge)]),
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_TENSOR",
            )

    run(body())
