"""A run whose every RaaS refuses the groups it is sent ends as failed, naming the refusal,
instead of waiting forever for batches (supervision.max_refused_in_a_row). The case: the
reward's package is on the supervisor's PYTHONPATH (so the start-up check passes) but not on
the RaaS's machine, which answers each submit INVALID_ARGUMENT "unknown reward"."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import yaml

from astra.run.observe import Observer, refusal

RAAS = (
    "unset PYTHONPATH; exec {python} -m astra.cli serve raas --dataflow {{dataflow}} "
    "--instance-id {{instance_id}} --capacity {{capacity}} --state-dir {{state_dir}} "
    "--model tiny --port 0"
)


@pytest.mark.slow
def test_a_run_whose_raas_refuse_every_group_fails_naming_the_refusal(runs, tmp_path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my_reward_mod.py").write_text(
        "def score(record, completion, **_):\n    return 1.0\n"
    )
    recipe = {
        "name": "refused",
        "env": {"PYTHONPATH": str(tmp_path / "lib")},
        "warmup": {"steps": 0},
        "streams": [{"reward": "my_reward_mod:score"}],
        "raas": [{"command": ["sh", "-c", RAAS.format(python=sys.executable)]}],
        "supervision": {"max_refused_in_a_row": 5},
    }
    path = tmp_path / "refused.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run = runs(str(path), "--set", "eval.every_steps=0")
    assert run.wait(120) == 1, run.output()
    status = run.summary()["status"]
    assert status.startswith("failed: every RaaS refuses the groups it is sent"), status
    assert "my_reward_mod:score" in status and "max_refused_in_a_row: 5" in status
    assert run.summary()["steps"] == 0


def _detail(*instances: dict) -> dict:
    return {"instances": list(instances)}


def test_refused_needs_every_active_raas_past_the_bound() -> None:
    asyncio.run(_refused_needs_every_active_raas_past_the_bound())


async def _refused_needs_every_active_raas_past_the_bound() -> None:
    obs = Observer(
        "127.0.0.1:1", {}, {}, Path("/dev/null"), num_steps=1, max_refused_in_a_row=3, live=False
    )
    a = {"id": "a", "state": "ACTIVE", "refused_in_a_row": 3, "last_refusal": "unknown reward"}
    b = {"id": "b", "state": "ACTIVE", "refused_in_a_row": 1, "last_refusal": "unknown reward"}
    obs.last_detail = _detail(a, b)
    assert obs.refused() is None  # b accepted one lately: it may still serve
    obs.last_detail = _detail(a, {**b, "refused_in_a_row": 4})
    assert "the newest: a: unknown reward" in (obs.refused() or "")
    obs.last_detail = _detail(a, {**b, "state": "SUSPECT"})
    assert obs.refused() is not None  # only the active ones count
    assert refusal(_detail({**a, "refused_in_a_row": 0})) == ""
    obs.max_refused_in_a_row = 0
    assert obs.refused() is None
    await obs.close()
