"""Faults on the weight streams: disconnects, SIGKILLed receivers and services, corrupt bytes, relays."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from astra.clients.weights import WeightClient
from astra.clients.weights_stream import Receiver, publish_version
from astra.servers.weights_serve import start_weights
from astra.weights.checksum import adler32_hex
from astra.weights.layout import Version
from astra.weights.store import Store, StoreConfig
from astra.weights.store_fetch import FetchSource
from astra.weights.v1 import weight_service_pb2 as pb
from tests.procs import Proc
from tests.test_weights_service import ThreadServer, run, serving
from tests.test_weights_store import FILE_STAGED, bf16_model, chain_of, same

T = 20


def wait_for(predicate, timeout_s: float = T) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.02)


def staged(directory: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in directory.glob("staging/*/tensors.jsonl"))


def mixed_model(seed: int) -> dict:
    """4 tensors of 256 KiB (a receiver stages each in a file of its own, which survives an
    interruption) and 2 of 8 KiB (held in RAM until the install, received again after one)."""
    small = bf16_model(seed + 1, n=2, size=1 << 12)
    return {
        **bf16_model(seed, size=1 << 17),
        **{f"norms.{i}": small[name] for i, name in enumerate(sorted(small))},
    }


def test_receiver_cancelled_mid_stream_resumes_after_acknowledged_tensors(tmp_path: Path) -> None:
    model = mixed_model(11)
    rx = tmp_path / "rx"

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, model)
            slow = Receiver(server.address, "p", rx, durable=False, max_bytes_per_second=1_600_000)
            task = asyncio.create_task(slow.fetch())
            await asyncio.wait_for(_until(lambda: staged(rx) >= 2), T)
            task.cancel()  # the connection drops mid-version
            await asyncio.gather(task, return_exceptions=True)
            await slow.close()
            assert slow.current_path is None, "nothing half-fetched is ever current"
            async with Receiver(server.address, "p", rx, durable=False) as again:
                result = await again.fetch()
            # Only large tensors resume: the small ones were in RAM and come again.
            assert 2 <= result.tensors_resumed <= 4
            assert result.tensors_received == 6 - result.tensors_resumed
            assert same(again.current_path, model)
            assert server.store.counters["fetch_tensors_resumed"] >= 2

    run(body())


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def test_corrupt_chunk_on_the_wire_is_refused_then_resent(tmp_path: Path, monkeypatch) -> None:
    models = chain_of(2, seed=12)
    original = FetchSource.chunks
    corrupted: list[str] = []

    def flip_once(self, name, chunk_bytes, start=0):
        for piece in original(self, name, chunk_bytes, start):
            if not corrupted:
                corrupted.append(name)
                bad = bytearray(piece)
                bad[len(bad) // 2] ^= 0x01
                piece = memoryview(bytes(bad))
            yield piece

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            monkeypatch.setattr(FetchSource, "chunks", flip_once)
            async with Receiver(
                server.address, "p", tmp_path / "rx", durable=False, backoff_s=0.01
            ) as receiver:
                result = await receiver.fetch()
                assert corrupted and result.attempts == 2
                assert same(receiver.current_path, models[0])

    run(body())


FETCH = "from astra.weights.cli import weights; weights()"


def test_receiver_killed_by_sigkill_resumes_in_a_new_process(tmp_path: Path) -> None:
    model = mixed_model(13)
    server = ThreadServer(tmp_path / "store")
    rx = tmp_path / "rx"
    args = [sys.executable, "-c", FETCH, "fetch", "--server", server.address, "--policy", "p"]
    args += ["--out", str(rx), "--no-fsync"]
    try:
        asyncio.run(publish_version(server.address, "p", "v0", 0, model))
        proc = subprocess.Popen([*args, "--max-bytes-per-second", "1200000"])
        try:
            wait_for(lambda: staged(rx) >= 2 or proc.poll() is not None)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(T)
        assert not (rx / "current").exists()
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert 2 <= result["tensors_resumed"] <= 4 and same(rx / "current", model)
    finally:
        server.close()


# Every tensor staged in its own file (ram_stage_bytes=0), as these tests' small tensors must be
# to survive a kill: a store holds small ones in RAM until the commit (sent again after one).
SERVE = (
    "import asyncio, sys; from astra.servers.weights_serve import serve_weights; "
    "from astra.weights.store import StoreConfig; "
    "asyncio.run(serve_weights(sys.argv[1], port=int(sys.argv[2]), "
    "config=StoreConfig(ram_stage_bytes=0)))"
)


def _serve(store: Path, port: int, log: Path) -> Proc:
    return Proc([sys.executable, "-c", SERVE, str(store), str(port)], log=log)


def test_service_sigkilled_mid_publish_resumes_after_restart(tmp_path: Path) -> None:
    models = chain_of(2, seed=14)
    names = sorted(models[0])
    first = _serve(tmp_path / "store", 0, tmp_path / "w1.log")
    port = int(first.address.rsplit(":", 1)[1])

    async def partial() -> None:
        async with WeightClient(first.address) as client:
            call = client.stub.PublishVersion()
            header = pb.PublishHeader(policy_id="p", version_id="v0", version=0, num_tensors=4)
            await call.write(pb.PublishVersionRequest(header=header))
            assert (await call.read()).HasField("accepted")
            for name in names[:2]:
                dtype, shape, data = models[0][name]
                h = pb.TensorHeader(name=name, dtype=dtype, shape=list(shape))
                h.adler32, h.size_bytes = adler32_hex(data), len(data)
                await call.write(pb.PublishVersionRequest(tensor=h))
                chunk = pb.TensorChunk(offset=0, data=data)
                await call.write(pb.PublishVersionRequest(chunk=chunk))
                assert (await asyncio.wait_for(call.read(), T)).tensor_ack.name == name
            first.signal(signal.SIGKILL)  # the service dies mid-publish
            first.wait(T)

    async def resume() -> None:
        task = asyncio.create_task(
            publish_version(
                f"127.0.0.1:{port}", "p", "v0", 0, models[0], backoff_s=0.1, max_attempts=8
            )
        )
        await asyncio.sleep(0.3)  # the first attempts find nobody listening
        second = await asyncio.to_thread(_serve, tmp_path / "store", port, tmp_path / "w2.log")
        try:
            result = await asyncio.wait_for(task, 60)
            assert (result.tensors_skipped, result.tensors_sent) == (2, 2) and result.attempts > 1
            await publish_version(second.address, "p", "v1", 1, models[1])
            async with Receiver(second.address, "p", tmp_path / "rx", durable=False) as receiver:
                await receiver.fetch("v0")
                assert same(receiver.current_path, models[0])
                assert (await receiver.fetch()).plan == "delta"
                assert same(receiver.current_path, models[1])
        finally:
            second.close()

    try:
        run(partial())
        run(resume())
    finally:
        first.close()


def test_service_sigkilled_mid_delta_publish_resumes_after_restart(tmp_path: Path) -> None:
    """Frames acknowledged before the kill stay (decoded and durable); the restarted service has
    no RAM copy and decodes the rest against the base on disk."""
    from astra.weights.delta import encode_xor_zstd

    models = chain_of(2, seed=16)
    names = sorted(models[0])
    first = _serve(tmp_path / "store", 0, tmp_path / "w1.log")
    port = int(first.address.rsplit(":", 1)[1])

    async def partial() -> None:
        await publish_version(first.address, "p", "v0", 0, models[0])
        async with WeightClient(first.address) as client:
            call = client.stub.PublishVersion()
            header = pb.PublishHeader(policy_id="p", version_id="v1", version=1, num_tensors=4)
            header.base_version_id = "v0"
            await call.write(pb.PublishVersionRequest(header=header))
            assert (await call.read()).HasField("accepted")
            for name in names[:2]:
                dtype, shape, data = models[1][name]
                frame = encode_xor_zstd(data, models[0][name][2])
                h = pb.TensorHeader(name=name, dtype=dtype, shape=list(shape))
                h.adler32, h.size_bytes = adler32_hex(data), len(data)
                h.encoding, h.encoded_size_bytes = pb.TENSOR_ENCODING_XOR_ZSTD, len(frame)
                await call.write(pb.PublishVersionRequest(tensor=h))
                chunk = pb.TensorChunk(offset=0, data=frame)
                await call.write(pb.PublishVersionRequest(chunk=chunk))
                assert (await asyncio.wait_for(call.read(), T)).tensor_ack.name == name
            first.signal(signal.SIGKILL)  # the service dies mid-publish
            first.wait(T)

    async def resume() -> None:
        second = await asyncio.to_thread(_serve, tmp_path / "store", port, tmp_path / "w2.log")
        try:
            result = await publish_version(
                second.address, "p", "v1", 1, models[1], base=("v0", models[0])
            )
            assert result.delta_base == "v0"
            assert (result.tensors_skipped, result.tensors_sent) == (2, 2)
            async with Receiver(second.address, "p", tmp_path / "rx", durable=False) as receiver:
                await receiver.fetch("v1")
                assert same(receiver.current_path, models[1])
        finally:
            second.close()

    try:
        run(partial())
        run(resume())
    finally:
        first.close()


def test_relay_serves_what_it_fetched_to_the_next_tier(tmp_path: Path) -> None:
    models = chain_of(3, seed=15)

    async def body() -> None:
        async with serving(tmp_path / "origin") as origin:
            relay_store = Store(tmp_path / "relay-store", StoreConfig(durable=False))
            relay_server = await start_weights(tmp_path / "relay-store", store=relay_store)
            try:
                relay = Receiver(
                    origin.address, "p", tmp_path / "relay", relay=relay_store, durable=False
                )
                leaf = Receiver(relay_server.address, "p", tmp_path / "leaf", durable=False)
                for i, m in enumerate(models):
                    await publish_version(origin.address, "p", f"v{i}", i, m)
                    if i == 1:
                        continue  # the relay tier misses v1
                    await relay.fetch()
                    result = await leaf.fetch()
                    assert result.identity == f"v{i}" and same(leaf.current_path, m)
                assert result.plan == "delta" and result.base == "v0"
                async with WeightClient(relay_server.address) as client:
                    status = await client.get_status()
                    assert status.current_versions[0].version_id == "v2"
                await relay.close()
                await leaf.close()
            finally:
                await relay_server.stop(0)

    run(body())


def test_fetch_with_no_acknowledgements_times_out_and_frees_the_stream(tmp_path: Path) -> None:
    model = chain_of(1, seed=16)[0]

    async def body() -> None:
        from astra.servers.weights_fetch import StreamSettings

        server = await start_weights(
            tmp_path / "store",
            config=StoreConfig(durable=False),
            settings=StreamSettings(ack_timeout_s=0.3, window_bytes=1),
        )
        try:
            await publish_version(server.address, "p", "v0", 0, model)
            async with WeightClient(server.address) as client:
                call = client.stub.FetchVersion()
                await call.write(pb.FetchVersionRequest(start=pb.FetchStart(policy_id="p")))
                try:
                    async for _ in call:  # never acknowledges anything
                        pass
                    raise AssertionError("the stream should fail")
                except grpc.aio.AioRpcError as exc:
                    # UNAVAILABLE: a receiver resumes from what it acknowledged.
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                status = await client.get_status()
                assert status.active_fetches == 0
        finally:
            await server.stop(0)

    run(body())


@pytest.mark.parametrize("staged", ["files", "ram"])
def test_disk_full_at_commit_is_resource_exhausted_and_the_publish_resumes(
    tmp_path: Path, monkeypatch, staged: str
) -> None:
    import errno

    import astra.weights.store as store_module
    from astra.errors import ResourceExhausted

    models = chain_of(2, seed=17)
    real = store_module.write_delta

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    async def body() -> None:
        config = FILE_STAGED if staged == "files" else {}
        async with serving(tmp_path / "store", **config) as server:
            await publish_version(server.address, "p", "v0", 0, models[0])
            monkeypatch.setattr(store_module, "write_delta", full_disk)
            try:
                await publish_version(server.address, "p", "v1", 1, models[1])
                raise AssertionError("the publish should fail")
            except ResourceExhausted as exc:
                assert exc.reason == "DISK_FULL"
            async with Receiver(server.address, "p", tmp_path / "rx", durable=False) as rx:
                assert (await rx.fetch()).identity == "v0", "the previous version is still served"
                monkeypatch.setattr(store_module, "write_delta", real)
                result = await publish_version(server.address, "p", "v1", 1, models[1])
                # Files stay staged; small tensors held in RAM are sent again.
                assert result.tensors_skipped == (4 if staged == "files" else 0)
                assert (await rx.fetch()).plan == "delta" and same(rx.current_path, models[1])

    run(body())


def test_delta_fetch_links_unchanged_tensors_and_rewrites_nothing(tmp_path: Path) -> None:
    first = chain_of(1, seed=15, size=1 << 17)[0]  # 256 KiB each: a shard file each
    second = dict(first)
    changed = sorted(first)[0]
    dtype, shape, data = first[changed]
    flipped = bytearray(data)
    flipped[7] ^= 0x01
    second[changed] = (dtype, shape, bytes(flipped))
    rx = tmp_path / "rx"

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, first)
            await publish_version(server.address, "p", "v1", 1, second)
            async with Receiver(server.address, "p", rx, durable=False) as receiver:
                await receiver.fetch("v0")
                result = await receiver.fetch("v1")
            assert result.plan == "delta" and result.tensors_received == 1
            assert same(rx / "versions" / "v0", first) and same(rx / "current", second)
            assert not list((rx / "staging").iterdir()), "the stage goes once installed"

    run(body())
    with Version(rx / "versions" / "v0") as v0, Version(rx / "versions" / "v1") as v1:
        for name in first:
            old, new = v0.entries[name].shard.path, v1.entries[name].shard.path
            shared = old.stat().st_ino == new.stat().st_ino
            assert shared == (name != changed), name  # unchanged tensors are the same file
            assert v1.entries[name].checksum == adler32_hex(bytes(second[name][2]))


def shard_files(version: Path) -> set[Path]:
    with Version(version) as v:
        return {e.shard.path for e in v.entries.values()}


def test_small_tensors_arrive_in_one_shard_and_a_delta_leaving_them_links_it(
    tmp_path: Path,
) -> None:
    v0 = mixed_model(17)
    big, small = sorted(n for n in v0 if n.startswith("layers.")), ["norms.0", "norms.1"]

    def flip(model: dict, name: str) -> dict:
        dtype, shape, data = model[name]
        changed = bytearray(data)
        changed[3] ^= 0x01
        return {**model, name: (dtype, shape, bytes(changed))}

    v1 = flip(v0, big[0])  # the small tensors as they were
    v2 = flip(v1, small[0])  # one small tensor changes
    rx = tmp_path / "rx"
    path = {i: rx / "versions" / f"v{i}" for i in range(3)}

    def inode(i: int, name: str) -> int:
        with Version(path[i]) as v:
            return v.entries[name].shard.path.stat().st_ino

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            for i, model in enumerate((v0, v1, v2)):
                await publish_version(server.address, "p", f"v{i}", i, model)
            async with Receiver(server.address, "p", rx) as receiver:  # durable
                await receiver.fetch("v0")
                with Version(path[0]) as first:
                    packed = first.entries[small[0]].shard
                    assert set(packed.tensors) == set(small), "the small tensors share one shard"
                    assert all(first.entries[n].checksum == adler32_hex(v0[n][2]) for n in v0)
                assert len(shard_files(path[0])) == len(big) + 1
                result = await receiver.fetch("v1")
                assert result.plan == "delta" and result.tensors_received == 1
                assert same(path[1], v1)
                # Only a large tensor changed: v0's small-tensor shard is linked, not rewritten.
                assert all(inode(0, n) == inode(1, n) for n in small)
                result = await receiver.fetch("v2")
                assert result.plan == "delta" and result.tensors_received == 1
                assert same(receiver.current_path, v2)
                # A small one changed: a new shard holds both (the other read from v1, checked).
                with Version(path[2]) as third:
                    assert third.entries[small[0]].shard.path == third.entries[small[1]].shard.path
                    assert all(third.entries[n].checksum == adler32_hex(v2[n][2]) for n in v2)
                assert inode(2, small[1]) != inode(1, small[1])
                assert all(inode(1, n) == inode(2, n) for n in big)
            assert not list((rx / "staging").iterdir())

    run(body())


def test_a_stage_left_by_an_older_layout_is_fetched_again(tmp_path: Path) -> None:
    model = chain_of(1, seed=16)[0]
    rx = tmp_path / "rx"
    stage = rx / "staging" / "v0"
    (stage / "files").mkdir(parents=True)
    old = {"name": sorted(model)[0], "file": "t-000000.bin", "adler32": "00000001"}
    (stage / "t-000000.bin").write_bytes(b"\0" * 16)
    (stage / "tensors.jsonl").write_text(json.dumps(old) + "\n")

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, model)
            async with Receiver(server.address, "p", rx, durable=False) as receiver:
                result = await receiver.fetch()
            assert result.tensors_resumed == 0 and result.tensors_received == len(model)
            assert same(rx / "current", model)

    run(body())


@pytest.mark.parametrize("rotted", ["layers.3.w", "layers.0.w"], ids=["unchanged", "changed"])
def test_a_byte_rotted_in_a_held_version_is_caught_and_the_fetch_goes_on_without_it(
    tmp_path: Path, rotted: str
) -> None:
    """The receiver's v0 rots on disk. In a tensor v1 does not change, it would be linked into
    v1 as is; in one v1 changes, the decode fails its checksum as if the sender were wrong.
    Either way the corrupt v0 is named and the fetch goes on without it (a full copy), so v1
    arrives intact."""
    m0 = chain_of(1, seed=41, size=1 << 14)[0]
    m1 = dict(m0)
    name = "layers.0.w"
    dtype, shape, data = m1[name]
    m1[name] = (dtype, shape, bytes([data[0] ^ 1]) + data[1:])  # only layers.0 changes

    async def body() -> None:
        async with serving(tmp_path / "store") as server:
            await publish_version(server.address, "p", "v0", 0, m0)
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False, backoff_s=0.01)
            await receiver.fetch()
            held = receiver.current_path.resolve()
            with Version(held) as v:
                entry = v.entries[rotted]
                shard, pos = entry.shard.path, entry.shard.data_start + entry.info.begin + 10
            raw = bytearray(Path(shard).read_bytes())
            raw[pos] ^= 0x40  # bit rot
            Path(shard).write_bytes(bytes(raw))
            await publish_version(server.address, "p", "v1", 1, m1)
            result = await receiver.fetch()
            assert result.plan == "full" and result.attempts == 2
            assert same(receiver.current_path, m1)
            await receiver.close()

    run(body())
