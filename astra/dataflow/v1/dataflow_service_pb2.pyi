import datetime

from astra.common.v1 import capabilities_pb2 as _capabilities_pb2
from astra.common.v1 import rollout_pb2 as _rollout_pb2
from astra.common.v1 import version_pb2 as _version_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_STATE_UNSPECIFIED: _ClassVar[InstanceState]
    INSTANCE_STATE_ACTIVE: _ClassVar[InstanceState]
    INSTANCE_STATE_SUSPECT: _ClassVar[InstanceState]
    INSTANCE_STATE_DEAD: _ClassVar[InstanceState]
    INSTANCE_STATE_LEFT: _ClassVar[InstanceState]

class GateMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GATE_MODE_UNSPECIFIED: _ClassVar[GateMode]
    GATE_MODE_ASYNC_RUNNING: _ClassVar[GateMode]
    GATE_MODE_SYNC_BARRIER: _ClassVar[GateMode]
    GATE_MODE_THROTTLED: _ClassVar[GateMode]
INSTANCE_STATE_UNSPECIFIED: InstanceState
INSTANCE_STATE_ACTIVE: InstanceState
INSTANCE_STATE_SUSPECT: InstanceState
INSTANCE_STATE_DEAD: InstanceState
INSTANCE_STATE_LEFT: InstanceState
GATE_MODE_UNSPECIFIED: GateMode
GATE_MODE_ASYNC_RUNNING: GateMode
GATE_MODE_SYNC_BARRIER: GateMode
GATE_MODE_THROTTLED: GateMode

class RegisterInstanceRequest(_message.Message):
    __slots__ = ("instance_id", "address", "capacity", "policy_ids", "workflows", "labels", "loaded_versions", "contract_version", "incarnation")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    POLICY_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKFLOWS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    capacity: int
    policy_ids: _containers.RepeatedScalarFieldContainer[str]
    workflows: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    loaded_versions: _containers.RepeatedCompositeFieldContainer[_version_pb2.PolicyVersion]
    contract_version: str
    incarnation: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., capacity: _Optional[int] = ..., policy_ids: _Optional[_Iterable[str]] = ..., workflows: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., loaded_versions: _Optional[_Iterable[_Union[_version_pb2.PolicyVersion, _Mapping]]] = ..., contract_version: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RegisterInstanceResponse(_message.Message):
    __slots__ = ("heartbeat_interval", "dataflow_id", "already_registered")
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    DATAFLOW_ID_FIELD_NUMBER: _ClassVar[int]
    ALREADY_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval: _duration_pb2.Duration
    dataflow_id: str
    already_registered: bool
    def __init__(self, heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., dataflow_id: _Optional[str] = ..., already_registered: _Optional[bool] = ...) -> None: ...

class HeartbeatInstanceRequest(_message.Message):
    __slots__ = ("instance_id", "free_slots", "loaded_versions", "pending_results")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PENDING_RESULTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    free_slots: int
    loaded_versions: _containers.RepeatedCompositeFieldContainer[_version_pb2.PolicyVersion]
    pending_results: int
    def __init__(self, instance_id: _Optional[str] = ..., free_slots: _Optional[int] = ..., loaded_versions: _Optional[_Iterable[_Union[_version_pb2.PolicyVersion, _Mapping]]] = ..., pending_results: _Optional[int] = ...) -> None: ...

class HeartbeatInstanceResponse(_message.Message):
    __slots__ = ("heartbeat_interval", "dataflow_id")
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    DATAFLOW_ID_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval: _duration_pb2.Duration
    dataflow_id: str
    def __init__(self, heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., dataflow_id: _Optional[str] = ...) -> None: ...

class DeregisterInstanceRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DeregisterInstanceResponse(_message.Message):
    __slots__ = ("requeued_groups",)
    REQUEUED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    requeued_groups: int
    def __init__(self, requeued_groups: _Optional[int] = ...) -> None: ...

class FetchBatchRequest(_message.Message):
    __slots__ = ("policy_id", "num_groups", "request_id", "trainer_id", "max_wait", "trainer_version")
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    num_groups: int
    request_id: str
    trainer_id: str
    max_wait: _duration_pb2.Duration
    trainer_version: int
    def __init__(self, policy_id: _Optional[str] = ..., num_groups: _Optional[int] = ..., request_id: _Optional[str] = ..., trainer_id: _Optional[str] = ..., max_wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., trainer_version: _Optional[int] = ...) -> None: ...

class BatchHeader(_message.Message):
    __slots__ = ("batch_id", "policy_id", "num_groups", "num_trajectories", "policy_version", "lease_expire_time")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    policy_id: str
    num_groups: int
    num_trajectories: int
    policy_version: int
    lease_expire_time: _timestamp_pb2.Timestamp
    def __init__(self, batch_id: _Optional[str] = ..., policy_id: _Optional[str] = ..., num_groups: _Optional[int] = ..., num_trajectories: _Optional[int] = ..., policy_version: _Optional[int] = ..., lease_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class BatchTrajectories(_message.Message):
    __slots__ = ("trajectories",)
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.Trajectory]
    def __init__(self, trajectories: _Optional[_Iterable[_Union[_rollout_pb2.Trajectory, _Mapping]]] = ...) -> None: ...

class BatchFooter(_message.Message):
    __slots__ = ("batch_id", "num_trajectories", "max_staleness", "num_replay_groups")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLAY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    num_trajectories: int
    max_staleness: int
    num_replay_groups: int
    def __init__(self, batch_id: _Optional[str] = ..., num_trajectories: _Optional[int] = ..., max_staleness: _Optional[int] = ..., num_replay_groups: _Optional[int] = ...) -> None: ...

class FetchBatchResponse(_message.Message):
    __slots__ = ("header", "trajectories", "footer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    FOOTER_FIELD_NUMBER: _ClassVar[int]
    header: BatchHeader
    trajectories: BatchTrajectories
    footer: BatchFooter
    def __init__(self, header: _Optional[_Union[BatchHeader, _Mapping]] = ..., trajectories: _Optional[_Union[BatchTrajectories, _Mapping]] = ..., footer: _Optional[_Union[BatchFooter, _Mapping]] = ...) -> None: ...

class AckBatchRequest(_message.Message):
    __slots__ = ("batch_id", "untrained_reason")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    UNTRAINED_REASON_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    untrained_reason: str
    def __init__(self, batch_id: _Optional[str] = ..., untrained_reason: _Optional[str] = ...) -> None: ...

class AckBatchResponse(_message.Message):
    __slots__ = ("consumed_groups",)
    CONSUMED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    consumed_groups: int
    def __init__(self, consumed_groups: _Optional[int] = ...) -> None: ...

class ExtendBatchLeaseRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class ExtendBatchLeaseResponse(_message.Message):
    __slots__ = ("lease_expire_time",)
    LEASE_EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    lease_expire_time: _timestamp_pb2.Timestamp
    def __init__(self, lease_expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AnnounceVersionRequest(_message.Message):
    __slots__ = ("version", "weights_address", "trainer_id", "resumed", "resumed_from_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: _version_pb2.PolicyVersion
    weights_address: str
    trainer_id: str
    resumed: bool
    resumed_from_version: int
    def __init__(self, version: _Optional[_Union[_version_pb2.PolicyVersion, _Mapping]] = ..., weights_address: _Optional[str] = ..., trainer_id: _Optional[str] = ..., resumed: _Optional[bool] = ..., resumed_from_version: _Optional[int] = ...) -> None: ...

class AnnounceVersionResponse(_message.Message):
    __slots__ = ("current_version", "already_announced")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ANNOUNCED_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    already_announced: bool
    def __init__(self, current_version: _Optional[int] = ..., already_announced: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("instance_id", "address", "state", "capacity", "free_slots", "in_flight_groups", "consecutive_failures", "loaded_versions", "labels", "last_seen_time", "policy_ids", "submits_refused_in_a_row", "last_refusal")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_TIME_FIELD_NUMBER: _ClassVar[int]
    POLICY_IDS_FIELD_NUMBER: _ClassVar[int]
    SUBMITS_REFUSED_IN_A_ROW_FIELD_NUMBER: _ClassVar[int]
    LAST_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    state: InstanceState
    capacity: int
    free_slots: int
    in_flight_groups: int
    consecutive_failures: int
    loaded_versions: _containers.RepeatedCompositeFieldContainer[_version_pb2.PolicyVersion]
    labels: _containers.ScalarMap[str, str]
    last_seen_time: _timestamp_pb2.Timestamp
    policy_ids: _containers.RepeatedScalarFieldContainer[str]
    submits_refused_in_a_row: int
    last_refusal: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[_Union[InstanceState, str]] = ..., capacity: _Optional[int] = ..., free_slots: _Optional[int] = ..., in_flight_groups: _Optional[int] = ..., consecutive_failures: _Optional[int] = ..., loaded_versions: _Optional[_Iterable[_Union[_version_pb2.PolicyVersion, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., last_seen_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., policy_ids: _Optional[_Iterable[str]] = ..., submits_refused_in_a_row: _Optional[int] = ..., last_refusal: _Optional[str] = ...) -> None: ...

class PolicyStatus(_message.Message):
    __slots__ = ("policy_id", "current_version", "buffered_groups", "buffer_capacity", "replay_groups", "leased_groups", "target_version", "weights_address", "groups_dropped_in_a_row", "last_drop_reason")
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    REPLAY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DROPPED_IN_A_ROW_FIELD_NUMBER: _ClassVar[int]
    LAST_DROP_REASON_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    current_version: int
    buffered_groups: int
    buffer_capacity: int
    replay_groups: int
    leased_groups: int
    target_version: int
    weights_address: str
    groups_dropped_in_a_row: int
    last_drop_reason: str
    def __init__(self, policy_id: _Optional[str] = ..., current_version: _Optional[int] = ..., buffered_groups: _Optional[int] = ..., buffer_capacity: _Optional[int] = ..., replay_groups: _Optional[int] = ..., leased_groups: _Optional[int] = ..., target_version: _Optional[int] = ..., weights_address: _Optional[str] = ..., groups_dropped_in_a_row: _Optional[int] = ..., last_drop_reason: _Optional[str] = ...) -> None: ...

class GateStatus(_message.Message):
    __slots__ = ("mode", "reason", "staleness", "capacity", "in_flight_groups", "buffer_fill_ratio")
    MODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FILL_RATIO_FIELD_NUMBER: _ClassVar[int]
    mode: GateMode
    reason: str
    staleness: float
    capacity: int
    in_flight_groups: int
    buffer_fill_ratio: float
    def __init__(self, mode: _Optional[_Union[GateMode, str]] = ..., reason: _Optional[str] = ..., staleness: _Optional[float] = ..., capacity: _Optional[int] = ..., in_flight_groups: _Optional[int] = ..., buffer_fill_ratio: _Optional[float] = ...) -> None: ...

class StreamStatus(_message.Message):
    __slots__ = ("name", "epoch", "position", "size", "num_epochs", "exhausted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    epoch: int
    position: int
    size: int
    num_epochs: int
    exhausted: bool
    def __init__(self, name: _Optional[str] = ..., epoch: _Optional[int] = ..., position: _Optional[int] = ..., size: _Optional[int] = ..., num_epochs: _Optional[int] = ..., exhausted: _Optional[bool] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("stream", "policy_id", "version", "groups", "groups_done", "samples", "failed_samples", "mean_reward", "solved_groups", "min_token_version", "max_token_version", "complete")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DONE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FAILED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    SOLVED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKEN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKEN_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    stream: str
    policy_id: str
    version: int
    groups: int
    groups_done: int
    samples: int
    failed_samples: int
    mean_reward: float
    solved_groups: int
    min_token_version: int
    max_token_version: int
    complete: bool
    def __init__(self, stream: _Optional[str] = ..., policy_id: _Optional[str] = ..., version: _Optional[int] = ..., groups: _Optional[int] = ..., groups_done: _Optional[int] = ..., samples: _Optional[int] = ..., failed_samples: _Optional[int] = ..., mean_reward: _Optional[float] = ..., solved_groups: _Optional[int] = ..., min_token_version: _Optional[int] = ..., max_token_version: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("dataflow_id", "instances", "policies", "gate", "streams", "counters", "pool_empty", "status_time", "evals", "storage")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DATAFLOW_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    POOL_EMPTY_FIELD_NUMBER: _ClassVar[int]
    STATUS_TIME_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    dataflow_id: str
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    policies: _containers.RepeatedCompositeFieldContainer[PolicyStatus]
    gate: GateStatus
    streams: _containers.RepeatedCompositeFieldContainer[StreamStatus]
    counters: _containers.ScalarMap[str, int]
    pool_empty: bool
    status_time: _timestamp_pb2.Timestamp
    evals: _containers.RepeatedCompositeFieldContainer[EvalResult]
    storage: StorageStatus
    def __init__(self, dataflow_id: _Optional[str] = ..., instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., policies: _Optional[_Iterable[_Union[PolicyStatus, _Mapping]]] = ..., gate: _Optional[_Union[GateStatus, _Mapping]] = ..., streams: _Optional[_Iterable[_Union[StreamStatus, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., pool_empty: _Optional[bool] = ..., status_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., evals: _Optional[_Iterable[_Union[EvalResult, _Mapping]]] = ..., storage: _Optional[_Union[StorageStatus, _Mapping]] = ...) -> None: ...

class StorageStatus(_message.Message):
    __slots__ = ("free_bytes", "min_free_bytes", "resume_free_bytes", "paused", "reason")
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIN_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESUME_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    free_bytes: int
    min_free_bytes: int
    resume_free_bytes: int
    paused: bool
    reason: str
    def __init__(self, free_bytes: _Optional[int] = ..., min_free_bytes: _Optional[int] = ..., resume_free_bytes: _Optional[int] = ..., paused: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities",)
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    capabilities: _capabilities_pb2.Capabilities
    def __init__(self, capabilities: _Optional[_Union[_capabilities_pb2.Capabilities, _Mapping]] = ...) -> None: ...
