"""Typed configuration of the Dataflow service (every field documented, bounded).

Unknown keys fail loudly. Defaults are the documented defaults of docs/dataflow.md.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from astra.config import Strict

POLICY_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"


class BufferSettings(Strict):
    """How one policy's buffer admits, orders, replays and normalises groups
    (astra.dataflow.buffer.PolicyBuffer reads it as is). A group's version lag is the
    trainer's version minus the oldest weight version of any of its tokens (its staleness)."""

    renamed: ClassVar[dict[str, str]] = {
        "max_staleness": "max_version_lag",
        "replay_max_staleness": "replay_max_version_lag",
    }

    capacity_groups: int = Field(1024, ge=1, description="Buffer bound in groups.")
    """Most groups held at once. `put_back` and `restore` may exceed it briefly."""
    eviction: Literal["drop_oldest", "reject_new"] = Field(
        "drop_oldest", description="What a full buffer does: evict the oldest group or refuse."
    )
    """When full: evict the buffered group with the oldest min_version (ties: lowest seq) and
    accept the new one (`evicted_full`), or refuse the new one (`rejected_full`)."""
    max_version_lag: int | None = Field(
        None, ge=0, description="Groups lagging more versions are dropped; None: none."
    )
    """Groups whose version lag is above this are dropped, on add and on take (counted
    `filtered_stale`). 0 is synchronous training. Where `gate.max_version_lag` keeps groups
    from starting too far ahead, this drops what still arrives too late."""
    drop_equal_rewards: bool = Field(True, description="Drop groups whose rewards are all equal.")
    """Dynamic sampling: drop a group of >= 2 trajectories whose rewards are all exactly equal.
    A single-trajectory group is kept (it has no within-group spread to measure, and carries
    signal under batch normalisation); under group normalisation its advantage is 0."""
    filters: list[str] = Field(default_factory=list, description="Custom filters by name.")
    """Names of custom filters (`register_filter` or the `astra.filters` entry points),
    applied in order after the built-ins."""
    ordering: Literal["fifo", "oldest_version_first"] = Field("fifo", description="Batch order.")
    """`fifo`: arrival order (seq). `oldest_version_first`: lowest (min_version, seq) first."""
    replay_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Share of a batch from replay.")
    """floor(n * ratio) groups of each batch of n from replay when replay holds that many,
    otherwise all replay holds; the rest fresh."""
    replay_capacity_groups: int = Field(0, ge=0, description="Replay buffer bound in groups.")
    """A group enters replay when its batch is acknowledged (trained); the oldest to enter
    leaves first (`replay_evicted`)."""
    replay_max_version_lag: int | None = Field(
        None, ge=0, description="Version-lag bound of replayed groups."
    )
    """None inherits `max_version_lag`. Must not exceed it, so nothing older than the
    configured bound reaches the trainer."""
    normalization: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage normalisation: per group, per batch, or raw rewards."
    )
    """`group`: (r - mean_group) / (std_group + eps). `batch`: mean and std over every
    trajectory of the batch. `none`: advantages are the raw rewards. std is the population std
    (ddof=0)."""
    adv_eps: float = Field(1e-6, ge=0.0, description="Added to the std before dividing.")
    std_normalize: bool = Field(True, description="Divide by the std (else subtract mean only).")

    @model_validator(mode="after")
    def _replay_bounds(self) -> BufferSettings:
        if self.replay_ratio > 0 and self.replay_capacity_groups == 0:
            raise ValueError("replay_ratio > 0 needs replay_capacity_groups > 0")
        bound, replay = self.max_version_lag, self.replay_max_version_lag
        if bound is not None and replay is not None and replay > bound:
            raise ValueError("replay_max_version_lag must not exceed max_version_lag")
        return self

    @property
    def replay_bound(self) -> int | None:
        return (
            self.max_version_lag
            if self.replay_max_version_lag is None
            else self.replay_max_version_lag
        )


class SamplingSettings(Strict):
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass.")
    top_k: int = Field(0, ge=0, description="Top-k; 0 means no limit.")
    max_new_tokens: int = Field(256, ge=1, le=1 << 20, description="Tokens per sequence.")
    stop_strings: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list, max_length=64, description="Stop strings (rollout.proto bounds)."
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=1024, description="Stop token ids."
    )
    seed: int = Field(0, description="Base seed; each group derives its own.")


class PolicySettings(Strict):
    id: str = Field(pattern=POLICY_ID_PATTERN, description="Policy id.")
    batch_groups: int = Field(8, ge=1, le=65536, description="Groups per training batch.")
    buffer: BufferSettings = Field(default_factory=BufferSettings)
    vocab_size: int | None = Field(
        None,
        ge=1,
        description="Rows of the policy's embedding (its config.json vocab_size): a trajectory "
        "with a token id outside 0..vocab_size-1 is refused at ingest as malformed, naming the "
        "id, instead of reaching the trainer (which cannot embed it). None: not checked.",
    )


class DatasetSettings(Strict):
    path: str = Field(description="Local JSONL or Parquet file.")
    prompt_field: str = Field("prompt", description="Field holding the prompt text.")
    num_epochs: int = Field(1, ge=0, description="Epochs to run; 0 means unbounded.")
    shuffle: bool = Field(True, description="Shuffle each epoch (seeded).")
    seed: int = Field(0, ge=0, description="Shuffle seed (numpy seeds are >= 0).")


class StreamSettings(Strict):
    name: str = Field(pattern=POLICY_ID_PATTERN, description="Prefix of the group ids.")
    dataset: DatasetSettings
    workflow: str = Field("single_turn", min_length=1, description="Workflow name.")
    policy_ids: list[str] = Field(min_length=1, description="Policies of the episodes.")
    group_size: int = Field(8, ge=1, le=1024, description="Samples per prompt.")
    reward: str = Field("", description="Reward function name; empty: workflow default.")
    raas_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Only instances whose labels include all of these get its work; empty: any.",
    )
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    eval_every_versions: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="0: a training stream. N > 0: an evaluation stream: its whole dataset "
        "runs once at every N-th version of its first policy (0 included), on instances "
        "holding that version, and is scored into GetStatus `evals`, never trained on "
        "(astra/dataflow/evals.py).",
    )


class PoolSettings(Strict):
    heartbeat_interval_s: float = Field(2.0, gt=0, description="Told to every RaaS.")
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="Silence that makes a suspect.")
    probe_interval_s: float = Field(1.0, gt=0, description="Health probe period for suspects.")
    confirm_failures: int = Field(3, ge=1, description="Failed probes that confirm death.")
    call_timeout_s: float = Field(10.0, gt=0, description="Deadline of calls to a RaaS.")
    collect_max_groups: int = Field(256, ge=1, le=4096, description="Groups per collect.")
    collect_wait_s: float = Field(1.0, ge=0, le=30, description="Long-poll wait per collect.")
    dead_retention_s: float = Field(300.0, ge=0, description="Keep dead instances in status.")


class LeaseSettings(Strict):
    group_lease_s: float = Field(600.0, gt=0, description="Dispatch lease of a group.")
    batch_lease_s: float = Field(300.0, gt=0, description="Lease of a batch until AckBatch.")
    max_dispatch_attempts: int = Field(
        5, ge=1, description="Dispatches of one group before it is counted failed."
    )


class GateSettings(Strict):
    """Admission: the Flux mode gate's thresholds (astra.dataflow.gate.ModeGate reads them as
    is) and AReaL's off-policy bound (astra.dataflow.offpolicy)."""

    renamed: ClassVar[dict[str, str]] = {
        "max_offpolicyness": "max_version_lag",
        "staleness_threshold": "barrier_staleness_score",
    }

    barrier_staleness_score: float = Field(0.3, gt=0, le=1, description="Score entering barrier.")
    """Enter SYNC_BARRIER when Flux's staleness score (the smoothed version lag at acceptance,
    scaled to 0..1: astra.dataflow.gate.StalenessTracker) exceeds this."""
    barrier_exit_ratio: float = Field(0.8, gt=0, le=1, description="Hysteresis on leaving.")
    """Leave the barrier only once the score <= ratio * barrier_staleness_score."""
    capacity_low_watermark: int = Field(0, ge=0, description="Capacity at or below: throttle.")
    buffer_high_watermark: float = Field(0.9, gt=0, le=1, description="Fill above: throttle.")
    min_barrier_duration_s: float = Field(0.1, ge=0, description="Minimum time in barrier.")
    max_version_lag: int | None = Field(
        2, ge=0, description="AReaL's eta: versions a group may lag; 0 is synchronous; None: off."
    )
    """AReaL's off-policy bound eta: no group starts unless it will be trained by the version
    it started from + max_version_lag at the latest (astra.dataflow.offpolicy). 0 is
    synchronous: every trained token is of the version trained."""
    max_concurrent_groups: int = Field(1024, ge=1, description="Groups in flight at most.")
    barrier_gap_allowance: int | None = Field(
        None,
        ge=0,
        description="Version gap the staleness score leaves out; None: max_version_lag "
        "(0 when that is off); 0: all of it, Flux's score as published.",
    )
    """The barrier answers staleness beyond what the off-policy bound already allows: a group
    whose gap at acceptance is g adds max(0, g - allowance) to the score's gap term. Counting
    the whole gap (0) made the default threshold (a mean gap of 1.5) fire inside the default
    eta of 2, draining in-flight work the bound allows."""

    @property
    def gap_allowance(self) -> int:
        """The version gap the staleness score leaves out (see barrier_gap_allowance)."""
        if self.barrier_gap_allowance is not None:
            return self.barrier_gap_allowance
        return self.max_version_lag or 0


class StorageSettings(Strict):
    min_free_bytes: int = Field(
        256 << 20,
        ge=0,
        description="Below this many bytes free on the state directory's file system, "
        "dispatch and ingest pause (the RaaS keep their results); 0: only after a write failed "
        "for lack of space. Between two reads of the free space the bytes Dataflow writes are "
        "counted, so it is a margin for state commits, not for the blob log.",
    )
    resume_free_bytes: int | None = Field(
        None, ge=0, description="Resume at this many bytes free (default 1.25 x min_free_bytes)."
    )
    check_interval_s: float = Field(2.0, gt=0, description="How often the free space is read.")
    blob_segment_bytes: int = Field(
        256 << 20,
        ge=1 << 20,
        description="Size of the blob log's segment files: consumed groups give their bytes "
        "back as whole segments fall out of use.",
    )
    keep_done_epochs: int | None = Field(
        2,
        ge=0,
        description="Complete epochs of each training stream whose per-group work rows are "
        "kept; the rows of older complete epochs fold into one count per epoch "
        "(astra.dataflow.folding), so the state grows with the work in flight, not with the "
        "run's length. None: every row kept.",
    )
    fold_interval_s: float = Field(
        30.0, gt=0, description="How often complete epochs are looked for to fold."
    )

    @model_validator(mode="after")
    def _resume_above_min(self) -> StorageSettings:
        if self.resume_free_bytes is not None and self.resume_free_bytes < self.min_free_bytes:
            raise ValueError("storage.resume_free_bytes: must be >= storage.min_free_bytes")
        return self

    @property
    def resume_at(self) -> int:
        if self.resume_free_bytes is not None:
            return self.resume_free_bytes
        return self.min_free_bytes + self.min_free_bytes // 4


class VersionSettings(Strict):
    barrier: Literal["independent", "lockstep"] = Field(
        "independent",
        description="lockstep: RaaS load a set of versions only when every policy has it.",
    )


class DataflowConfig(Strict):
    host: str = Field("127.0.0.1", description="Listen address.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks one.")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus HTTP port.")
    state_dir: str = Field("./astra-state/dataflow", description="SQLite state directory.")
    grace_s: float = Field(10.0, ge=0, description="Drain period on SIGTERM.")
    max_message_bytes: int = Field(64 << 20, ge=1 << 20, description="gRPC message limit.")
    policies: list[PolicySettings] = Field(min_length=1)
    streams: list[StreamSettings] = Field(min_length=1)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    leases: LeaseSettings = Field(default_factory=LeaseSettings)
    gate: GateSettings = Field(default_factory=GateSettings)
    versions: VersionSettings = Field(default_factory=VersionSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)

    @model_validator(mode="after")
    def _check_refs(self) -> DataflowConfig:
        ids = [p.id for p in self.policies]
        if len(set(ids)) != len(ids):
            raise ValueError("policies: duplicate policy id")
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names):
            raise ValueError("streams: duplicate stream name")
        for s in self.streams:
            unknown = [p for p in s.policy_ids if p not in ids]
            if unknown:
                raise ValueError(f"streams.{s.name}.policy_ids: unknown policies {unknown}")
        return self

    def policy(self, policy_id: str) -> PolicySettings:
        """The settings of a configured policy (KeyError for another)."""
        for p in self.policies:
            if p.id == policy_id:
                return p
        raise KeyError(policy_id)
