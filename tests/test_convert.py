"""Validation of trajectories arriving from a RaaS, and the batch wire path."""

from __future__ import annotations

import math

import numpy as np
import pytest

from astra.common.arrays import from_array, to_array
from astra.common.group_convert import incoming_group
from astra.common.v1 import rollout_pb2
from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.servers.dataflow_batch import trajectories_blob


def sequence(
    n=6, policy="policy", versions=(3, 4), finish=rollout_pb2.FINISH_REASON_STOP, **over
) -> rollout_pb2.Sequence:
    wv = np.full(n, -1, dtype=np.int64)
    wv[2:] = np.linspace(versions[0], versions[1], n - 2).astype(np.int64)
    arrays = {
        "token_ids": np.arange(n, dtype=np.int32),
        "logprobs": -np.ones(n, dtype=np.float32),
        "loss_mask": (np.arange(n) >= 2).astype(np.uint8),
        "weight_versions": wv,
    }
    arrays.update(over)
    return rollout_pb2.Sequence(
        policy_id=policy,
        prompt_length=2,
        finish_reason=finish,
        **{k: to_array(v) for k, v in arrays.items()},
    )


def result(*trajectories) -> rollout_pb2.GroupResult:
    return rollout_pb2.GroupResult(group_id="s/0/1", trajectories=list(trajectories))


def test_valid_group_facts():
    t = rollout_pb2.Trajectory(
        trajectory_id="s/0/1/0", group_id="s/0/1", reward=1.0, sequences=[sequence()]
    )
    g = incoming_group(result(t), "raas")
    assert g.invalid is None and g.error is None
    (rec,) = g.per_policy["policy"]
    assert (rec.min_version, rec.max_version, rec.num_tokens) == (3, 4, 6)
    assert rollout_pb2.Trajectory.FromString(rec.payload) == t


@pytest.mark.parametrize(
    "finish", [rollout_pb2.FINISH_REASON_UNSPECIFIED, rollout_pb2.FINISH_REASON_ERROR]
)
def test_a_sequence_unspecified_or_in_error_fails_its_trajectory(finish) -> None:
    """As the FinishReason enum says: UNSPECIFIED is ERROR, and neither is ever trained."""
    good = rollout_pb2.Trajectory(sample_index=0, reward=1.0, sequences=[sequence()])
    bad = rollout_pb2.Trajectory(sample_index=1, reward=1.0, sequences=[sequence(finish=finish)])
    g = incoming_group(result(good, bad), "raas")
    assert g.invalid is None and g.error is None
    assert [r.failed for r in g.per_policy["policy"]] == [False, True]
    aborted = sequence(finish=rollout_pb2.FINISH_REASON_ABORTED)
    kept = incoming_group(result(rollout_pb2.Trajectory(reward=1, sequences=[aborted])), "r")
    assert [r.failed for r in kept.per_policy["policy"]] == [False]


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (
            lambda: rollout_pb2.Trajectory(reward=math.nan, sequences=[sequence()]),
            "trajectories[0].reward",
        ),
        (
            lambda: rollout_pb2.Trajectory(
                reward=1, agent_rewards={"a": math.inf}, sequences=[sequence()]
            ),
            "agent_rewards[a]",
        ),
        (lambda: rollout_pb2.Trajectory(reward=1), "sequences: empty"),
        (
            lambda: rollout_pb2.Trajectory(
                reward=1, sequences=[sequence(logprobs=-np.ones(5, dtype=np.float32))]
            ),
            "sequences[0].logprobs: length 5",
        ),
        (
            lambda: rollout_pb2.Trajectory(
                reward=1, sequences=[sequence(logprobs=np.array([np.nan] * 6, dtype=np.float32))]
            ),
            "logprobs: not finite",
        ),
        (
            lambda: rollout_pb2.Trajectory(
                reward=1, sequences=[sequence(token_ids=np.arange(6, dtype=np.float32))]
            ),
            "token_ids.dtype",
        ),
        (
            lambda: rollout_pb2.Trajectory(reward=1, sequences=[sequence(policy="")]),
            "policy_id: empty",
        ),
    ],
)
def test_malformed_trajectories_are_rejected_naming_the_field(make, field):
    g = incoming_group(result(make()), "raas")
    assert g.invalid is not None and field in g.invalid, g.invalid
    assert g.per_policy == {}


def test_array_byte_length_must_match_shape():
    arr = to_array(np.arange(4, dtype=np.int32))
    arr.data = arr.data[:-1]
    with pytest.raises(ValueError, match="15 bytes, expected 16"):
        from_array(arr, "x")


def test_multi_policy_episode_is_split_per_policy():
    solver = sequence(policy="solver", versions=(2, 2))
    verifier = sequence(policy="verifier", versions=(7, 7))
    solver.reward, verifier.reward = 1.0, 0.5
    t = rollout_pb2.Trajectory(
        trajectory_id="s/0/1/0",
        reward=1.0,
        agent_rewards={"solver": 1.0, "verifier": 0.5},
        sequences=[solver, verifier],
    )
    g = incoming_group(result(t), "raas")
    assert set(g.per_policy) == {"solver", "verifier"}
    solver = rollout_pb2.Trajectory.FromString(g.per_policy["solver"][0].payload)
    assert [s.policy_id for s in solver.sequences] == ["solver"]
    assert g.per_policy["verifier"][0].reward == 0.5
    assert g.per_policy["verifier"][0].min_version == 7


def test_failed_trajectory_is_kept_as_failed():
    t = rollout_pb2.Trajectory(trajectory_id="s/0/1/0", sequences=[sequence()])
    t.error.code = 13
    t.error.message = "reward raised"
    g = incoming_group(result(t), "raas")
    assert g.per_policy["policy"][0].failed


def test_trajectories_blob_sets_advantages_without_decoding():
    ts = [
        rollout_pb2.Trajectory(
            trajectory_id=f"t{i}", reward=i, advantage=99.0, sequences=[sequence()]
        )
        for i in range(3)
    ]
    blob = trajectories_blob([(t.SerializeToString(), -0.5 + i) for i, t in enumerate(ts)])
    out = pb.BatchTrajectories.FromString(blob).trajectories
    assert [t.trajectory_id for t in out] == ["t0", "t1", "t2"]
    assert [t.advantage for t in out] == [-0.5, 0.5, 1.5]
    assert out[1].sequences[0] == ts[1].sequences[0]


def test_received_bytes_are_kept_as_the_payload():
    ts = [
        rollout_pb2.Trajectory(trajectory_id=f"s/0/1/{i}", reward=i, sequences=[sequence()])
        for i in range(3)
    ]
    res = rollout_pb2.GroupResult(group_id="s/0/1", trajectories=ts, instance_id="r")
    raw = res.SerializeToString()
    g = incoming_group(rollout_pb2.GroupResult.FromString(raw), "r", raw)
    payloads = [t.payload for t in g.per_policy["policy"]]
    assert payloads == [t.SerializeToString() for t in ts]
    assert all(p in raw for p in payloads)


def test_version_ranges_of_a_whole_group_match_per_sequence_checks():
    """The group-wide numpy pass gives each trajectory the same facts as a scalar check."""
    specs = [
        dict(n=6, versions=(3, 4)),
        dict(n=6, weight_versions=np.full(6, -1, dtype=np.int64)),  # nothing generated
        dict(n=6, weight_versions=np.array([-1, -1, 5, 2, 9, -3], dtype=np.int32)),
        dict(n=3, versions=(7, 7)),
    ]
    ts = [
        rollout_pb2.Trajectory(trajectory_id=f"t{i}", reward=1.0, sequences=[sequence(**kw)])
        for i, kw in enumerate(specs)
    ]
    empty = rollout_pb2.Sequence(
        policy_id="policy",
        token_ids=to_array(np.zeros(0, dtype=np.int32)),
        logprobs=to_array(np.zeros(0, dtype=np.float32)),
        loss_mask=to_array(np.zeros(0, dtype=np.uint8)),
        weight_versions=to_array(np.zeros(0, dtype=np.int64)),
    )
    ts.append(rollout_pb2.Trajectory(trajectory_id="t4", reward=1.0, sequences=[empty]))
    g = incoming_group(result(*ts), "raas")
    assert g.invalid is None, g.invalid
    facts = [(r.min_version, r.max_version, r.num_tokens) for r in g.per_policy["policy"]]
    assert facts == [(3, 4, 6), (-1, -1, 6), (2, 9, 6), (7, 7, 3), (-1, -1, 0)]


def test_non_finite_logprobs_are_named_in_a_group_of_several():
    bad = -np.ones(6, dtype=np.float32)
    bad[4] = np.inf
    ts = [
        rollout_pb2.Trajectory(reward=1.0, sequences=[sequence()]),
        rollout_pb2.Trajectory(reward=1.0, sequences=[sequence(), sequence(logprobs=bad)]),
    ]
    g = incoming_group(result(*ts), "raas")
    assert g.invalid == "result.trajectories[1].sequences[1].logprobs: not finite"


def test_finite_logprobs_whose_sum_overflows_are_accepted_and_nan_is_not():
    """Finiteness is of each log-prob, not of an aggregate that overflows: huge finite values
    pass; a NaN is named."""
    huge = np.full(6, -3e38, dtype=np.float32)
    ts = [rollout_pb2.Trajectory(reward=1.0, sequences=[sequence(logprobs=huge)])] * 2
    g = incoming_group(result(*ts), "raas")
    assert g.invalid is None, g.invalid
    nan = -np.ones(6, dtype=np.float32)
    nan[0] = np.nan
    ts = [*ts, rollout_pb2.Trajectory(reward=1.0, sequences=[sequence(logprobs=nan)])]
    g = incoming_group(result(*ts), "raas")
    assert g.invalid == "result.trajectories[2].sequences[0].logprobs: not finite"


def test_version_ranges_of_int32_versions_only():
    """Versions sent as int32 in every sequence (no int64 to widen them to) give the same
    ranges, negative versions (prompt tokens) left out."""
    specs = [np.array([-1, -1, 5, 2, 9, -3], np.int32), np.full(6, -1, np.int32)]
    ts = [
        rollout_pb2.Trajectory(reward=1.0, sequences=[sequence(weight_versions=v)]) for v in specs
    ]
    g = incoming_group(result(*ts), "raas")
    assert g.invalid is None, g.invalid
    facts = [(r.min_version, r.max_version) for r in g.per_policy["policy"]]
    assert facts == [(2, 9), (-1, -1)]


@pytest.mark.parametrize(("bad_id", "named"), [(64, 64), (-1, -1), (10**6, 10**6)])
def test_token_ids_outside_the_policys_vocabulary_are_refused_at_ingest(bad_id, named):
    """The trainer cannot embed an id past its vocabulary: it refused every batch holding one.
    Now the group is malformed at ingest, naming the id and the bound."""
    ids = np.arange(6, dtype=np.int64)
    ids[3] = bad_id
    ts = [
        rollout_pb2.Trajectory(reward=1.0, sequences=[sequence()]),
        rollout_pb2.Trajectory(reward=1.0, sequences=[sequence(token_ids=ids)]),
    ]
    g = incoming_group(result(*ts), "raas", vocab={"policy": 64})
    assert g.invalid == (
        f"result.trajectories[1].sequences[0].token_ids: id {named} is outside the vocabulary "
        "of policy policy (0..63)"
    )
    assert incoming_group(result(*ts), "raas").invalid is None  # no bound given: not checked
    assert incoming_group(result(*ts), "raas", vocab={"other": 64}).invalid is None
    ok = incoming_group(result(ts[0]), "raas", vocab={"policy": 6})  # ids 0..5: inside
    assert ok.invalid is None


def test_astra_run_tells_dataflow_each_policys_vocabulary(tmp_path) -> None:
    from astra.engine.tiny import TINY_CONFIG
    from astra.run.layout import RunDir, dataflow_config, vocab_size
    from astra.run.recipe import load_recipe

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 151936}')
    assert vocab_size(str(model)) == 151936 and vocab_size("tiny") == TINY_CONFIG["vocab_size"]
    assert vocab_size(str(tmp_path / "nothing")) is None
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = dataflow_config(load_recipe(None, []), RunDir(tmp_path / "run"), data)
    assert [p.vocab_size for p in cfg.policies] == [TINY_CONFIG["vocab_size"]]


def test_a_dataflow_told_the_vocabulary_counts_out_of_vocabulary_groups_malformed(
    tmp_path, dataset
) -> None:
    """A real Dataflow with policies[0].vocab_size 2 and a scripted RaaS (ids up to 32,000):
    every group is refused at ingest as malformed, none is buffered."""
    import asyncio

    from astra.raas.scripted import ScriptedGenerator
    from astra.servers.raas_serve import start_raas
    from tests.conftest import make_config, running_dataflow

    config = make_config(dataset, tmp_path / "df", grace_s=0.1)
    config.policies[0].vocab_size = 2

    async def body() -> dict:
        async with running_dataflow(config) as (df_server, _, client):
            server, _, registrar = await start_raas(
                ScriptedGenerator(delay_s=0.01), capacity=4,
                dataflow_address=df_server.address, instance_id="raas", grace_s=0.1,
            )  # fmt: skip
            try:
                for _ in range(200):
                    status = await client.get_status()
                    if dict(status.counters).get("malformed_results", 0) >= 2:
                        break
                    await asyncio.sleep(0.05)
                (policy,) = status.policies
                assert policy.buffered_groups == 0
                return dict(status.counters)
            finally:
                await registrar.stop()
                await server.stop(0)

    counters = asyncio.run(asyncio.wait_for(body(), 60))
    assert counters["malformed_results"] >= 2 and counters.get("completed_groups", 0) == 0
