"""`astra doctor RUN_DIR`: a run directory written by the real services' code, checked
offline; every damaged item named with its path, exit 1; all sound, exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from astra.weights.store import Store, StoreConfig
from tests.test_at_rest_checkpoint import poison_a_weight, two_checkpoints
from tests.test_at_rest_dataflow import buffered, flip, record_of
from tests.test_dataflow_recovery import crash, make_config, new_dataflow, run
from tests.test_weights_store import chain_of


def doctor(run_dir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "astra.cli", "doctor", str(run_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def make_run_dir(tmp_path: Path):
    rd = tmp_path / "run"
    cfg = make_config(tmp_path, n_prompts=4, state_dir=str(rd / "state" / "dataflow"))

    async def body():
        df = new_dataflow(cfg)
        gids = await buffered(df, 3)
        crash(df)
        df.store.close()
        return gids

    gids = run(body())
    two_checkpoints(rd / "checkpoints" / "p")
    store = Store(rd / "state" / "weights", StoreConfig(durable=False))
    for i, m in enumerate(chain_of(2)):
        # Each version's own config.json: an unchanged file is one inode shared by the versions
        # (astra.weights.store_cache.put_files), and this test damages one version's.
        store.publish("p", f"v{i}", i, m, files={"config.json": f'{{"v": {i}}}'.encode()})
    return rd, cfg, gids


def test_doctor_says_ok_for_a_sound_run_dir_and_names_each_damaged_item(tmp_path):
    rd, cfg, gids = make_run_dir(tmp_path)
    sound = doctor(rd)
    assert sound.returncode == 0, sound.stdout + sound.stderr
    lines = sound.stdout.splitlines()
    assert lines[0].split()[:3] == ["STATUS", "ITEM", "PATH"]
    assert all(x.startswith("OK") for x in lines[1:]) and len(lines) == 1 + 1 + 1 + 2 + 2
    assert "dataflow blob records (3 sound)" in sound.stdout

    seg, off, length = record_of(cfg, gids[0])
    flip(seg, off + length - 1)
    ckpt = sorted((rd / "checkpoints" / "p").iterdir())[-1]
    shard, tensor = poison_a_weight(ckpt)
    version = next((rd / "state" / "weights").glob("policies/p/versions/v1"))
    config = next(version.rglob("config.json"))
    config.write_bytes(b"{ }")
    bad = doctor(rd)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    damaged = [x for x in bad.stdout.splitlines() if x.startswith("DAMAGED")]
    assert len(damaged) == 3, bad.stdout
    blob, weight, stored = damaged
    assert str(seg) in blob and f"offset {off}" in blob and "CRC-32" in blob
    assert str(shard) in weight and tensor in weight
    assert str(config) in stored and "SHA-256" in stored


def test_doctor_reports_a_damaged_database_without_a_traceback(tmp_path):
    rd, _cfg, _ = make_run_dir(tmp_path)
    db = rd / "state" / "dataflow" / "dataflow.sqlite"
    raw = bytearray(db.read_bytes())
    for k in range(4096 + 8, 8192 - 8, 7):
        raw[k] ^= 0x5A
    db.write_bytes(bytes(raw))
    out = doctor(rd)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("DAMAGED")]
    assert "dataflow database" in line and str(db) in line
