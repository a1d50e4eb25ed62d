"""A RaaS's hand-written GroupResult bytes against the generated classes' (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from google.rpc import code_pb2, status_pb2

from astra.common.v1 import array_pb2, rollout_pb2
from astra.raas.backend import SequenceSpec, TrajectorySpec
from astra.servers.result_wire import group_result_bytes

FINISH = ("stop", "length", "aborted", "error")


def _array(values: np.ndarray) -> array_pb2.NDArray:
    arr = np.ascontiguousarray(values)
    name = {"b": "bool", "u1": "uint8", "i4": "int32", "i8": "int64", "f2": "float16",
            "f4": "float32", "f8": "float64", "i1": "int8", "i2": "int16"}  # fmt: skip
    key = "b" if arr.dtype == np.bool_ else arr.dtype.str[1:]
    return array_pb2.NDArray(
        dtype=name[key],
        shape=list(arr.shape),
        data=arr.astype(arr.dtype.newbyteorder("<")).tobytes(),
    )


def oracle(group_id: str, instance_id: str, trajectories: list[TrajectorySpec]) -> bytes:
    """The GroupResult through the generated classes, as the RaaS built it before."""
    out = rollout_pb2.GroupResult(group_id=group_id, instance_id=instance_id)
    for t in trajectories:
        msg = out.trajectories.add(
            trajectory_id=f"{group_id}/{t.sample_index}",
            group_id=group_id,
            sample_index=t.sample_index,
            reward=t.reward,
            agent_rewards=t.agent_rewards,
        )
        if t.metadata:
            msg.metadata.update(t.metadata)
        if t.error is not None:
            msg.error.CopyFrom(status_pb2.Status(code=code_pb2.INTERNAL, message=t.error))
        for s in t.sequences:
            msg.sequences.add(
                policy_id=s.policy_id,
                agent_id=s.agent_id,
                prompt_length=s.prompt_length,
                token_ids=_array(s.token_ids),
                logprobs=_array(s.logprobs),
                loss_mask=_array(s.loss_mask),
                weight_versions=_array(s.weight_versions),
                finish_reason="FINISH_REASON_" + s.finish_reason.upper(),
                reward=s.reward,
            )
    return out.SerializeToString()


def _sequence(rng: np.random.Generator, policy: str, agent: str = "") -> SequenceSpec:
    n = int(rng.choice([0, 1, 7, 1030]))
    return SequenceSpec(
        policy_id=policy,
        token_ids=rng.integers(0, 32_000, n).astype(rng.choice(["<i4", "<i8", ">i4"])),
        logprobs=(-rng.random(n)).astype(rng.choice(["<f4", "<f8"])),
        loss_mask=(rng.random(n) < 0.5).astype(rng.choice(["u1", "bool"])),
        weight_versions=rng.integers(-1, 9, n).astype(rng.choice(["<i8", "<i4"])),
        prompt_length=int(rng.choice([0, 8, 300, -1])),
        finish_reason=str(rng.choice(FINISH)),
        reward=float(rng.choice([0.0, 1.0, -0.5, -0.0, 1e300])),
        agent_id=agent,
    )


def _trajectories(rng: np.random.Generator, n: int, agents: int = 1) -> list[TrajectorySpec]:
    out = []
    for i in range(n):
        seqs = [_sequence(rng, f"p{a}", f"agent{a}" if agents > 1 else "") for a in range(agents)]
        out.append(TrajectorySpec(i, seqs, float(rng.choice([0.0, 1.0, -0.0, 0.25]))))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_bytes_equal_the_generated_classes(seed):
    rng = np.random.default_rng(seed)
    trajs = _trajectories(rng, int(rng.integers(0, 9)), agents=1 + seed % 3)
    group_id, instance = f"s/{seed}/{seed * 7}", "raas-é" if seed % 2 else ""
    assert group_result_bytes(group_id, instance, trajs) == oracle(group_id, instance, trajs)


def test_agent_rewards_metadata_and_errors_parse_to_the_same_message():
    rng = np.random.default_rng(99)
    trajs = _trajectories(rng, 4, agents=2)
    trajs[0].agent_rewards = {"solver": 1.0, "verifier": -0.0, "zero": 0.0}
    trajs[1].metadata = {"turns": 3, "tool": "python", "nested": {"a": [1, "b", None, True]}}
    trajs[2].error = "engine died"
    trajs[3].sequences = []  # a failed sample may carry no sequence
    trajs[3].error = ""
    got = rollout_pb2.GroupResult.FromString(group_result_bytes("g", "i", trajs))
    want = rollout_pb2.GroupResult.FromString(oracle("g", "i", trajs))
    assert got == want
    assert got.trajectories[0].agent_rewards["solver"] == 1.0
    assert got.trajectories[2].error.message == "engine died"
    assert got.trajectories[1].metadata["nested"]["a"][1] == "b"


def test_a_non_contiguous_or_two_dimensional_array_keeps_its_values_and_shape():
    rng = np.random.default_rng(5)
    (traj,) = _trajectories(rng, 1)
    seq = traj.sequences[0]
    seq.token_ids = np.arange(40, dtype="<i4")[::2]
    seq.logprobs = np.zeros((4, 5), dtype="<f4")
    got = rollout_pb2.GroupResult.FromString(group_result_bytes("g", "i", [traj]))
    s = got.trajectories[0].sequences[0]
    assert np.frombuffer(s.token_ids.data, "<i4").tolist() == list(range(0, 40, 2))
    assert list(s.logprobs.shape) == [4, 5] and len(s.logprobs.data) == 80
    assert group_result_bytes("g", "i", [traj]) == oracle("g", "i", [traj])


def test_an_unsupported_dtype_is_refused():
    rng = np.random.default_rng(6)
    (traj,) = _trajectories(rng, 1)
    traj.sequences[0].logprobs = np.zeros(3, dtype=np.complex64)
    with pytest.raises(ValueError, match="unsupported dtype"):
        group_result_bytes("g", "i", [traj])


@pytest.mark.parametrize(
    "metadata",
    [
        {"engine": "scripted", "latency_s": 0.25},
        {
            "": "",
            "zero": 0,
            "neg": -0.0,
            "big": 2**70,
            "f": np.float64(1.5),
            "t": (1, (2, [])),
            "e": {},
        },
        {"flags": [True, False, None], "deep": {"a": {"b": {"c": [{"d": "é"}]}}}},
    ],
)
def test_metadata_encodes_as_struct_update_does(metadata):
    rng = np.random.default_rng(7)
    (traj,) = _trajectories(rng, 1)
    traj.metadata = metadata
    got = rollout_pb2.GroupResult.FromString(group_result_bytes("g", "i", [traj]))
    assert got == rollout_pb2.GroupResult.FromString(oracle("g", "i", [traj]))


def test_metadata_of_other_types_goes_through_the_generated_classes():
    rng = np.random.default_rng(8)
    (traj,) = _trajectories(rng, 1)
    traj.metadata = {"n": np.int64(3)}  # not an int: Struct.update refuses it, as before
    with pytest.raises(ValueError, match="Unexpected type"):
        oracle("g", "i", [traj])
    with pytest.raises(ValueError, match="Unexpected type"):
        group_result_bytes("g", "i", [traj])


def test_wrapped_as_the_collect_response_field():
    from astra.raas.v1 import rollout_service_pb2 as pb

    rng = np.random.default_rng(9)
    trajs = _trajectories(rng, 3)
    wrapped = group_result_bytes("g", "inst", trajs, field=1)
    assert pb.CollectResultsResponse.FromString(wrapped).result.SerializeToString() == oracle(
        "g", "inst", trajs
    )
    assert wrapped.endswith(group_result_bytes("g", "inst", trajs))


def test_numpy_scalars_are_taken_as_the_generated_classes_take_them():
    rng = np.random.default_rng(10)
    (traj,) = _trajectories(rng, 1)
    traj.sample_index = np.int64(3)
    traj.reward = np.float32(0.5)
    traj.agent_rewards = {"solver": np.float64(0.25)}
    seq = traj.sequences[0]
    seq.prompt_length = np.int32(min(2, len(seq.token_ids)))
    seq.reward = np.float16(-1.0)
    got = rollout_pb2.GroupResult.FromString(group_result_bytes("g", "i", [traj]))
    assert got == rollout_pb2.GroupResult.FromString(oracle("g", "i", [traj]))
    assert got.trajectories[0].sample_index == 3 and got.trajectories[0].reward == 0.5
