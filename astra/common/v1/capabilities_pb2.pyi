from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Capabilities(_message.Message):
    __slots__ = ("contract_version", "features", "implementation", "implementation_version")
    CONTRACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    IMPLEMENTATION_VERSION_FIELD_NUMBER: _ClassVar[int]
    contract_version: str
    features: _containers.RepeatedScalarFieldContainer[str]
    implementation: str
    implementation_version: str
    def __init__(self, contract_version: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ..., implementation: _Optional[str] = ..., implementation_version: _Optional[str] = ...) -> None: ...
