"""End to end, real processes: Dataflow SIGKILLed with its whole epoch buffered, a byte of
one stored group flipped on disk, Dataflow restarted on the damaged log. The record is
quarantined and counted, its group generated again, and every group of the epoch reaches
the trainer exactly once, as Dataflow's own database records. Then a sealed value changed
on disk: the next start is refused with one line naming the file, exit 65."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest
import yaml

from astra.damage import EXIT_DAMAGED
from astra.dataflow.store_schema import batch_groups
from tests.conftest import free_port
from tests.procs import start_dataflow, start_scripted_raas
from tests.test_at_rest_dataflow import flip
from tests.test_faults import (
    NUM_PROMPTS,
    Trainer,
    assert_exactly_once,
    big_dataset,  # noqa: F401 (fixture)
    fault_config,
    run_then_close,
)

pytestmark = pytest.mark.slow


def acked_group_ids(db_path) -> list[str]:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT batch_id, policy_id, policy_version, groups FROM batches WHERE state = 'acked'"
        ).fetchall()
    finally:
        db.close()
    return [entry[0] for row in rows for entry in batch_groups(*row) if not entry[1]]


def test_a_corrupt_record_is_regenerated_and_trained_once_across_a_restart(
    big_dataset,  # noqa: F811
    tmp_path,
):
    config = fault_config(big_dataset, tmp_path, port=free_port())
    state = tmp_path / "state"
    db_path = state / "dataflow.sqlite"
    df = start_dataflow(config, tmp_path, "dataflow-a")
    raas = start_scripted_raas(df.address, tmp_path, "raas-0", "--delay", "0.05")
    procs = [raas, df]
    victim: dict = {}

    async def body():
        nonlocal df
        async with Trainer(df.address) as trainer:
            await trainer.wait_status(
                lambda s: s.policies[0].buffered_groups == NUM_PROMPTS, 60, 0.2
            )
            df.kill()
            db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
            gid, seg, off, length = db.execute(
                "SELECT group_id, seg, off, len FROM groups ORDER BY seq LIMIT 1 OFFSET 5"
            ).fetchone()
            db.close()
            flip(state / "blobs" / f"{seg:08d}.seg", off + length // 2)
            victim.update(gid=gid)
            df = start_dataflow(config, tmp_path, "dataflow-b")
            procs.append(df)
            status = await trainer.client.get_status()
            assert status.counters["records_corrupt"] == 1
            assert status.counters["records_corrupt_redispatched"] == 1
            assert status.policies[0].buffered_groups == NUM_PROMPTS - 1
            await trainer.run_until(NUM_PROMPTS, 60)
        df.signal(2)
        df.wait(20)
        return trainer.consumed

    consumed = run_then_close(body(), procs)
    assert_exactly_once(consumed)
    trained = acked_group_ids(db_path)
    assert sorted(trained) == sorted(set(trained)) and len(trained) == NUM_PROMPTS
    log = (tmp_path / "dataflow-b.log").read_text()
    assert "corrupt record quarantined" in log and victim["gid"] in log

    # A sealed value changed on disk: refused at start, one line, no traceback.
    db = sqlite3.connect(db_path)
    (stored,) = db.execute("SELECT value FROM kv WHERE key='dataset/s'").fetchone()
    db.execute(
        "UPDATE kv SET value=? WHERE key='dataset/s'", (stored.replace('"epoch": 1', '"epoch": 0'),)
    )
    db.commit()
    db.close()
    path = tmp_path / "dataflow-c.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    cmd = [sys.executable, "-m", "astra.cli", "serve", "dataflow", "--config", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_DAMAGED, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "damaged state" in x]
    assert str(db_path) in line and "'dataset/s' fails its checksum" in line
