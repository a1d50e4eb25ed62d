"""Interoperability with the reference `safetensors` library (what transformers, vLLM, SGLang and
slime read and write with): Astra's full and delta directories, and the directories a receiver
installs, read with it; deltas and bases written with it apply in Astra.

test_weights_format.py checks the layout byte by byte against cwtrain's README; these check it
against the implementation the peers actually run.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from astra.clients.weights_stream import Receiver, publish_version
from astra.servers.weights_serve import start_weights
from astra.weights.checkpoint import apply_delta, inspect, load_tensors, write_delta, write_full
from astra.weights.layout import INDEX_NAME, ChecksumMismatch
from astra.weights.store import StoreConfig

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# safetensors dtype name -> torch dtype, for the dtypes both sides know.
TORCH = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DELTA_KEYS = {"delta_encoding": "xor", "compression_format": "zstd", "checksum_format": "adler32"}


def adler(data: bytes) -> str:
    return format(zlib.adler32(data, 1), "08x")


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture
def model() -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every dtype both sides know, a bf16 matrix over several shards' worth, an empty tensor."""
    rng = np.random.default_rng(7)
    out = {}
    for i, dtype in enumerate(sorted(TORCH)):
        n = 8 + i
        data = rng.integers(0, 256, n * torch.empty(0, dtype=TORCH[dtype]).element_size(), np.uint8)
        if dtype == "BOOL":
            data = data % 2
        out[f"t.{dtype.lower()}"] = (dtype, (n,), data.astype(np.uint8).tobytes())
    f32 = rng.standard_normal(128 * 64).astype(np.float32)
    out["embed.weight"] = (
        "BF16",
        (128, 64),
        (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes(),
    )
    out["empty"] = ("F32", (0, 4), b"")
    return out


def changed(model: dict, names: list[str]) -> dict:
    """The model with the low bit of every 5th byte of `names` flipped."""
    out = dict(model)
    for name in names:
        dtype, shape, data = model[name]
        b = np.frombuffer(data, np.uint8).copy()
        b[::5] ^= 1
        out[name] = (dtype, shape, b.tobytes())
    return out


def read_with_safetensors(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Every tensor of a directory's shards and each shard's metadata, through safe_open."""
    index = json.loads((directory / INDEX_NAME).read_text())
    tensors, metadata = {}, {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(directory / shard, framework="pt") as f:
            metadata[shard] = f.metadata()
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                assert index["weight_map"][name] == shard, name
                tensors[name] = f.get_tensor(name)
    assert set(tensors) == set(index["weight_map"])
    return tensors, metadata


def test_full_checkpoint_reads_with_safetensors(tmp_path: Path, model: dict) -> None:
    write_full(tmp_path / "v1", model, {"model_type": "toy"}, max_shard_bytes=4096, version="v1")
    tensors, metadata = read_with_safetensors(tmp_path / "v1")
    assert len(metadata) > 1  # the model spans several shards
    assert tensors.keys() == model.keys()
    for name, (dtype, shape, data) in model.items():
        t = tensors[name]
        assert (t.dtype, tuple(t.shape), raw_bytes(t)) == (TORCH[dtype], shape, data), name
    for shard, meta in metadata.items():
        assert meta.pop("format") == "pt"
        names = set(load_file(tmp_path / "v1" / shard))  # the one-call loader too
        assert meta == {n: adler(model[n][2]) for n in names}, shard


def test_delta_reads_with_safetensors_and_decodes_without_astra(
    tmp_path: Path, model: dict
) -> None:
    new = changed(model, ["embed.weight", "t.f32"])
    write_full(tmp_path / "v1", model, {"model_type": "toy"}, version="v1")
    write_full(tmp_path / "v2", new, {"model_type": "toy"}, version="v2")
    write_delta(tmp_path / "v1", tmp_path / "v2", tmp_path / "d2", durable=False)
    index = json.loads((tmp_path / "d2" / INDEX_NAME).read_text())
    assert index["metadata"] == {"version": "v2", "base_version": "v1", **DELTA_KEYS}
    frames, metadata = read_with_safetensors(tmp_path / "d2")
    assert set(frames) == {"embed.weight", "t.f32"}  # unchanged tensors left out
    (meta,) = metadata.values()
    for name, frame in frames.items():
        assert frame.dtype == torch.uint8 and frame.dim() == 1
        xor = zstandard.ZstdDecompressor().decompress(raw_bytes(frame))
        got = (np.frombuffer(xor, np.uint8) ^ np.frombuffer(model[name][2], np.uint8)).tobytes()
        assert got == new[name][2] and meta[name] == adler(got), name


def write_peer_delta(out: Path, base: dict, new: dict, names: list[str], sums: dict) -> None:
    """A delta as a slime / cwtrain sender writes it, through safetensors' save_file."""
    out.mkdir()
    frames = {}
    for name in names:
        xor = np.frombuffer(new[name][2], np.uint8) ^ np.frombuffer(base[name][2], np.uint8)
        frame = zstandard.ZstdCompressor(level=3).compress(xor.tobytes())
        frames[name] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    shard = "model-00001-of-00001.safetensors"
    save_file(frames, out / shard, metadata=sums)
    metadata = {"version": "000002", "base_version": "000001", **DELTA_KEYS}
    index = {"metadata": metadata, "weight_map": dict.fromkeys(names, shard)}
    (out / INDEX_NAME).write_text(json.dumps(index))


def test_delta_written_by_safetensors_applies(tmp_path: Path, model: dict) -> None:
    names = ["embed.weight", "t.i32"]
    new = changed(model, names)
    write_full(tmp_path / "v1", model, {"model_type": "toy"}, version="000001")
    write_peer_delta(tmp_path / "d2", model, new, names, {n: adler(new[n][2]) for n in names})
    assert inspect(tmp_path / "d2")["base_version"] == "000001"
    apply_delta(tmp_path / "v1", tmp_path / "d2", tmp_path / "v2")
    got = load_tensors(tmp_path / "v2")
    assert {n: bytes(t.data) for n, t in got.items()} == {n: t[2] for n, t in new.items()}


def test_peer_delta_with_a_wrong_checksum_is_refused_naming_the_tensor(
    tmp_path: Path, model: dict
) -> None:
    names = ["embed.weight", "t.i32"]
    new = changed(model, names)
    write_full(tmp_path / "v1", model, {"model_type": "toy"}, version="000001")
    sums = {n: adler(new[n][2]) for n in names}
    sums["t.i32"] = adler(model["t.i32"][2])  # the base's checksum: the sender's bug
    write_peer_delta(tmp_path / "d2", model, new, names, sums)
    with pytest.raises(ChecksumMismatch, match=r"t\.i32"):
        apply_delta(tmp_path / "v1", tmp_path / "d2", tmp_path / "v2")
    assert not (tmp_path / "v2").exists()


def test_checkpoint_saved_by_safetensors_is_a_base(tmp_path: Path, model: dict) -> None:
    """A plain Hugging Face checkpoint (save_file, no checksums) as the base of a delta."""
    plain = tmp_path / "hf"
    plain.mkdir()
    as_torch = {
        n: torch.frombuffer(bytearray(d), dtype=TORCH[dt]).reshape(s)
        if d
        else torch.empty(s, dtype=TORCH[dt])
        for n, (dt, s, d) in model.items()
    }
    save_file(as_torch, plain / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    weight_map = dict.fromkeys(model, "model-00001-of-00001.safetensors")
    (plain / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (plain / "config.json").write_text("{}")
    new = changed(model, ["embed.weight"])
    write_delta(plain, new, tmp_path / "d2", "v2", "initial")
    apply_delta(plain, tmp_path / "d2", tmp_path / "v2")
    tensors, _ = read_with_safetensors(tmp_path / "v2")
    assert {n: raw_bytes(t) for n, t in tensors.items()} == {n: t[2] for n, t in new.items()}


def test_version_a_receiver_installs_reads_with_safetensors(tmp_path: Path, model: dict) -> None:
    """What an engine that loads by path (vLLM, SGLang) opens: the receiver's installed version,
    after a full copy and after a delta."""
    new = changed(model, ["embed.weight", "t.bf16"])

    async def body() -> None:
        config = StoreConfig(durable=False)
        server = await start_weights(tmp_path / "store", config=config)
        try:
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False)
            for i, m in enumerate((model, new)):
                await publish_version(server.address, "p", f"v{i}", i, m)
                fetched = await receiver.fetch()
                assert fetched.plan == ("delta" if i else "full")
                tensors, metadata = read_with_safetensors(receiver.current_path)
                assert {n: raw_bytes(t) for n, t in tensors.items()} == {
                    n: t[2] for n, t in m.items()
                }
                for meta in metadata.values():
                    assert all(meta[n] == adler(m[n][2]) for n in meta if n in m)
            await receiver.close()
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))
