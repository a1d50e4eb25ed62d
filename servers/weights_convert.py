"""WeightService wire conversions: store records <-> astra.weights.v1 messages.

Also the request checks every WeightService RPC shares (identities, tensor
headers), so a bad field is refused with INVALID_ARGUMENT naming it before
the store is asked anything.
"""

from __future__ import annotations

import base64

from astra.common.arrays import MAX_DIMS
from astra.errors import InvalidArgument, invalid_field
from astra.servers.checks import MAX_ID_CHARS, check_id
from astra.weights.layout import check_identity
from astra.weights.records import VersionRecord
from astra.weights.safetensors_io import safetensors_dtype, tensor_nbytes
from astra.weights.store_fetch import RAW, XOR_ZSTD, WireTensor
from astra.weights.v1 import weight_service_pb2 as pb

ENCODINGS = {RAW: pb.TENSOR_ENCODING_RAW, XOR_ZSTD: pb.TENSOR_ENCODING_XOR_ZSTD}
KINDS = {"full": pb.VERSION_KIND_FULL, "delta": pb.VERSION_KIND_DELTA}
MAX_HELD = 64
MAX_TENSORS = 1_000_000
MAX_METADATA = 64
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB: a tensor larger than any model's
MAX_METADATA_VALUE = 4096


def identity(value: str, field: str, *, required: bool = True) -> str:
    """A version identity from a request field, INVALID_ARGUMENT naming the field."""
    if not value and not required:
        return value
    try:
        return check_identity(value)
    except InvalidArgument as exc:
        raise invalid_field(field, exc.message, reason="INVALID_IDENTITY") from exc


def version_info(record: VersionRecord, current: bool) -> pb.VersionInfo:
    info = pb.VersionInfo(
        policy_id=record.policy,
        version_id=record.identity,
        version=record.version,
        kind=KINDS[record.kind],
        base_version_id=record.base,
        size_bytes=record.size_bytes,
        num_tensors=record.num_stored_tensors,
        file_sha256=record.file_sha256,
        current=current,
    )
    info.create_time.FromNanoseconds(int(record.create_time * 1e9))
    return info


def tensor_header(t: WireTensor) -> pb.TensorHeader:
    return pb.TensorHeader(
        name=t.name,
        dtype=t.record.dtype,
        shape=list(t.record.shape),
        encoding=ENCODINGS[t.encoding],
        adler32=t.record.adler32,
        size_bytes=t.record.size_bytes,
        encoded_size_bytes=t.encoded_size,
    )


def check_publish_tensor(
    h: pb.TensorHeader, delta_base: str = ""
) -> tuple[str, tuple[int, ...], int | None]:
    """(dtype, shape, frame length or None for raw bytes) of a published tensor header.

    xor+zstd frames only in a publish whose header names a base version.
    """
    encoded: int | None = None
    if h.encoding == pb.TENSOR_ENCODING_XOR_ZSTD:
        if not delta_base:
            raise invalid_field(
                "tensor.encoding",
                "xor+zstd tensors need header.base_version_id",
                reason="INVALID_TENSOR",
            )
        if not 0 < h.encoded_size_bytes <= max_frame_bytes(h.size_bytes):
            raise invalid_field(
                "tensor.encoded_size_bytes",
                f"a frame of 1-{max_frame_bytes(h.size_bytes)} bytes for {h.size_bytes} raw bytes",
                reason="INVALID_TENSOR",
            )
        encoded = h.encoded_size_bytes
    elif h.encoding not in (pb.TENSOR_ENCODING_UNSPECIFIED, pb.TENSOR_ENCODING_RAW):
        raise invalid_field(
            "tensor.encoding", "publishes send raw or xor+zstd tensors", reason="INVALID_TENSOR"
        )
    elif h.encoded_size_bytes not in (0, h.size_bytes):
        raise invalid_field(
            "tensor.encoded_size_bytes", "must equal size_bytes for raw", reason="INVALID_TENSOR"
        )
    if len(h.shape) > MAX_DIMS or any(d < 0 for d in h.shape):
        raise invalid_field(
            "tensor.shape", f"at most {MAX_DIMS} dimensions, each >= 0", reason="INVALID_TENSOR"
        )
    dtype, shape = safetensors_dtype(h.dtype), tuple(h.shape)
    try:
        size = tensor_nbytes(dtype, shape)
    except ValueError as exc:
        raise invalid_field("tensor.dtype", str(exc), reason="INVALID_TENSOR") from exc
    if size > MAX_TENSOR_BYTES:
        raise invalid_field(
            "tensor.shape", f"{size} bytes; at most {MAX_TENSOR_BYTES}", reason="INVALID_TENSOR"
        )
    if h.size_bytes != size:
        raise invalid_field(
            "tensor.size_bytes", f"{size} for {dtype}{list(shape)}", reason="INVALID_TENSOR"
        )
    return dtype, shape, encoded


def max_frame_bytes(size: int) -> int:
    """The largest zstd frame of `size` bytes (zstd's compress bound, plus header slack)."""
    return size + (size >> 8) + 512


def check_publish_header(h: pb.PublishHeader) -> None:
    """The bounds of a PublishHeader's fields."""
    check_id(h.policy_id, "header.policy_id")
    identity(h.version_id, "header.version_id")
    identity(h.base_version_id, "header.base_version_id", required=False)
    if h.version < 0:
        raise invalid_field("header.version", "must be >= 0")
    if not 0 <= h.num_tensors <= MAX_TENSORS:
        raise invalid_field("header.num_tensors", f"must be 0-{MAX_TENSORS}")
    if len(h.metadata) > MAX_METADATA:
        raise invalid_field("header.metadata", f"more than {MAX_METADATA} entries")
    for key, value in h.metadata.items():
        check_id(key, "header.metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise invalid_field(
                f"header.metadata[{key}]", f"longer than {MAX_METADATA_VALUE} characters"
            )


def publish_accepted(session) -> pb.PublishAccepted:
    """What an earlier attempt staged: names, and what the client compares before it skips."""
    out = pb.PublishAccepted(held_tensors=session.held)
    for name, rec in session.held_records():
        out.held.add(
            name=name, dtype=rec.dtype, shape=list(rec.shape), adler32=rec.adler32,
            size_bytes=rec.size_bytes,
        )  # fmt: skip
    return out


def page_from_token(token: str) -> int | None:
    """ListVersions' page_token back to the version it continues below (None: the first)."""
    if not token:
        return None
    if len(token) > MAX_ID_CHARS:
        raise invalid_field("page_token", "not a token this service issued")
    try:
        return int(base64.urlsafe_b64decode(token.encode()).decode())
    except ValueError as exc:
        raise invalid_field("page_token", "not a token this service issued") from exc


def page_token(below: int) -> str:
    """The page_token of the page that continues below version `below`."""
    return base64.urlsafe_b64encode(str(below).encode()).decode()
