import datetime

from astra.common.v1 import capabilities_pb2 as _capabilities_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VersionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_KIND_UNSPECIFIED: _ClassVar[VersionKind]
    VERSION_KIND_FULL: _ClassVar[VersionKind]
    VERSION_KIND_DELTA: _ClassVar[VersionKind]

class TensorEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_ENCODING_UNSPECIFIED: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_RAW: _ClassVar[TensorEncoding]
    TENSOR_ENCODING_XOR_ZSTD: _ClassVar[TensorEncoding]
VERSION_KIND_UNSPECIFIED: VersionKind
VERSION_KIND_FULL: VersionKind
VERSION_KIND_DELTA: VersionKind
TENSOR_ENCODING_UNSPECIFIED: TensorEncoding
TENSOR_ENCODING_RAW: TensorEncoding
TENSOR_ENCODING_XOR_ZSTD: TensorEncoding

class VersionInfo(_message.Message):
    __slots__ = ("policy_id", "version_id", "version", "kind", "base_version_id", "size_bytes", "num_tensors", "create_time", "file_sha256", "current")
    class FileSha256Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    version_id: str
    version: int
    kind: VersionKind
    base_version_id: str
    size_bytes: int
    num_tensors: int
    create_time: _timestamp_pb2.Timestamp
    file_sha256: _containers.ScalarMap[str, str]
    current: bool
    def __init__(self, policy_id: _Optional[str] = ..., version_id: _Optional[str] = ..., version: _Optional[int] = ..., kind: _Optional[_Union[VersionKind, str]] = ..., base_version_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., file_sha256: _Optional[_Mapping[str, str]] = ..., current: _Optional[bool] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "encoding", "adler32", "size_bytes", "encoded_size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    ADLER32_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODED_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    encoding: TensorEncoding
    adler32: str
    size_bytes: int
    encoded_size_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., encoding: _Optional[_Union[TensorEncoding, str]] = ..., adler32: _Optional[str] = ..., size_bytes: _Optional[int] = ..., encoded_size_bytes: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class VersionFile(_message.Message):
    __slots__ = ("name", "content", "same_as_base", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    SAME_AS_BASE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    content: bytes
    same_as_base: bool
    sha256: str
    def __init__(self, name: _Optional[str] = ..., content: _Optional[bytes] = ..., same_as_base: _Optional[bool] = ..., sha256: _Optional[str] = ...) -> None: ...

class TensorAck(_message.Message):
    __slots__ = ("name", "status")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: _status_pb2.Status
    def __init__(self, name: _Optional[str] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("policy_id", "version_id", "version", "num_tensors", "metadata", "base_version_id", "restart")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    version_id: str
    version: int
    num_tensors: int
    metadata: _containers.ScalarMap[str, str]
    base_version_id: str
    restart: bool
    def __init__(self, policy_id: _Optional[str] = ..., version_id: _Optional[str] = ..., version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., base_version_id: _Optional[str] = ..., restart: _Optional[bool] = ...) -> None: ...

class PublishCommit(_message.Message):
    __slots__ = ("num_tensors",)
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    num_tensors: int
    def __init__(self, num_tensors: _Optional[int] = ...) -> None: ...

class PublishVersionRequest(_message.Message):
    __slots__ = ("header", "tensor", "chunk", "file", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    tensor: TensorHeader
    chunk: TensorChunk
    file: VersionFile
    commit: PublishCommit
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., tensor: _Optional[_Union[TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., file: _Optional[_Union[VersionFile, _Mapping]] = ..., commit: _Optional[_Union[PublishCommit, _Mapping]] = ...) -> None: ...

class PublishAccepted(_message.Message):
    __slots__ = ("held_tensors", "held")
    HELD_TENSORS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    held_tensors: _containers.RepeatedScalarFieldContainer[str]
    held: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    def __init__(self, held_tensors: _Optional[_Iterable[str]] = ..., held: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ...) -> None: ...

class PublishCommitted(_message.Message):
    __slots__ = ("version", "already_existed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ALREADY_EXISTED_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    already_existed: bool
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ..., already_existed: _Optional[bool] = ...) -> None: ...

class PublishVersionResponse(_message.Message):
    __slots__ = ("accepted", "tensor_ack", "committed")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ACK_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    accepted: PublishAccepted
    tensor_ack: TensorAck
    committed: PublishCommitted
    def __init__(self, accepted: _Optional[_Union[PublishAccepted, _Mapping]] = ..., tensor_ack: _Optional[_Union[TensorAck, _Mapping]] = ..., committed: _Optional[_Union[PublishCommitted, _Mapping]] = ...) -> None: ...

class FetchStart(_message.Message):
    __slots__ = ("policy_id", "target_version_id", "held_version_ids", "receiver_id", "acknowledged_tensors", "max_bytes_per_second", "accepts_same_as_base_files")
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSION_IDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_SAME_AS_BASE_FILES_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    target_version_id: str
    held_version_ids: _containers.RepeatedScalarFieldContainer[str]
    receiver_id: str
    acknowledged_tensors: _containers.RepeatedScalarFieldContainer[str]
    max_bytes_per_second: int
    accepts_same_as_base_files: bool
    def __init__(self, policy_id: _Optional[str] = ..., target_version_id: _Optional[str] = ..., held_version_ids: _Optional[_Iterable[str]] = ..., receiver_id: _Optional[str] = ..., acknowledged_tensors: _Optional[_Iterable[str]] = ..., max_bytes_per_second: _Optional[int] = ..., accepts_same_as_base_files: _Optional[bool] = ...) -> None: ...

class FetchVersionRequest(_message.Message):
    __slots__ = ("start", "ack")
    START_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    start: FetchStart
    ack: TensorAck
    def __init__(self, start: _Optional[_Union[FetchStart, _Mapping]] = ..., ack: _Optional[_Union[TensorAck, _Mapping]] = ...) -> None: ...

class FetchPlan(_message.Message):
    __slots__ = ("target", "base_version_id", "num_tensors", "total_bytes")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    target: VersionInfo
    base_version_id: str
    num_tensors: int
    total_bytes: int
    def __init__(self, target: _Optional[_Union[VersionInfo, _Mapping]] = ..., base_version_id: _Optional[str] = ..., num_tensors: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class FetchDone(_message.Message):
    __slots__ = ("num_tensors",)
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    num_tensors: int
    def __init__(self, num_tensors: _Optional[int] = ...) -> None: ...

class FetchVersionResponse(_message.Message):
    __slots__ = ("plan", "tensor", "chunk", "file", "done")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    plan: FetchPlan
    tensor: TensorHeader
    chunk: TensorChunk
    file: VersionFile
    done: FetchDone
    def __init__(self, plan: _Optional[_Union[FetchPlan, _Mapping]] = ..., tensor: _Optional[_Union[TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., file: _Optional[_Union[VersionFile, _Mapping]] = ..., done: _Optional[_Union[FetchDone, _Mapping]] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("policy_id", "page_size", "page_token")
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    page_size: int
    page_token: str
    def __init__(self, policy_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions", "next_page_token")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    next_page_token: str
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetVersionRequest(_message.Message):
    __slots__ = ("policy_id", "version_id")
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    version_id: str
    def __init__(self, policy_id: _Optional[str] = ..., version_id: _Optional[str] = ...) -> None: ...

class GetVersionResponse(_message.Message):
    __slots__ = ("version", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ...) -> None: ...

class RollbackVersionRequest(_message.Message):
    __slots__ = ("policy_id", "source_version_id", "new_version_id", "new_version", "request_id")
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    source_version_id: str
    new_version_id: str
    new_version: int
    request_id: str
    def __init__(self, policy_id: _Optional[str] = ..., source_version_id: _Optional[str] = ..., new_version_id: _Optional[str] = ..., new_version: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class RollbackVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("current_versions", "active_fetches", "receivers", "counters")
    class ReceiversEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CURRENT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FETCHES_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    current_versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    active_fetches: int
    receivers: _containers.ScalarMap[str, str]
    counters: _containers.ScalarMap[str, int]
    def __init__(self, current_versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ..., active_fetches: _Optional[int] = ..., receivers: _Optional[_Mapping[str, str]] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities",)
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    capabilities: _capabilities_pb2.Capabilities
    def __init__(self, capabilities: _Optional[_Union[_capabilities_pb2.Capabilities, _Mapping]] = ...) -> None: ...
