import datetime

from astra.common.v1 import capabilities_pb2 as _capabilities_pb2
from astra.common.v1 import rollout_pb2 as _rollout_pb2
from astra.common.v1 import version_pb2 as _version_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitGroupsRequest(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.PromptGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[_rollout_pb2.PromptGroup, _Mapping]]] = ...) -> None: ...

class SubmitGroupsResponse(_message.Message):
    __slots__ = ("accepted_group_ids", "free_slots")
    ACCEPTED_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    accepted_group_ids: _containers.RepeatedScalarFieldContainer[str]
    free_slots: int
    def __init__(self, accepted_group_ids: _Optional[_Iterable[str]] = ..., free_slots: _Optional[int] = ...) -> None: ...

class CollectResultsRequest(_message.Message):
    __slots__ = ("max_groups", "max_wait")
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_FIELD_NUMBER: _ClassVar[int]
    max_groups: int
    max_wait: _duration_pb2.Duration
    def __init__(self, max_groups: _Optional[int] = ..., max_wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CollectResultsResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: _rollout_pb2.GroupResult
    def __init__(self, result: _Optional[_Union[_rollout_pb2.GroupResult, _Mapping]] = ...) -> None: ...

class AckResultsRequest(_message.Message):
    __slots__ = ("group_ids",)
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckResultsResponse(_message.Message):
    __slots__ = ("acknowledged", "ignored")
    ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    IGNORED_FIELD_NUMBER: _ClassVar[int]
    acknowledged: int
    ignored: int
    def __init__(self, acknowledged: _Optional[int] = ..., ignored: _Optional[int] = ...) -> None: ...

class CollectResultBatchRequest(_message.Message):
    __slots__ = ("ack_group_ids", "max_groups", "max_wait")
    ACK_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_FIELD_NUMBER: _ClassVar[int]
    ack_group_ids: _containers.RepeatedScalarFieldContainer[str]
    max_groups: int
    max_wait: _duration_pb2.Duration
    def __init__(self, ack_group_ids: _Optional[_Iterable[str]] = ..., max_groups: _Optional[int] = ..., max_wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CollectResultBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[_rollout_pb2.GroupResult]
    def __init__(self, results: _Optional[_Iterable[_Union[_rollout_pb2.GroupResult, _Mapping]]] = ...) -> None: ...

class CancelGroupsRequest(_message.Message):
    __slots__ = ("group_ids",)
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelGroupsResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: int
    def __init__(self, cancelled: _Optional[int] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("versions", "weights_address", "request_id", "policy_weights_addresses")
    class PolicyWeightsAddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_WEIGHTS_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[_version_pb2.PolicyVersion]
    weights_address: str
    request_id: str
    policy_weights_addresses: _containers.ScalarMap[str, str]
    def __init__(self, versions: _Optional[_Iterable[_Union[_version_pb2.PolicyVersion, _Mapping]]] = ..., weights_address: _Optional[str] = ..., request_id: _Optional[str] = ..., policy_weights_addresses: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("loaded_versions", "fetched_bytes")
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    loaded_versions: _containers.RepeatedCompositeFieldContainer[_version_pb2.PolicyVersion]
    fetched_bytes: int
    def __init__(self, loaded_versions: _Optional[_Iterable[_Union[_version_pb2.PolicyVersion, _Mapping]]] = ..., fetched_bytes: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("instance_id", "capacity", "free_slots", "running_groups", "pending_results", "loaded_versions", "policy_ids", "workflows", "engine", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PENDING_RESULTS_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKFLOWS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    capacity: int
    free_slots: int
    running_groups: int
    pending_results: int
    loaded_versions: _containers.RepeatedCompositeFieldContainer[_version_pb2.PolicyVersion]
    policy_ids: _containers.RepeatedScalarFieldContainer[str]
    workflows: _containers.RepeatedScalarFieldContainer[str]
    engine: str
    counters: _containers.ScalarMap[str, int]
    def __init__(self, instance_id: _Optional[str] = ..., capacity: _Optional[int] = ..., free_slots: _Optional[int] = ..., running_groups: _Optional[int] = ..., pending_results: _Optional[int] = ..., loaded_versions: _Optional[_Iterable[_Union[_version_pb2.PolicyVersion, _Mapping]]] = ..., policy_ids: _Optional[_Iterable[str]] = ..., workflows: _Optional[_Iterable[str]] = ..., engine: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities",)
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    capabilities: _capabilities_pb2.Capabilities
    def __init__(self, capabilities: _Optional[_Union[_capabilities_pb2.Capabilities, _Mapping]] = ...) -> None: ...
