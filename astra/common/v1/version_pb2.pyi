from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyVersion(_message.Message):
    __slots__ = ("policy_id", "version", "version_id")
    POLICY_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_ID_FIELD_NUMBER: _ClassVar[int]
    policy_id: str
    version: int
    version_id: str
    def __init__(self, policy_id: _Optional[str] = ..., version: _Optional[int] = ..., version_id: _Optional[str] = ...) -> None: ...
