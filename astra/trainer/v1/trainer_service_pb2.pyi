import datetime

from astra.common.v1 import capabilities_pb2 as _capabilities_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("policy_id", "step", "version", "loss", "metrics", "last_checkpoint_path", "last_checkpoint_time", "world_size", "paused", "pause_reason", "step_in_progress")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_TIME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PAUSE_REASON_FIELD_NUMBER: _ClassVar[int]
    STEP_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    step: int
    version: int
    loss: float
    metrics: _containers.ScalarMap[str, float]
    last_checkpoint_path: str
    last_checkpoint_time: _timestamp_pb2.Timestamp
    world_size: int
    paused: bool
    pause_reason: str
    step_in_progress: bool
    def __init__(self, policy_id: _Optional[str] = ..., step: _Optional[int] = ..., version: _Optional[int] = ..., loss: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., last_checkpoint_path: _Optional[str] = ..., last_checkpoint_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., world_size: _Optional[int] = ..., paused: _Optional[bool] = ..., pause_reason: _Optional[str] = ..., step_in_progress: _Optional[bool] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("reason", "wait")
    REASON_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    wait: bool
    def __init__(self, reason: _Optional[str] = ..., wait: _Optional[bool] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("step", "idle")
    STEP_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    step: int
    idle: bool
    def __init__(self, step: _Optional[int] = ..., idle: _Optional[bool] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("step", "paused_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    paused_seconds: float
    def __init__(self, step: _Optional[int] = ..., paused_seconds: _Optional[float] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities",)
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    capabilities: _capabilities_pb2.Capabilities
    def __init__(self, capabilities: _Optional[_Union[_capabilities_pb2.Capabilities, _Mapping]] = ...) -> None: ...
