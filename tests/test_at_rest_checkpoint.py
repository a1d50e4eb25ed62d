"""Trainer checkpoints at rest: a byte changed in a real checkpoint written by a real
Trainer is refused with the tensor's name and the file, and the resume takes the previous
good checkpoint; with none good, `astra serve trainer` exits with one line naming the
directory."""

from __future__ import annotations

import logging
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from astra.damage import EXIT_DAMAGED, Damaged
from astra.run.layout import checkpoint_step
from astra.trainer.checkpoint import list_checkpoints
from astra.trainer.ckpt_verify import newest_good, verify
from astra.trainer.synthetic import MemorySink, SyntheticSource
from astra.weights.safetensors_io import SafetensorsFile
from tests.test_trainer_loop import _run, config


def two_checkpoints(root: Path) -> list[Path]:
    cfg = config(checkpoint={"dir": str(root), "every_steps": 1, "keep_last": 3})
    t, _ = _run(cfg, 2, SyntheticSource("p", vocab_size=100, max_lag=1), MemorySink())
    t.close()
    found = list_checkpoints(root)
    assert [p.name for p in found] == ["step-000000001", "step-000000002"]
    return found


def poison_a_weight(ckpt: Path) -> tuple[Path, str]:
    """Writes 2.5e37 over the first float of an F32 tensor of the checkpoint's model."""
    for shard in sorted((ckpt / "model").glob("*.safetensors")):
        with SafetensorsFile(shard) as f:
            found = next((i for i in f.tensors.values() if i.dtype == "F32"), None)
            start = f.data_start
        if found is not None:
            with open(shard, "r+b") as out:
                out.seek(start + found.begin)
                out.write(struct.pack("<f", 2.5e37))
            return shard, found.name
    raise AssertionError("no F32 tensor")


def test_a_poisoned_weight_is_refused_by_name_and_the_previous_checkpoint_resumed(tmp_path, caplog):
    _first, second = two_checkpoints(tmp_path / "ck")
    verify(second)  # as written, it verifies
    shard, tensor = poison_a_weight(second)
    with pytest.raises(Damaged) as info:
        verify(second)
    assert info.value.path == str(shard) and repr(tensor) in info.value.what
    cfg = config(checkpoint={"dir": str(tmp_path / "ck"), "resume": True, "every_steps": 1})
    with caplog.at_level(logging.ERROR, "astra.trainer"):
        t, _ = _run(cfg, 1, SyntheticSource("p", vocab_size=100, max_lag=1), MemorySink())
    try:
        assert t.step == 2  # resumed at step 1, then one step
        assert t.counters["checkpoints_refused"] == 1
        stats = t.get_statistics()
        assert len(stats["refused_checkpoints"]) == 1 and tensor in stats["refused_checkpoints"][0]
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "checkpoint refused" in logged and str(shard) in logged
    finally:
        t.close()
    assert checkpoint_step(tmp_path / "ck") == 2  # the step just written replaced it


def test_a_changed_optimizer_file_is_refused_and_the_supervisor_counts_from_the_good_one(
    tmp_path,
):
    first, second = two_checkpoints(tmp_path / "ck")
    raw = bytearray((second / "optimizer.pt").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (second / "optimizer.pt").write_bytes(bytes(raw))
    with pytest.raises(Damaged, match=r"optimizer\.pt: SHA-256 differs"):
        verify(second)
    assert newest_good(tmp_path / "ck") == first
    assert checkpoint_step(tmp_path / "ck") == 1


@pytest.mark.slow
def test_with_every_checkpoint_damaged_the_trainer_exits_with_one_line(tmp_path):
    root = tmp_path / "ck"
    for ckpt in two_checkpoints(root):
        (ckpt / "trainer.json").write_text('{"step": ')  # torn
    cmd = [sys.executable, "-m", "astra.trainer", "--checkpoint-dir", str(root), "--resume"]
    cmd += ["--policy", "p", "--port", "0", "--num-steps", "1", "--log-level", "warning"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_DAMAGED, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if "damaged state" in x]
    assert lines == [lines[0]] and str(root) in lines[0] and "all 2 checkpoints" in lines[0]
    assert "Traceback" not in proc.stderr
