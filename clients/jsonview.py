"""A protobuf message as plain JSON data for people and scripts: 64-bit integers as numbers.

The proto3 JSON mapping writes int64 and uint64 as strings (JavaScript cannot hold every such
value); `astra status` is read by people and by `jq`, whose counters never come near 2^53, so
`as_dict` turns them back into numbers, guided by each field's declared type (never by what a
string looks like). Field names stay as the proto spells them.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

_WIDE = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def as_dict(message: Message) -> dict[str, Any]:
    """`message` as a dict (every field present, defaults included), 64-bit ints as ints."""
    data = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(message.DESCRIPTOR, data)


def _numbers(desc: Descriptor, data: dict[str, Any]) -> dict[str, Any]:
    for f in desc.fields:
        if f.name not in data:
            continue
        value = data[f.name]
        kind = f.message_type
        if kind is not None and kind.GetOptions().map_entry:
            inner = kind.fields_by_name["value"]
            data[f.name] = {k: _one(inner, v) for k, v in value.items()}
        elif f.is_repeated:
            data[f.name] = [_one(f, v) for v in value]
        else:
            data[f.name] = _one(f, value)
    return data


def _one(f: FieldDescriptor, value: Any) -> Any:
    if f.message_type is not None:
        if f.message_type.full_name.startswith("google.protobuf.") or not isinstance(value, dict):
            return value  # well-known types keep their JSON form (a Timestamp's RFC 3339)
        return _numbers(f.message_type, value)
    if f.type in _WIDE and isinstance(value, str):
        return int(value)
    return value
