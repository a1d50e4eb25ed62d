"""tools/bench/floor_grpc.py through the control-plane benchmark, in a tiny configuration: its
processes start, groups move end to end and parse as GroupResults, and the report reads it."""

from __future__ import annotations

import pytest

from tests.conftest import bench_module

TINY = [
    "--raas", "2", "--procs", "1", "--capacity", "16", "--group-size", "4", "--tokens", "8",
    "--batch-groups", "2", "--buffer-groups", "64", "--prompts", "32", "--warmup", "0.5",
    "--window", "1.5", "--lat-warmup", "0.3", "--lat-window", "0.8", "--pace", "200",
    "--no-write",
]  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    with bench_module("control_plane.py", "bench_control_plane") as module:
        yield module


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_floor_moves_groups_the_trainer_parses(bench, tmp_path):
    p = bench.parse_args(TINY)
    bench.write_dataset(tmp_path / "prompts.jsonl", p.prompts)
    floor = bench.run_baseline(p, tmp_path, "floor")
    assert floor["fetch_errors"] == 0
    assert floor["traj_tokens"] == 8 + 8  # prompt + generated, parsed from the GroupResult
    assert floor["traj_bytes"] > 8 * (4 + 4 + 1 + 8)  # the four arrays' bytes at least
    c = floor["counters"]
    assert c["completed_groups"] > p.batch_groups
    assert c["consumed_groups"] == c["batches_served"] * p.batch_groups
    assert (
        c["consumed_groups"] + c["evicted_groups"] + c["buffered_groups"] == (c["completed_groups"])
    )
    assert set(floor["cpu_by_process_s"]) == {"coordinator", "endpoints0", "trainer"}

    text = bench.floor_observation(floor, floor, floor)
    assert "reached 1.00x the baseline" in text and "3x is above" in text
