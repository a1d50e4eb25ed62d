"""`astra weights inspect|diff|apply`: JSON on stdout, errors on stderr, exit codes 0/1/2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from astra.weights.checkpoint import load_tensors, write_full
from astra.weights.cli import weights
from astra.weights.safetensors_io import SafetensorsFile


@pytest.fixture
def versions(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(7)
    base = {
        f"w{i}": ("BF16", (32, 32), rng.integers(0, 1 << 16, 1024, np.uint16).tobytes())
        for i in range(3)
    }
    new = dict(base)
    changed = np.frombuffer(base["w1"][2], np.uint16).copy()
    changed[::50] ^= 1
    new["w1"] = ("BF16", (32, 32), changed.tobytes())
    write_full(tmp_path / "v1", base, {"model_type": "toy"}, durable=False)
    write_full(tmp_path / "v2", new, {"model_type": "toy"}, durable=False)
    return tmp_path / "v1", tmp_path / "v2"


def run(*args: str | Path):
    return CliRunner().invoke(weights, [str(a) for a in args])


def test_diff_apply_inspect_succeed(tmp_path: Path, versions) -> None:
    v1, v2 = versions
    diff = run("diff", "--base", v1, "--new", v2, "--out", tmp_path / "d", "--version", "s2",
               "--base-version", "s1", "--no-fsync")  # fmt: skip
    assert diff.exit_code == 0, diff.output
    assert json.loads(diff.stdout)["changed_tensor_count"] == 1
    applied = run("apply", "--base", v1, "--delta", tmp_path / "d", "--out", tmp_path / "v2b")
    assert applied.exit_code == 0, applied.output
    assert json.loads(applied.stdout)["version"] == "s2"
    assert load_tensors(tmp_path / "v2b") == load_tensors(v2)
    report = run("inspect", tmp_path / "d")
    assert report.exit_code == 0
    summary = json.loads(report.stdout)
    assert (summary["kind"], summary["base_version"]) == ("delta", "s1")


def test_inspect_takes_a_stores_version_directory(tmp_path: Path, versions) -> None:
    """STORE/policies/P/versions/N holds full/ and delta/: each is described."""
    v1, v2 = versions
    version = tmp_path / "store" / "versions" / "2"
    diff = run("diff", "--base", v1, "--new", v2, "--out", version / "delta", "--no-fsync")
    assert diff.exit_code == 0, diff.output
    shutil.copytree(v2, version / "full")
    report = run("inspect", version)
    assert report.exit_code == 0, report.output
    both = json.loads(report.stdout)
    assert both["full"]["kind"] == "full" and both["delta"]["kind"] == "delta"


def test_diff_defaults_identities_to_directory_names(tmp_path: Path, versions) -> None:
    v1, v2 = versions
    result = run("diff", "--base", v1, "--new", v2, "--out", tmp_path / "d")
    assert result.exit_code == 0, result.output
    assert (json.loads(result.stdout)["version"], json.loads(result.stdout)["base_version"]) == (
        "v2",
        "v1",
    )


def test_checksum_mismatch_exits_1_and_names_tensor(tmp_path: Path, versions) -> None:
    v1, v2 = versions
    assert run("diff", "--base", v1, "--new", v2, "--out", tmp_path / "d").exit_code == 0
    shard = next((tmp_path / "d").glob("*.safetensors"))
    with SafetensorsFile(shard) as f:
        offset = f.data_start + f.tensors["w1"].end - 6
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x01
    shard.write_bytes(bytes(data))
    result = run("apply", "--base", v1, "--delta", tmp_path / "d", "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert result.stdout == ""
    error = json.loads(result.stderr)["error"]
    assert error["tensor"] == "w1" and error["code"] == "DATA_LOSS"
    assert not (tmp_path / "out").exists()


def test_operational_failures_exit_1(tmp_path: Path, versions) -> None:
    v1, _ = versions
    (tmp_path / "empty").mkdir()
    result = run("inspect", tmp_path / "empty")
    assert result.exit_code == 1 and json.loads(result.stderr)["error"]["reason"] == "INDEX_MISSING"
    changed = {"w0": ("F16", (32, 32), bytes(2048)), "w1": ("BF16", (32, 32), bytes(2048))}
    write_full(tmp_path / "retyped", {**changed, "w2": ("BF16", (32, 32), bytes(2048))}, None)
    result = run("diff", "--base", v1, "--new", tmp_path / "retyped", "--out", tmp_path / "d")
    assert result.exit_code == 1 and json.loads(result.stderr)["error"]["tensor"] == "w0"


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "missing-dir"),
        ("apply", "--base", "{v1}"),
        ("apply", "--base", "{v1}", "--delta", "{v2}", "--out", "{v1}"),
        ("diff", "--base", "{v1}", "--new", "{v2}", "--out", "{tmp}/d", "--version", "a/b"),
        ("diff", "--base", "{v1}", "--new", "{v2}", "--out", "{tmp}/d", "--version", "initial"),
        ("diff", "--base", "{v1}", "--new", "{v2}", "--out", "{tmp}/d", "--level", "0"),
        ("bogus",),
    ],
)
def test_bad_arguments_exit_2(tmp_path: Path, versions, args: tuple[str, ...]) -> None:
    v1, v2 = versions
    filled = [a.format(v1=v1, v2=v2, tmp=tmp_path) for a in args]
    result = CliRunner().invoke(weights, filled)
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "d").exists()
