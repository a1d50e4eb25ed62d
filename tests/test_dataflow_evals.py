"""Evaluation streams (astra.dataflow.evals): a held-out dataset run at every N-th version, scored,
never trained on, durable across a Dataflow restart. Real in-process gRPC servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astra.dataflow.config import DataflowConfig
from astra.dataflow.evals import EvalDesk
from astra.dataflow.records import TrajectoryRecord
from astra.raas.scripted import ScriptedGenerator
from tests.conftest import make_config, running_dataflow
from tests.test_dataflow_invariants import Trainer, run, until, with_raas

EVAL_RECORDS = 6


def traj(reward: float, lo: int, hi: int, failed: bool = False) -> TrajectoryRecord:
    return TrajectoryRecord("t", reward, lo, hi, 4, failed=failed)


def test_desk_schedules_one_evaluation_at_a_time_and_skips_what_it_passed() -> None:
    desk = EvalDesk({"e": 2, "train": 0}, {"e": ["p"], "train": ["p"]})
    assert desk.is_eval("e") and not desk.is_eval("train")
    assert desk.due("e", 1) == 0
    desk.schedule("e", 0, 2)
    assert desk.floor("e") == 0 and desk.due("e", 9) is None  # v0 still running
    assert desk.take("e", 0, {"p": [traj(1.0, 0, 1), traj(0.0, 1, 1)]}) == "eval:0"
    assert desk.take("e", 0, {"p": [traj(0.0, 0, 0, failed=True), traj(0.0, 2, 2)]}) == "eval:0"
    assert desk.floor("e") is None
    (v0,) = desk.results()
    assert v0["complete"] and v0["groups_done"] == 2 and v0["samples"] == 3
    assert v0["failed_samples"] == 1 and v0["mean_reward"] == pytest.approx(1 / 3)
    assert v0["solved_groups"] == 1 and (v0["min_token_version"], v0["max_token_version"]) == (0, 2)
    assert desk.due("e", 7) == 6  # 2 and 4 were passed over while 0 ran
    desk.schedule("e", 6, 1)
    assert desk.skipped == 2
    copy = EvalDesk({"e": 2}, {"e": ["p"]})
    copy.restore(json.loads(json.dumps(desk.state())))
    assert copy.results() == desk.results() and copy.skipped == 2 and copy.floor("e") == 6


def test_each_policy_of_a_multi_agent_evaluation_is_scored_on_its_own_samples() -> None:
    desk = EvalDesk({"e": 1}, {"e": ["solver", "verifier"]})
    desk.schedule("e", 0, 2)
    desk.take("e", 0, {"solver": [traj(1.0, 0, 0)], "verifier": [traj(0.0, 0, 0)]})
    assert {r["policy_id"]: r["complete"] for r in desk.results()} == {
        "solver": False,
        "verifier": False,
    }
    desk.take("e", 0, {"solver": [traj(1.0, 0, 0)]})  # the verifier produced nothing
    done = {r["policy_id"]: r for r in desk.results()}
    assert done["solver"]["mean_reward"] == 1.0 and done["solver"]["solved_groups"] == 2
    assert done["verifier"]["mean_reward"] == 0.0 and done["verifier"]["samples"] == 1
    assert all(r["complete"] and r["groups_done"] == 2 for r in done.values())
    assert desk.floor("e") is None and desk.due("e", 1) == 1
    # A state from before per-policy tallies (the first policy's only) restores both.
    old = EvalDesk({"e": 1}, {"e": ["solver"]})
    old.schedule("e", 0, 2)
    old.take("e", 0, {"solver": [traj(1.0, 0, 0)]})
    upgraded = EvalDesk({"e": 1}, {"e": ["solver", "verifier"]})
    upgraded.restore(json.loads(json.dumps(old.state())))
    running = {r["policy_id"]: r["groups_done"] for r in upgraded.results()}
    assert running == {"solver": 1, "verifier": 1}
    upgraded.take("e", 0, {"solver": [traj(0.0, 0, 0)], "verifier": [traj(1.0, 0, 0)]})
    assert all(r["complete"] for r in upgraded.results())


def eval_config(tmp_path: Path, dataset: Path) -> DataflowConfig:
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(
        "".join(json.dumps({"prompt": f"{i}*{i}=", "answer": str(i * i)}) + "\n" for i in range(6))
    )
    config = make_config(dataset, tmp_path / "state")
    train = config.streams[0].model_dump()
    train["dataset"]["num_epochs"] = 0
    evaluation = {
        "name": "e",
        "dataset": {"path": str(held_out)},
        "policy_ids": ["policy"],
        "group_size": 2,
        "sampling": {"max_new_tokens": 4, "temperature": 0.0},
        "eval_every_versions": 2,
    }
    return DataflowConfig.model_validate({**config.model_dump(), "streams": [train, evaluation]})


def test_evaluations_run_at_every_second_version_and_are_never_trained(
    tmp_path: Path, dataset: Path
) -> None:
    config = eval_config(tmp_path, dataset)

    async def body() -> list[dict]:
        backend = ScriptedGenerator()
        async with with_raas(config, backend, capacity=16, name="r0") as (df, client, _):
            trainer = Trainer(client)
            for _ in range(6):
                batch = None
                while batch is None:
                    batch = await trainer.fetch(2)
                await trainer.ack(batch)
                await trainer.announce()

            def finished():
                done = [e for e in df.status()["evals"] if e["complete"]]
                return done if done and done[-1]["version"] >= 4 else None

            await until(finished, timeout_s=15, what="the evaluation of version 4 or later")
            status = await client.get_status()
        assert not [g for g in trainer.consumed if g.startswith("e/")], "evaluation trained"
        evals = [e for e in status.evals if e.complete]
        # (later evaluations may finish after the status was read: a prefix)
        later = [e["version"] for e in finished()]
        assert later[: len(evals)] == [e.version for e in evals]
        for e in evals:
            assert e.stream == "e" and e.policy_id == "policy" and e.version % 2 == 0
            assert e.groups == e.groups_done == EVAL_RECORDS
            assert e.samples + e.failed_samples == EVAL_RECORDS * 2
            assert 0.0 <= e.mean_reward <= 1.0 and e.min_token_version >= e.version
        versions = [e.version for e in evals]
        assert versions[0] == 0 and versions == sorted(set(versions))
        # every multiple of 2 up to the newest scheduled was evaluated, is running, or skipped
        newest = max(e.version for e in status.evals)
        skipped = status.counters["evaluations_skipped"]
        assert len(status.evals) + skipped == newest // 2 + 1
        return [dict(e) for e in finished()]

    before = run(body(), timeout_s=60)

    async def reopen() -> list[dict]:
        async with running_dataflow(config) as (_, df, _client):
            return [e for e in df.status()["evals"] if e["complete"]]

    after = run(reopen())
    assert after[: len(before)] == before  # durable: nothing lost or counted again


def test_an_evaluation_takes_half_the_free_slots_before_training(tmp_path: Path) -> None:
    """Evaluation groups take half the free slots first: behind an open gate training groups
    otherwise filled every slot (an evaluation crawled along on leftovers, and the end of a
    run waited for it); with all of them, training stalled at every evaluation."""
    import asyncio

    from tests.test_dataflow_recovery import crash, make_config, new_dataflow, write_prompts

    held_out = write_prompts(tmp_path / "held_out.jsonl", 6)
    train = {
        "name": "s",
        "dataset": {"path": str(write_prompts(tmp_path / "train.jsonl", 64)), "num_epochs": 0},
        "policy_ids": ["p"],
        "group_size": 2,
    }
    evaluation = {
        "name": "e",
        "dataset": {"path": str(held_out)},
        "policy_ids": ["p"],
        "group_size": 2,
        "eval_every_versions": 1,
    }
    cfg = make_config(tmp_path, streams=[train, evaluation])

    async def body() -> None:
        df = new_dataflow(cfg)
        try:
            await df.register("r1", "addr-r1", 8, ["p"], ["single_turn"], {}, {"p": 0})
            await df.dispatcher.round()  # 8 sample slots: the first submission takes 4 groups
            sent = df.pool.instances["r1"].port.submitted
            assert [df.work[g].stream for g in sent[:4]] == ["e", "e", "s", "s"], sent[:4]
        finally:
            crash(df)

    asyncio.run(body())
