"""A leased batch as FetchBatch's stream: header, trajectory chunks, footer.

The chunks are serialized ahead from the stored trajectory bytes, never parsed: one copy of
the payloads, into the message (the server sends them as they are: `with_raw_responses`).
Whole groups per message, at most CHUNK_BYTES unless one group is larger (then alone: at
most a CollectResults message, within every default limit). Never decides what is in a batch.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from astra.dataflow.records import Batch
from astra.dataflow.v1 import dataflow_service_pb2 as pb
from astra.protowire import I64, LEN, key, varint

CHUNK_BYTES = 8 << 20
_TRAJECTORIES_KEY = key(2, LEN)  # FetchBatchResponse.trajectories


def batch_messages(batch: Batch) -> Iterator[pb.FetchBatchResponse | bytes]:
    header = pb.BatchHeader(
        batch_id=batch.batch_id,
        policy_id=batch.policy_id,
        num_groups=len(batch.groups),
        num_trajectories=batch.num_trajectories,
        policy_version=batch.policy_version,
    )
    header.lease_expire_time.FromNanoseconds(int(batch.lease_expire * 1e9))
    yield pb.FetchBatchResponse(header=header)
    pending: list[tuple[bytes, float]] = []
    size = 0
    max_staleness = 0
    for g in batch.groups:
        max_staleness = max(max_staleness, g.staleness(batch.policy_version))
        group_size = sum(len(t.payload) for t in g.trajectories)
        if pending and size + group_size > CHUNK_BYTES:
            yield _chunk(pending)
            pending, size = [], 0
        # Stamped by the buffer (and stored with the batch): never made up here.
        for t, adv in zip(g.trajectories, g.advantages, strict=True):
            pending.append((t.payload, adv))
        size += group_size
    if pending:
        yield _chunk(pending)
    yield pb.FetchBatchResponse(
        footer=pb.BatchFooter(
            batch_id=batch.batch_id,
            num_trajectories=batch.num_trajectories,
            max_staleness=max_staleness,
            num_replay_groups=sum(1 for g in batch.groups if g.replay),
        )
    )


def _chunk(pending: list[tuple[bytes, float]]) -> bytes:
    """A serialized FetchBatchResponse{trajectories} built from stored bytes."""
    parts, size = trajectories_parts(pending)
    return b"".join([_TRAJECTORIES_KEY, varint(size), *parts])


_ADVANTAGE_TAG = key(9, I64)  # Trajectory.advantage, fixed64
_REPEATED_TAG = key(1, LEN)  # field 1, length-delimited
_DOUBLE = struct.Struct("<d")


def trajectories_parts(payloads_and_advantages) -> tuple[list, int]:
    """The parts of a serialized BatchTrajectories (see `trajectories_blob`) and their
    total length, not joined, so a caller can put its own header in front with one copy."""
    parts: list = []
    size = 0
    pack = _DOUBLE.pack
    for payload, adv in payloads_and_advantages:
        n = len(payload) + 9
        head = varint(n)
        parts += (_REPEATED_TAG, head, payload, _ADVANTAGE_TAG, pack(adv))
        size += 1 + len(head) + n
    return parts, size


def trajectories_blob(payloads_and_advantages: list[tuple[bytes, float]]) -> bytes:
    """Serialized BatchTrajectories built from stored trajectory bytes, advantages set.

    Appending a field to a serialized message overrides it (last value wins), so
    stored payloads are never decoded on the batch path.
    """
    return b"".join(trajectories_parts(payloads_and_advantages)[0])
