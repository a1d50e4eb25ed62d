"""The offline weight format: safetensors I/O, Adler-32, xor+zstd deltas, version directories."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard

from astra.errors import FailedPrecondition, InvalidArgument
from astra.weights import checksum
from astra.weights.checkpoint import (
    LayoutChanged,
    apply_delta,
    check_identity,
    inspect,
    load_tensors,
    write_delta,
    write_full,
)
from astra.weights.checksum import adler32_hex, is_adler32_hex
from astra.weights.delta import (
    DeltaError,
    bytes_equal,
    decode_xor_zstd,
    encode_if_changed,
    encode_xor_zstd,
    frame_compressed_size,
)
from astra.weights.layout import INDEX_NAME, ChecksumMismatch
from astra.weights.safetensors_io import (
    DTYPE_BITS,
    FormatError,
    SafetensorsFile,
    tensor_nbytes,
    write_file,
)

DELTA_KEYS = {
    "delta_encoding": "xor",
    "compression_format": "zstd",
    "checksum_format": "adler32",
}


def bf16_model(rng: np.random.Generator, sizes: dict[str, tuple[int, ...]]) -> dict:
    """bf16 tensors as uint16 bit patterns taken from normal float32 values."""
    out = {}
    for name, shape in sizes.items():
        f32 = rng.standard_normal(int(np.prod(shape))).astype(np.float32)
        out[name] = ("BF16", shape, (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    return out


def sparse_update(rng: np.random.Generator, tensors: dict, fraction: float = 0.01) -> dict:
    """Flips low mantissa bits of about `fraction` of each bf16 tensor's elements."""
    out = {}
    for name, (dtype, shape, data) in tensors.items():
        values = np.frombuffer(data, dtype=np.uint16).copy()
        picked = rng.choice(values.size, max(1, int(values.size * fraction)), replace=False)
        values[picked] ^= rng.integers(1, 8, picked.size).astype(np.uint16)
        out[name] = (dtype, shape, values.tobytes())
    return out


def same(loaded: dict, expected: dict) -> bool:
    return loaded.keys() == expected.keys() and all(
        (loaded[n].dtype, loaded[n].shape, bytes(loaded[n].data)) == (d, tuple(s), bytes(b))
        for n, (d, s, b) in expected.items()
    )


def raw_header(path: Path) -> dict:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length])


def tree_digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def no_leftovers(out: Path) -> bool:
    return not out.exists() and not any(out.parent.glob(f".{out.name}.staging-*"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def chain(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, Path, dict, dict]:
    """(base dir, delta dir, base tensors, new tensors) for a small two-shard model."""
    base = bf16_model(rng, {"embed": (256, 64), "layers.0.w": (64, 64), "layers.1.w": (64, 64)})
    base["norm"] = ("F32", (64,), rng.standard_normal(64).astype(np.float32).tobytes())
    new = sparse_update(rng, {k: v for k, v in base.items() if k != "norm"})
    new["norm"] = base["norm"]
    write_full(tmp_path / "v1", base, {"model_type": "toy"}, max_shard_bytes=20_000, version="v1")
    write_full(tmp_path / "v2", new, {"model_type": "toy"}, version="v2")
    write_delta(tmp_path / "v1", tmp_path / "v2", tmp_path / "d2", durable=False)
    return tmp_path / "v1", tmp_path / "d2", base, new


# --- safetensors -----------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_safetensors_round_trip_every_dtype(tmp_path: Path, dtype: str) -> None:
    shape = (3, 8)
    data = np.random.default_rng(0).integers(0, 256, tensor_nbytes(dtype, shape), np.uint8)
    path = tmp_path / "x.safetensors"
    write_file(path, [("a", dtype, shape, data.tobytes()), ("b", "U8", (0,), b"")], {"k": "v"})
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0 and raw[8 : 8 + length].endswith((b"}", b" "))
    with SafetensorsFile(path) as f:
        assert f.metadata == {"k": "v"}
        assert (f.tensors["a"].dtype, f.tensors["a"].shape) == (dtype, shape)
        assert f.read("a") == data.tobytes() and f.read("b") == b""


def test_sub_byte_dtypes_must_fill_bytes() -> None:
    assert tensor_nbytes("F4", (4,)) == 2
    with pytest.raises(ValueError, match="whole bytes"):
        tensor_nbytes("F4", (3,))


def _file_with_header(
    path: Path, header: object, data: bytes = b"", raw: bytes | None = None
) -> None:
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


@pytest.mark.parametrize(
    ("header", "data", "needle"),
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "cover"),
        (
            {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
            b"\0" * 4,
            "t: data_offsets",
        ),
        (
            {"t": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 4,
            "t: unknown dtype",
        ),
        (
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            "b: overlaps",
        ),
        (
            {"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}},
            b"\0" * 4,
            "a: leaves a gap",
        ),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 3, "cover 2 bytes"),
        ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2], "x": 1}}, b"\0\0", "a: entry"),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
        ([1, 2], b"", "not a JSON object"),
    ],
)
def test_safetensors_strict_validation(tmp_path: Path, header, data: bytes, needle: str) -> None:
    path = tmp_path / "bad.safetensors"
    _file_with_header(path, header, data)
    with pytest.raises(FormatError, match=needle) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)


def test_safetensors_refuses_bad_lengths_and_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(FormatError, match="out of bounds"):
        SafetensorsFile(path)
    entry = b'{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
    dup = b'{"a":' + entry + b',"a":' + entry + b"}"
    _file_with_header(path, None, raw=dup)
    with pytest.raises(FormatError, match="duplicate"):
        SafetensorsFile(path)
    path.write_bytes(b"\x01")
    with pytest.raises(FormatError, match="shorter"):
        SafetensorsFile(path)


# --- checksum and per-tensor delta ------------------------------------------


def test_adler32_hex_matches_zlib_without_copies() -> None:
    assert adler32_hex(b"") == "00000001"
    assert adler32_hex(b"Wikipedia") == "11e60398"
    array = np.arange(1000, dtype=np.uint16)
    assert adler32_hex(array) == format(zlib.adler32(array.tobytes(), 1), "08x")
    assert adler32_hex(memoryview(array.tobytes())[10:]) == adler32_hex(array.tobytes()[10:])
    assert is_adler32_hex("0a1b2c3d") and not is_adler32_hex("0A1B2C3D") and not is_adler32_hex(7)


def test_fast_adler32_equals_the_stdlib_in_every_split(rng: np.random.Generator) -> None:
    """zlib-ng's SIMD Adler-32 is used when installed (it is a dependency); its running values
    must equal the reference zlib's for any buffer split, or receivers would refuse tensors."""
    assert checksum.implementation() == "zlib-ng"
    data = rng.integers(0, 256, (3 << 20) + 17, np.uint8)
    whole = zlib.adler32(data.tobytes(), 1)
    assert checksum.adler32(data) == whole
    for cuts in ([1], [5551, 5552, 5553], [4096, 1 << 20], list(range(0, data.size, 65521))[1:]):
        value, pos = 1, 0
        for cut in [*cuts, data.size]:
            value = checksum.adler32(data[pos:cut], value)
            pos = cut
        assert value == whole, cuts
    assert checksum.adler32(np.full(1 << 16, 255, np.uint8), 0xFFF0FFF0) == zlib.adler32(
        bytes([255]) * (1 << 16), 0xFFF0FFF0
    )


@pytest.mark.parametrize("size", [0, 1, 7, 4096, (1 << 20) + 3, 5 << 20])
def test_xor_zstd_round_trip(size: int, rng: np.random.Generator) -> None:
    old = rng.integers(0, 256, size, np.uint8).tobytes()
    new = bytearray(old)
    if size:
        new[size // 2] ^= 0x40
    frame = encode_xor_zstd(bytes(new), old)
    assert frame[:4] == b"\x28\xb5\x2f\xfd" and frame_compressed_size(frame) == len(frame)
    assert zstandard.frame_content_size(frame) == size
    assert decode_xor_zstd(frame, old, size) == new
    assert bytes_equal(new, old) == (size == 0)
    assert (encode_if_changed(bytes(new), old) is None) == (size == 0)


def test_decode_refuses_wrong_sizes_and_framing(rng: np.random.Generator) -> None:
    old = rng.integers(0, 256, 1000, np.uint8).tobytes()
    # Magic, descriptor (8-byte content size, window byte), 1 TiB claimed, one empty last block.
    huge = b"\x28\xb5\x2f\xfd\xc0\x00" + struct.pack("<Q", 1 << 40) + b"\x01\x00\x00"
    assert zstandard.frame_content_size(huge) == 1 << 40
    for bigger in (huge, zstandard.ZstdCompressor().compress(b"\0" * 1001)):
        with pytest.raises(DeltaError, match="declares"):
            decode_xor_zstd(bigger, old, 1000)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 2000)
    with pytest.raises(DeltaError, match="more than 1000"):
        decode_xor_zstd(unsized, old, 1000)
    frame = encode_xor_zstd(old[::-1], old)
    for bad, needle in [
        (frame + b"\0", "after"),
        (frame[:-3], "truncated"),
        (b"junk" + frame, "magic"),
    ]:
        with pytest.raises(DeltaError, match=needle):
            decode_xor_zstd(bad, old, 1000)
    checked = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False).compress(
        bytes(a ^ b for a, b in zip(old[::-1], old, strict=True))
    )
    assert decode_xor_zstd(checked, old, 1000) == old[::-1]


# --- version directories ----------------------------------------------------


def test_sparse_bf16_chain_is_bit_exact(tmp_path: Path, rng: np.random.Generator) -> None:
    versions = [bf16_model(rng, {f"layers.{i}.w": (128, 96) for i in range(6)})]
    for _ in range(3):
        versions.append(sparse_update(rng, versions[-1]))
    write_full(tmp_path / "v0", versions[0], {"a": 1}, max_shard_bytes=60_000, durable=False)
    current = tmp_path / "v0"
    for step, tensors in enumerate(versions[1:], start=1):
        stats = write_delta(current, tensors, tmp_path / f"d{step}", f"v{step}", f"v{step - 1}")
        assert stats["changed_tensor_count"] == 6
        assert stats["delta_size_bytes"] * 10 < stats["model_size_bytes"]
        result = apply_delta(current, tmp_path / f"d{step}", tmp_path / f"v{step}")
        assert result["version"] == f"v{step}"
        current = tmp_path / f"v{step}"
        assert same(load_tensors(current), tensors)
        assert inspect(current)["checksums_verified"] is True
    assert (current / "config.json").read_text() == (tmp_path / "v0" / "config.json").read_text()


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_every_dtype_full_and_delta(tmp_path: Path, dtype: str, rng: np.random.Generator) -> None:
    shape = (16, 8)
    data = rng.integers(0, 256, tensor_nbytes(dtype, shape), np.uint8)
    changed = data.copy()
    changed[3] ^= 0x11
    base = {"w": (dtype, shape, data.tobytes()), "fixed": ("U8", (4,), b"abcd")}
    new = {"w": (dtype, shape, changed.tobytes()), "fixed": base["fixed"]}
    write_full(tmp_path / "b", base, None, durable=False)
    stats = write_delta(tmp_path / "b", new, tmp_path / "d", "v2", "v1", durable=False)
    assert stats["changed_tensor_count"] == 1
    apply_delta(tmp_path / "b", tmp_path / "d", tmp_path / "n", durable=False)
    assert same(load_tensors(tmp_path / "n"), new)


def test_empty_delta_is_an_index_without_shards(tmp_path: Path, chain) -> None:
    base_dir, _, base, _ = chain
    write_delta(base_dir, base, tmp_path / "empty", "v1b", "v1")
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == [INDEX_NAME]
    index = json.loads((tmp_path / "empty" / INDEX_NAME).read_text())
    assert index["weight_map"] == {}
    report = inspect(tmp_path / "empty")
    assert (report["kind"], report["tensor_count"], report["shard_count"]) == ("delta", 0, 0)
    assert report["warnings"] == ["the delta changes no tensors"]
    apply_delta(base_dir, tmp_path / "empty", tmp_path / "same")
    assert same(load_tensors(tmp_path / "same"), base)


def test_tensor_larger_than_shard_limit(tmp_path: Path, rng: np.random.Generator) -> None:
    base = bf16_model(rng, {"big": (3 * 1024, 1024), "small.a": (64,), "small.b": (64,)})
    new = sparse_update(rng, base)
    write_full(tmp_path / "b", base, {}, max_shard_bytes=1 << 20, durable=False)
    index = json.loads((tmp_path / "b" / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) == 2  # 6 MiB alone, the two small ones together
    write_delta(tmp_path / "b", new, tmp_path / "d", "v2", "v1", max_shard_bytes=1)  # one each
    assert len(list((tmp_path / "d").glob("*.safetensors"))) == 3
    apply_delta(tmp_path / "b", tmp_path / "d", tmp_path / "n", workers=3)
    assert same(load_tensors(tmp_path / "n"), new)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_delta_byte_fails_apply_naming_tensor(tmp_path: Path, chain) -> None:
    base_dir, delta_dir, _, _ = chain
    shard = next(delta_dir.glob("*.safetensors"))
    with SafetensorsFile(shard) as f:
        info = f.tensors["layers.1.w"]
        start = f.data_start + info.begin
    _flip_byte(shard, start + info.nbytes // 2)
    before = tree_digest(base_dir)
    with pytest.raises(FormatError, match=r"layers\.1\.w") as err:
        apply_delta(base_dir, delta_dir, tmp_path / "out")
    assert err.value.tensor == "layers.1.w"
    assert no_leftovers(tmp_path / "out") and tree_digest(base_dir) == before


def test_corrupt_base_byte_fails_apply_naming_tensor(tmp_path: Path, chain) -> None:
    base_dir, delta_dir, _, _ = chain
    for name in ("norm", "layers.0.w"):  # unchanged and changed by the delta
        shard = base_dir / json.loads((base_dir / INDEX_NAME).read_text())["weight_map"][name]
        with SafetensorsFile(shard) as f:
            offset = f.data_start + f.tensors[name].begin + 5
        _flip_byte(shard, offset)
        with pytest.raises(ChecksumMismatch) as err:
            apply_delta(base_dir, delta_dir, tmp_path / "out")
        assert err.value.tensor == name and err.value.reason == "CHECKSUM_MISMATCH"
        assert no_leftovers(tmp_path / "out")
        _flip_byte(shard, offset)


def test_wrong_base_is_detected(tmp_path: Path, chain, rng: np.random.Generator) -> None:
    _, delta_dir, base, _ = chain
    other = sparse_update(rng, base, fraction=0.001)
    write_full(tmp_path / "other", other, {}, durable=False)
    with pytest.raises(ChecksumMismatch, match="wrong base"):
        apply_delta(tmp_path / "other", delta_dir, tmp_path / "out")
    assert no_leftovers(tmp_path / "out")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda t: t.update(embed=("F16", (256, 64), t["embed"][2])), "BF16"),
        (lambda t: t.update(embed=("BF16", (64, 256), t["embed"][2])), r"\[256, 64\]"),
        (lambda t: t.update(extra=("U8", (1,), b"x")), "not in the base"),
        (lambda t: t.pop("norm"), "missing from the new version"),
    ],
)
def test_layout_changes_are_refused(tmp_path: Path, chain, change, needle: str) -> None:
    base_dir, _, _, new = chain
    tensors = dict(new)
    change(tensors)
    with pytest.raises(LayoutChanged, match=needle) as err:
        write_delta(base_dir, tensors, tmp_path / "d", "v3", "v1")
    assert err.value.reason == "TENSOR_LAYOUT_CHANGED" and "full version" in err.value.message
    assert no_leftovers(tmp_path / "d")


def test_inspect_full_and_delta(chain) -> None:
    base_dir, delta_dir, _, new = chain
    full = inspect(base_dir)
    assert (full["kind"], full["version"], full["base_version"]) == ("full", "v1", None)
    assert full["tensor_count"] == 4 and full["checksums_verified"] is True
    assert {f["name"] for f in full["files"]} >= {"config.json", INDEX_NAME}
    assert all(len(f["sha256"]) == 64 for f in full["files"])
    delta = inspect(delta_dir)
    assert (delta["kind"], delta["version"], delta["base_version"]) == ("delta", "v2", "v1")
    assert delta["tensor_count"] == 3  # norm is unchanged
    assert delta["model_size_bytes"] == sum(len(new[n][2]) for n in new if n != "norm")


def test_inspect_rejects_broken_directories(tmp_path: Path, chain) -> None:
    base_dir, delta_dir, _, _ = chain
    index = json.loads((delta_dir / INDEX_NAME).read_text())
    index["metadata"]["compression_format"] = "lz4"
    (delta_dir / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(FormatError, match="lz4") as err:
        inspect(delta_dir)
    assert err.value.reason == "UNSUPPORTED_DELTA"
    shard = base_dir / json.loads((base_dir / INDEX_NAME).read_text())["weight_map"]["norm"]
    with SafetensorsFile(shard) as f:
        offset = f.data_start + f.tensors["norm"].begin
    _flip_byte(shard, offset)
    with pytest.raises(FormatError, match="norm: bytes hash"):
        inspect(base_dir)
    (base_dir / "model-stray.safetensors").write_bytes(b"")
    with pytest.raises(FormatError, match="not in the weight_map"):
        inspect(base_dir)


@pytest.mark.parametrize("bad", ["", "a/b", ".", "..", "initial", "x" * 129])
def test_identities(bad: str) -> None:
    assert check_identity("step_000100") == "step_000100"
    assert check_identity("initial", allow_initial=True) == "initial"
    with pytest.raises(InvalidArgument):
        check_identity(bad)


def test_output_directory_is_never_overwritten(tmp_path: Path, chain) -> None:
    base_dir, delta_dir, _, _ = chain
    (tmp_path / "out").mkdir()
    with pytest.raises(FailedPrecondition):
        apply_delta(base_dir, delta_dir, tmp_path / "out")
    with pytest.raises(FailedPrecondition):
        apply_delta(delta_dir, delta_dir, tmp_path / "out2")  # a delta is no base


# --- interoperability with the slime / CoreWeave hot-load layout --------------


def test_hand_built_slime_delta_applies(tmp_path: Path, chain) -> None:
    """A delta laid out exactly as cwtrain's README describes, built without our writer."""
    base_dir, _, base, new = chain
    out = tmp_path / "weight_v000002"
    out.mkdir()
    names = ["embed", "layers.0.w"]
    frames, sums = {}, {}
    for name in names:
        x = np.bitwise_xor(
            np.frombuffer(new[name][2], np.uint8), np.frombuffer(base[name][2], np.uint8)
        )
        frames[name] = zstandard.ZstdCompressor(level=1).compress(x.tobytes())
        sums[name] = format(zlib.adler32(new[name][2], 1), "08x")
    header, offset = {"__metadata__": sums}, 0
    for name in names:
        header[name] = {
            "dtype": "U8",
            "shape": [len(frames[name])],
            "data_offsets": [offset, offset + len(frames[name])],
        }
        offset += len(frames[name])
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    shard = "model-00000-of-00001.safetensors"
    (out / shard).write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(frames.values()))
    metadata = {"version": "000002", "base_version": "000001", **DELTA_KEYS}
    (out / INDEX_NAME).write_text(
        json.dumps({"metadata": metadata, "weight_map": dict.fromkeys(names, shard)})
    )
    assert inspect(out)["base_version"] == "000001"
    apply_delta(base_dir, out, tmp_path / "applied")
    expected = {**base, "embed": new["embed"], "layers.0.w": new["layers.0.w"]}
    assert same(load_tensors(tmp_path / "applied"), expected)


def test_written_delta_matches_the_readme_layout(chain) -> None:
    _, delta_dir, base, new = chain
    index = json.loads((delta_dir / INDEX_NAME).read_text())
    assert index["metadata"] == {"version": "v2", "base_version": "v1", **DELTA_KEYS}
    assert set(index["weight_map"]) == {"embed", "layers.0.w", "layers.1.w"}
    assert set(index["weight_map"].values()) == {"model-00000-of-00001.safetensors"}
    header = raw_header(delta_dir / "model-00000-of-00001.safetensors")
    assert set(header.pop("__metadata__").items()) == {
        (n, format(zlib.adler32(new[n][2], 1), "08x")) for n in index["weight_map"]
    }
    with SafetensorsFile(delta_dir / "model-00000-of-00001.safetensors") as f:
        for name, entry in header.items():
            assert entry["dtype"] == "U8" and entry["shape"] == [
                entry["data_offsets"][1] - entry["data_offsets"][0]
            ]
            frame = f.read(name)
            assert frame[:4] == b"\x28\xb5\x2f\xfd"
            x = np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), np.uint8)
            assert (x ^ np.frombuffer(base[name][2], np.uint8)).tobytes() == new[name][2]


def test_written_full_matches_the_readme_layout(chain) -> None:
    base_dir, _, base, _ = chain
    index = json.loads((base_dir / INDEX_NAME).read_text())
    assert index["metadata"]["checksum_format"] == "adler32"
    assert index["metadata"]["total_size"] == sum(len(t[2]) for t in base.values())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for shard in shards:
        header = raw_header(base_dir / shard)
        metadata = header.pop("__metadata__")
        assert metadata.pop("format") == "pt"
        assert metadata == {n: format(zlib.adler32(base[n][2], 1), "08x") for n in header}


def test_plain_hugging_face_checkpoint_serves_as_base(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A checkpoint without checksums (as save_pretrained writes it) is a valid base."""
    base = bf16_model(rng, {"a": (32, 32), "b": (16,)})
    new = sparse_update(rng, base, fraction=0.05)
    plain = tmp_path / "hf"
    plain.mkdir()
    write_file(
        plain / "model-00001-of-00001.safetensors",
        [(n, *t) for n, t in base.items()],
        {"format": "pt"},
    )
    weight_map = dict.fromkeys(base, "model-00001-of-00001.safetensors")
    (plain / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": 2080}, "weight_map": weight_map})
    )
    (plain / "config.json").write_text("{}")
    report = inspect(plain)
    assert report["checksums_verified"] is False and report["warnings"]
    write_delta(plain, new, tmp_path / "d", "v2", "initial")
    apply_delta(plain, tmp_path / "d", tmp_path / "v2")
    assert same(load_tensors(tmp_path / "v2"), new)
    assert inspect(tmp_path / "v2")["checksums_verified"] is True


def test_shard_writer_spans_many_buffers_and_reads_back(tmp_path: Path) -> None:
    """Tensors larger than the aligned write buffer, written in odd pieces (the write-behind swaps
    buffers mid-piece), in whole (copy) and through region/advance (a decoder), read back whole."""
    from astra.weights.checksum import adler32_hex
    from astra.weights.safetensors_io import SafetensorsFile
    from astra.weights.tensor_files import (
        ALIGN,
        BUFFER_BYTES,
        ShardWriter,
        read_range,
        tensor_header,
    )

    data = np.random.default_rng(7).integers(0, 256, 2 * BUFFER_BYTES + 12345, dtype=np.uint8)
    raw = data.tobytes()
    for how in ("write", "region"):
        head = tensor_header("t", "U8", [len(raw)], len(raw), adler32_hex(raw), align=ALIGN)
        path = tmp_path / f"{how}.safetensors"
        writer = ShardWriter(path, head, len(raw))
        pos, step = 0, 1_000_003
        while pos < len(raw):
            if how == "write":
                writer.write(raw[pos : pos + step])
                pos += min(step, len(raw) - pos)
            else:
                region = writer.region(step)
                n = len(region)
                region[:] = raw[pos : pos + n]
                region.release()
                writer.advance(n)
                pos += n
        writer.close(durable=True)
        with SafetensorsFile(path) as f:
            assert f.read("t") == raw and f.metadata["t"] == adler32_hex(raw)
            start = f.data_start
        assert start % ALIGN == 0
        assert b"".join(bytes(p) for p in read_range(path, start, len(raw))) == raw


def test_read_ahead_never_overwrites_the_current_or_the_previous_piece(tmp_path: Path) -> None:
    import time

    from astra.weights.tensor_files import BUFFER_BYTES, read_range

    data = np.random.default_rng(3).integers(0, 256, size=4 * BUFFER_BYTES + 4096, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    pieces = read_range(path, 0, data.size)
    held, pos = [], 0
    for piece in pieces:
        time.sleep(0.05)  # the read-ahead of the next piece lands meanwhile
        held = [*held[-1:], (pos, piece[:])]  # a stitching caller holds a view of the previous
        for start, view in held:
            assert bytes(view[:64]) == data[start : start + 64].tobytes()
            assert bytes(view[-64:]) == data[start + len(view) - 64 : start + len(view)].tobytes()
        pos += len(piece)
    assert pos == data.size
