"""A receiver's small tensors: held in RAM once verified, written at install as one shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astra.errors import DataLoss
from astra.weights.checksum import adler32_hex
from astra.weights.layout import Version
from astra.weights.local import LocalVersions
from astra.weights.receive_stage import MANIFEST, PACKED, FetchStage
from tests.test_weights_store import bf16_model, same


def header(name: str, data: bytes, shape: tuple[int, ...]) -> dict:
    return {
        "name": name,
        "dtype": "BF16",
        "shape": list(shape),
        "size_bytes": len(data),
        "encoded_size_bytes": len(data),
        "encoding": "raw",
        "adler32": adler32_hex(data),
    }


def receive(stage: FetchStage, name: str, tensor: tuple) -> None:
    _, shape, data = tensor
    incoming = stage.receive(header(name, data, shape), None)
    half = len(data) // 2
    for offset, piece in ((0, data[:half]), (half, data[half:])):
        incoming.queue(offset, len(piece))
        incoming.write(offset, piece)
    incoming.finish()


def manifest(stage: FetchStage) -> list[str]:
    path = stage.path / MANIFEST
    if not path.exists():
        return []
    return [json.loads(line)["name"] for line in path.read_text().splitlines()]


def test_small_tensors_up_to_the_bound_are_packed_and_the_rest_staged_in_files(
    tmp_path: Path,
) -> None:
    model = bf16_model(3, n=4, size=1 << 12)  # 4 tensors of 8 KiB
    local = LocalVersions(tmp_path / "rx", durable=True)
    stage = FetchStage(tmp_path / "rx" / "staging" / "v0", "v0", ram_bytes=2 * 8192)
    for name in sorted(model):
        receive(stage, name, model[name])
    names = sorted(model)
    assert sorted(stage.in_ram) == names[:2], "RAM holds what the bound has room for"
    assert manifest(stage) == names[2:], "the rest is staged in files (and survives a kill)"
    assert stage.acknowledged == names[2:], "a later attempt would receive the small ones again"

    installed = local.install(stage, None, len(model))
    assert same(installed, model)
    with Version(installed) as v:
        packed = {n for n, e in v.entries.items() if len(e.shard.tensors) == 2}
        assert packed == set(names[:2])
        assert all(v.entries[n].checksum == adler32_hex(model[n][2]) for n in names)
    assert not (tmp_path / "rx" / "staging" / "v0" / PACKED).exists(), "the stage goes"


def test_a_small_tensor_that_fails_its_checksum_is_refused_and_gives_its_room_back(
    tmp_path: Path,
) -> None:
    _, shape, data = bf16_model(4, n=1, size=1 << 12)["layers.0.w"]
    stage = FetchStage(tmp_path / "stage", "v0", ram_bytes=8192)
    bad = header("layers.0.w", data, shape)
    bad["adler32"] = adler32_hex(data[:-1] + bytes([data[-1] ^ 1]))
    incoming = stage.receive(bad, None)
    incoming.queue(0, len(data))
    incoming.write(0, data)
    with pytest.raises(DataLoss):
        incoming.finish()
    assert not stage.in_ram
    receive(stage, "layers.0.w", ("BF16", shape, data))  # the room is free again
    assert list(stage.in_ram) == ["layers.0.w"]


def test_an_incomplete_fetch_is_refused_whatever_sits_in_ram(tmp_path: Path) -> None:
    model = bf16_model(5, n=3, size=1 << 12)
    local = LocalVersions(tmp_path / "rx", durable=False)
    stage = local.stage("v0")
    for name in sorted(model)[:2]:
        receive(stage, name, model[name])
    with pytest.raises(DataLoss) as info:
        local.install(stage, None, len(model))
    assert info.value.reason == "INCOMPLETE_FETCH"
