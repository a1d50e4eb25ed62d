"""A policy's run of dropped groups (GetStatus `groups_dropped_in_a_row`, `last_drop_reason`):
how `astra run` and an operator tell that no batch can form, and why."""

from __future__ import annotations

import asyncio
import logging

from astra.dataflow.ports import IncomingGroup
from astra.dataflow.status import dataflow_status
from tests.test_dataflow_recovery import crash, leased, make_config, new_dataflow, register, result


def policy_view(df) -> tuple[int, str]:
    (p,) = dataflow_status(df)["policies"]
    return p["groups_dropped_in_a_row"], p["last_drop_reason"]


def test_dropped_groups_in_a_row_are_counted_and_a_kept_one_ends_the_run(tmp_path, caplog):
    cfg = make_config(tmp_path, n_prompts=64, policies=[
        {"id": "p", "batch_groups": 2, "buffer": {"drop_equal_rewards": True}}
    ])  # fmt: skip

    async def body():
        df = new_dataflow(cfg)
        try:
            await register(df, versions={"p": 0})
            await df.dispatcher.round()
            gids = sorted(leased(df))
            assert len(gids) >= 20
            assert policy_view(df) == (0, "")
            equal = [result(g, "r1", 0, rewards=(1.0, 1.0)) for g in gids[:16]]
            with caplog.at_level(logging.WARNING, logger="astra.dataflow"):
                await df.ingest("r1", equal)
            assert policy_view(df) == (16, "filtered_equal_reward")
            # 8 batches of 2 groups: warned once, at 16 (not before)
            warned = [r.getMessage() for r in caplog.records if "all dropped" in r.getMessage()]
            assert len(warned) == 1 and warned[0].startswith(
                "policy p: the last 16 finished groups were all dropped (the newest: "
                "filtered_equal_reward); no batch of 2 forms until one is kept; every sample "
                "of a group scored the same"
            )
            assert "policies.p.buffer.drop_equal_rewards: false" in warned[0]
            # a duplicate delivery neither extends nor ends the run
            await df.ingest("r1", [result(gids[0], "r1", 0, rewards=(1.0, 1.0))])
            assert policy_view(df)[0] == 16
            # a failed group extends it, and says so
            failed = IncomingGroup(gids[16], "r1")
            failed.error = "workflow raised"
            await df.ingest("r1", [failed])
            assert policy_view(df) == (17, "failed")
            # a malformed result (no trajectories, no error) extends it too
            await df.ingest("r1", [IncomingGroup(gids[19], "r1")])
            assert policy_view(df) == (18, "malformed")
            # one group kept ends it
            await df.ingest("r1", [result(gids[17], "r1", 0, rewards=(0.0, 1.0))])
            assert policy_view(df) == (0, "malformed")  # the newest drop, kept
            await df.ingest("r1", [result(gids[18], "r1", 0, rewards=(0.0, 0.0))])
            assert policy_view(df) == (1, "filtered_equal_reward")
            await df.ingest("r1", [result(g, "r1", 0, rewards=(1.0, 1.0)) for g in gids[20:23]])
            # kill -9: the run of drops goes on being counted after the restart
            crash(df)
            df = new_dataflow(cfg)
            assert policy_view(df) == (4, "filtered_equal_reward")
        finally:
            crash(df)

    asyncio.run(body())
