"""The bulk messages of the weight streams, encoded and decoded without protobuf objects.

A chunk message (FetchVersionResponse or PublishVersionRequest whose part is
a TensorChunk) is nearly all payload; building it through protobuf copies the
payload three times (into the message, into its serialization, out of the
parsed message). Here a chunk is written as its wire bytes directly (one copy
of the payload, from a memoryview of the source) and read back as a
memoryview into the received bytes (no copy). The bytes are exactly what
protobuf writes and reads (field numbers of weight_service.proto); any
message that is not a plain chunk goes through protobuf as before, so
either side may be a stock protobuf peer. Knows nothing of gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from astra.protowire import LEN, VARINT, read_varint, varint

# Field 3 (chunk) of FetchVersionResponse and of PublishVersionRequest, length-delimited.
CHUNK_TAG = (3 << 3) | LEN
_OFFSET_TAG = (1 << 3) | VARINT  # TensorChunk.offset, varint
_DATA_TAG = (2 << 3) | LEN  # TensorChunk.data, length-delimited


class WireChunk:
    """A received TensorChunk whose data is a view into the received message (no copy).

    Duck-types the protobuf message the streams read: `WhichOneof("part")` is
    "chunk" and `.chunk.offset` / `.chunk.data` are the fields.
    """

    __slots__ = ("data", "offset")

    def __init__(self, offset: int, data: memoryview) -> None:
        self.offset, self.data = offset, data

    @property
    def chunk(self) -> WireChunk:
        return self

    def WhichOneof(self, _group: str) -> str:  # protobuf's name
        return "chunk"

    def HasField(self, name: str) -> bool:  # protobuf's name
        return name == "chunk"


def chunk_message(offset: int, data: Any) -> bytes:
    """The wire bytes of a message whose part is TensorChunk(offset, data)."""
    view = memoryview(data).cast("B")
    inner = (bytes((_OFFSET_TAG,)) + varint(offset) if offset else b"") + bytes((_DATA_TAG,))
    inner += varint(view.nbytes)
    return b"".join((bytes((CHUNK_TAG,)), varint(len(inner) + view.nbytes), inner, view))


def parse_chunk(raw: bytes) -> WireChunk | None:
    """The chunk a message's wire bytes hold when the message is exactly one chunk, else None."""
    try:
        if len(raw) < 3 or raw[0] != CHUNK_TAG:
            return None
        size, pos = read_varint(raw, 1)
        if pos + size != len(raw):
            return None
        offset = 0
        if pos < len(raw) and raw[pos] == _OFFSET_TAG:  # an empty chunk ends here
            offset, pos = read_varint(raw, pos + 1)
        if pos >= len(raw) or raw[pos] != _DATA_TAG:
            return None
        size, pos = read_varint(raw, pos + 1)
        if pos + size != len(raw):
            return None
    except ValueError:
        return None
    return WireChunk(offset, memoryview(raw)[pos:])


def serialize(message: Any) -> bytes:
    """A response serializer: wire bytes pass through, messages are serialized."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


def deserializer(from_string: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A deserializer reading plain chunks as WireChunk and anything else with protobuf."""

    def parse(raw: bytes) -> Any:
        chunk = parse_chunk(raw)
        return chunk if chunk is not None else from_string(raw)

    return parse
