"""Dataflow <-> RaaS messages: a work item as a PromptGroup, a GroupResult as an IncomingGroup.

`prompt_group` is what Dataflow submits; `incoming_group` validates what a RaaS returns
(shapes, dtypes, finite log-probs, versions, token ids inside the policy's vocabulary) and
splits it per policy, keeping each trajectory's received bytes as its payload, so Dataflow
never decodes or re-encodes arrays again. A result that breaks the contract raises
`Malformed` naming the field. Protobuf messages only, no gRPC.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf import struct_pb2

from astra.common.arrays import DTYPES, SEQUENCE_ARRAYS, Malformed
from astra.common.v1 import array_pb2, rollout_pb2
from astra.dataflow.config import StreamSettings
from astra.dataflow.ports import IncomingGroup
from astra.dataflow.records import TrajectoryRecord, WorkItem
from astra.protowire import read_varint

_UNSIGNED: dict[int, np.dtype[Any]] = {
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}  # by the versions' itemsize


class _GroupArrays:
    """The numeric checks of a group's sequences, run once over all of them.

    Per sequence, numpy calls cost more than the arithmetic; a group of 8 x 1 sequences
    costs 4 calls instead of 32. A failure is traced back to its sequence, so the
    message names the same field as a per-sequence check would.
    """

    __slots__ = ("logprobs", "versions", "where")

    def __init__(self) -> None:
        self.logprobs: list[np.ndarray] = []
        self.versions: list[np.ndarray] = []
        self.where: list[str] = []

    def add(self, where: str, logprobs: np.ndarray, versions: np.ndarray) -> None:
        self.where.append(where)
        self.logprobs.append(logprobs)
        self.versions.append(versions)

    def version_ranges(self) -> list[tuple[int, int]]:
        """Checks log-probs are finite; returns (min version >= 0, max version) per
        sequence in order of `add`, -1 where a sequence has no version >= 0."""
        if not self.where:
            return []
        logprobs = self.logprobs[0] if len(self.logprobs) == 1 else np.concatenate(self.logprobs)
        if not np.isfinite(logprobs).all():
            for where, lp in zip(self.where, self.logprobs, strict=True):
                if not np.isfinite(lp).all():
                    raise Malformed(f"{where}.logprobs: not finite")
        sizes = [len(v) for v in self.versions]
        nonempty = [v for v in self.versions if len(v)]
        if not nonempty:
            return [(-1, -1)] * len(sizes)
        versions = nonempty[0] if len(nonempty) == 1 else np.concatenate(nonempty)
        lengths = [n for n in sizes if n]
        starts = list(itertools.accumulate(lengths[:-1], initial=0))
        highs = np.maximum.reduceat(versions, starts).tolist()
        # Read as unsigned, every negative version is above every version >= 0: the minimum
        # is the smallest version >= 0 wherever the sequence has one (and then high >= 0).
        unsigned = versions.view(_UNSIGNED[versions.dtype.itemsize])
        lows = np.minimum.reduceat(unsigned, starts).tolist()
        out = []
        k = 0
        for n in sizes:
            if not n:
                out.append((-1, -1))
                continue
            high, low = highs[k], lows[k]
            k += 1
            out.append((low, high) if high >= 0 else (-1, -1))
        return out


def _check_trajectory(
    t: rollout_pb2.Trajectory,
    where: str,
    arrays: _GroupArrays,
    vocab: Mapping[str, int] | None = None,
) -> list[tuple[str, int]]:
    """Validates one trajectory's shapes and scalars; returns (policy, tokens) per sequence.

    Log-probs and versions are checked (and version ranges computed) by `arrays`, for the
    whole group at once.
    """
    if not math.isfinite(t.reward):
        raise Malformed(f"{where}.reward: not finite")
    if t.agent_rewards:
        for agent, r in t.agent_rewards.items():
            if not math.isfinite(r):
                raise Malformed(f"{where}.agent_rewards[{agent}]: not finite")
    sequences = t.sequences
    if not sequences:
        raise Malformed(f"{where}.sequences: empty")
    out = []
    for j, s in enumerate(sequences):
        policy_id = s.policy_id
        if not policy_id:
            raise Malformed(f"{where}.sequences[{j}].policy_id: empty")
        if not math.isfinite(s.reward):
            raise Malformed(f"{where}.sequences[{j}].reward: not finite")
        token_ids, logprobs, loss_mask, weight_versions = (
            s.token_ids,
            s.logprobs,
            s.loss_mask,
            s.weight_versions,
        )
        size = vocab.get(policy_id) if vocab else None
        if size is None:
            n = _array_length(token_ids, "token_ids", -1, where, j)
        else:
            ids = _array_data(token_ids, "token_ids", -1, where, j)
            n = len(ids)
            if n and (int(ids.min()) < 0 or int(ids.max()) >= size):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise Malformed(
                    f"{where}.sequences[{j}].token_ids: id {bad} is outside the vocabulary of "
                    f"policy {policy_id} (0..{size - 1})"
                )
        lp = _array_data(logprobs, "logprobs", n, where, j)
        _array_length(loss_mask, "loss_mask", n, where, j)
        versions = _array_data(weight_versions, "weight_versions", n, where, j)
        if not 0 <= s.prompt_length <= n:
            raise Malformed(
                f"{where}.sequences[{j}].prompt_length: {s.prompt_length} outside 0..{n}"
            )
        arrays.add(f"{where}.sequences[{j}]", lp, versions)
        out.append((policy_id, n))
    return out


def _array_shape(msg: array_pb2.NDArray, name: str, n: int, where: str, j: int):
    """(dtype, length, data) of a one-dimensional sequence array, checked."""
    dtype = msg.dtype
    if dtype not in SEQUENCE_ARRAYS[name]:
        raise Malformed(
            f"{where}.sequences[{j}].{name}.dtype: {dtype!r}, expected one of "
            f"{SEQUENCE_ARRAYS[name]}"
        )
    shape = msg.shape
    if len(shape) != 1:
        raise Malformed(f"{where}.sequences[{j}].{name}.shape: must be one-dimensional")
    length = shape[0]
    data = msg.data
    itemsize = DTYPES[dtype].itemsize
    if len(data) != length * itemsize:
        raise Malformed(
            f"{where}.sequences[{j}].{name}.data: {len(data)} bytes, expected "
            f"{length * itemsize} for {dtype}{list(shape)}"
        )
    if n >= 0 and length != n:
        raise Malformed(f"{where}.sequences[{j}].{name}: length {length} != token_ids length {n}")
    return dtype, length, data


def _array_length(msg: array_pb2.NDArray, name: str, n: int, where: str, j: int) -> int:
    return _array_shape(msg, name, n, where, j)[1]


def _array_data(msg: array_pb2.NDArray, name: str, n: int, where: str, j: int) -> np.ndarray:
    dtype, _, data = _array_shape(msg, name, n, where, j)
    return np.frombuffer(data, dtype=DTYPES[dtype])


def field_slices(buf: bytes | memoryview, field_number: int, *, copy: bool = True) -> list:
    """The raw bytes of every length-delimited `field_number` at the top level of `buf`.

    With copy=False the slices are memoryviews into `buf`.
    """
    out = []
    pos, end = 0, len(buf)
    view = memoryview(buf)
    while pos < end:
        key, pos = read_varint(buf, pos)
        wire = key & 7
        if wire == 2:
            length, pos = read_varint(buf, pos)
            if key >> 3 == field_number:
                part = view[pos : pos + length]
                out.append(bytes(part) if copy else part)
            pos += length
        elif wire == 0:
            _, pos = read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise Malformed(f"unsupported wire type {wire}")
    return out


_FAILED_FINISH = frozenset({rollout_pb2.FINISH_REASON_UNSPECIFIED, rollout_pb2.FINISH_REASON_ERROR})


def incoming_group(
    result: rollout_pb2.GroupResult,
    instance_id: str,
    raw: bytes | memoryview | None = None,
    vocab: Mapping[str, int] | None = None,
) -> IncomingGroup:
    """Splits a GroupResult per policy, validating every trajectory.

    With `raw` (the serialized GroupResult as received), single-policy trajectories
    keep their received bytes (views into `raw`, not copies) instead of being
    serialized again.
    """
    out = IncomingGroup(result.group_id, instance_id)
    if result.HasField("error") and result.error.code != 0:
        out.error = result.error.message or f"code {result.error.code}"
        return out
    raw_trajectories = field_slices(raw, 2, copy=False) if raw is not None else None
    try:
        arrays = _GroupArrays()
        checked = []
        for i, t in enumerate(result.trajectories):
            where = f"result.trajectories[{i}]"
            if t.group_id and t.group_id != result.group_id:
                raise Malformed(f"{where}.group_id: {t.group_id!r} != {result.group_id!r}")
            # As the FinishReason enum promises: UNSPECIFIED is taken as ERROR, and a sequence
            # that ended in ERROR fails its trajectory (counted, never trained).
            failed = (t.HasField("error") and t.error.code != 0) or any(
                s.finish_reason in _FAILED_FINISH for s in t.sequences
            )
            checked.append(
                (t, failed, None if failed else _check_trajectory(t, where, arrays, vocab))
            )
        ranges = iter(arrays.version_ranges())
        for i, (t, failed, sequences) in enumerate(checked):
            if failed:
                policies = {s.policy_id for s in t.sequences} or {""}
                facts = dict.fromkeys(policies, (-1, -1, 0))
            else:
                assert sequences is not None  # (checked above: not failed)
                facts = _facts(sequences, ranges)
            single = len(facts) == 1
            for policy_id, (vmin, vmax, ntok) in facts.items():
                if single and raw_trajectories is not None:
                    payload = raw_trajectories[i]
                elif single:
                    payload = t.SerializeToString()
                else:
                    part = rollout_pb2.Trajectory()
                    part.CopyFrom(t)
                    del part.sequences[:]
                    part.sequences.extend(s for s in t.sequences if s.policy_id == policy_id)
                    payload = part.SerializeToString()
                tid = t.trajectory_id or f"{result.group_id}/{t.sample_index}"
                reward = t.reward if single else _policy_reward(t, policy_id)
                out.per_policy.setdefault(policy_id, []).append(
                    TrajectoryRecord(tid, reward, vmin, vmax, ntok, payload, failed)
                )
    except Malformed as exc:
        out.per_policy = {}
        out.invalid = str(exc)
    return out


def _facts(sequences: list[tuple[str, int]], ranges) -> dict[str, tuple[int, int, int]]:
    """policy -> (min version, max version, tokens) over one trajectory's sequences."""
    facts: dict[str, tuple[int, int, int]] = {}
    for policy_id, n in sequences:
        vmin, vmax = next(ranges)
        old = facts.get(policy_id)
        if old is not None:
            vmin = vmin if old[0] < 0 else (old[0] if vmin < 0 else min(old[0], vmin))
            vmax = max(old[1], vmax)
            n += old[2]
        facts[policy_id] = (vmin, vmax, n)
    return facts


def _policy_reward(t: rollout_pb2.Trajectory, policy_id: str) -> float:
    """A policy's reward in a multi-policy episode: the mean of its sequences' rewards."""
    rewards = [s.reward for s in t.sequences if s.policy_id == policy_id]
    return sum(rewards) / len(rewards) if rewards else t.reward


def _struct(record: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(json.loads(json.dumps(record, default=str)))
    return s


def prompt_group(item: WorkItem, stream: StreamSettings) -> rollout_pb2.PromptGroup:
    sp = stream.sampling
    return rollout_pb2.PromptGroup(
        group_id=item.group_id,
        workflow=item.workflow,
        policy_ids=list(item.policy_ids),
        prompt=rollout_pb2.Prompt(
            text=str(item.record.get(stream.dataset.prompt_field, "")), data=_struct(item.record)
        ),
        num_samples=item.num_samples,
        sampling_params=rollout_pb2.SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            max_new_tokens=sp.max_new_tokens,
            stop_strings=sp.stop_strings,
            stop_token_ids=sp.stop_token_ids,
            seed=sp.seed * 1_000_003 + item.epoch * 65_537 + item.index,
        ),
        reward=stream.reward,
        epoch=item.epoch,
        regenerate=item.regenerate,
    )
