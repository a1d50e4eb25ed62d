"""WeightService servicer: proto -> `Store` -> proto (the server: servers/weights_serve.py).

The two streams live in weights_publish.py and weights_fetch.py; the unary
RPCs are here. Blocking store work runs on worker threads so one slow
encode never stalls other streams. Errors are domain errors, mapped to
statuses by the server's interceptor.

Bulk messages skip protobuf objects (astra.weights.wire): FetchVersion's
chunks are yielded as their wire bytes and pass the response serializer
untouched, and PublishVersion's chunks are parsed as views into the received
bytes; every other message, and any peer, uses protobuf as before (the bytes
on the wire are the same). Chunk size: just under 4 MiB (gRPC's default
receive limit, so stock receivers still work); with protobuf copies gone the
per-message cost is what larger chunks save. gRPC's default flow control
(BDP probing) did as well as a fixed 64 MiB window, so it stays.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from astra import __version__
from astra.common.v1 import capabilities_pb2
from astra.errors import invalid_field
from astra.servers.checks import check_id
from astra.servers.weights_convert import (
    identity,
    page_from_token,
    page_token,
    tensor_header,
    version_info,
)
from astra.servers.weights_fetch import StreamSettings, fetch_stream
from astra.servers.weights_publish import publish_stream
from astra.weights.store import Store
from astra.weights.store_fetch import stored_tensors
from astra.weights.v1 import weight_service_pb2 as pb
from astra.weights.v1 import weight_service_pb2_grpc as pb_grpc
from astra.weights.views import heads, receiver_versions, version_page

log = logging.getLogger(__name__)
CONTRACT_VERSION = "1.0.0"
FEATURES = ["delta_xor_zstd", "chain_compose", "relay", "bandwidth_cap", "publish_xor_zstd"]
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WeightService"].full_name


class WeightServicer(pb_grpc.WeightServiceServicer):
    def __init__(self, store: Store, settings: StreamSettings | None = None) -> None:
        self.store = store
        self.settings = settings or StreamSettings()
        self.active_fetches = 0
        self.metrics: Any = None  # astra.weights.metrics.WeightMetrics when /metrics is served

    def _observe(self, kind: str, started: float, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_stream(kind, time.perf_counter() - started, outcome)

    def _is_current(self, policy: str, record) -> bool:
        return record is self.store.chain(policy).head

    async def PublishVersion(self, request_iterator, context) -> AsyncIterator:
        first_timeout = self.settings.first_message_timeout_s
        started, outcome = time.perf_counter(), "error"
        try:
            async for resp in publish_stream(self.store, request_iterator, first_timeout):
                yield resp
            outcome = "ok"
        finally:
            self._observe("publish", started, outcome)

    async def FetchVersion(self, request_iterator, context) -> AsyncIterator:
        self.active_fetches += 1
        started, outcome = time.perf_counter(), "error"
        try:
            async for resp in fetch_stream(self.store, request_iterator, self.settings):
                yield resp
            outcome = "ok"
        finally:
            self.active_fetches -= 1
            self._observe("fetch", started, outcome)

    async def ListVersions(self, request: pb.ListVersionsRequest, context):
        check_id(request.policy_id, "policy_id")
        size = request.page_size or 100
        if not 1 <= size <= 1000:
            raise invalid_field("page_size", "must be 1-1000")
        page, next_below = version_page(
            self.store, request.policy_id, page_from_token(request.page_token), size
        )
        resp = pb.ListVersionsResponse(
            versions=[version_info(r, self._is_current(request.policy_id, r)) for r in page]
        )
        if next_below is not None:
            resp.next_page_token = page_token(next_below)
        return resp

    async def GetVersion(self, request: pb.GetVersionRequest, context):
        check_id(request.policy_id, "policy_id")
        identity(request.version_id, "version_id")
        record = self.store.get(request.policy_id, request.version_id)
        tensors = await asyncio.to_thread(
            stored_tensors, self.store, request.policy_id, request.version_id
        )
        return pb.GetVersionResponse(
            version=version_info(record, self._is_current(request.policy_id, record)),
            tensors=[tensor_header(t) for t in tensors],
        )

    async def RollbackVersion(self, request: pb.RollbackVersionRequest, context):
        check_id(request.policy_id, "policy_id")
        identity(request.source_version_id, "source_version_id")
        identity(request.new_version_id, "new_version_id")
        check_id(request.request_id, "request_id")
        if request.new_version < 0:
            raise invalid_field("new_version", "must be >= 0")
        record = await asyncio.to_thread(
            self.store.rollback,
            request.policy_id,
            request.source_version_id,
            request.new_version_id,
            request.new_version,
            request.request_id,
        )
        return pb.RollbackVersionResponse(
            version=version_info(record, self._is_current(request.policy_id, record))
        )

    async def GetStatus(self, request: pb.GetStatusRequest, context):
        return pb.GetStatusResponse(
            current_versions=[version_info(head, True) for head in heads(self.store)],
            active_fetches=self.active_fetches,
            receivers=receiver_versions(self.store),
            counters=dict(self.store.counters),
        )

    async def GetCapabilities(self, request: pb.GetCapabilitiesRequest, context):
        return pb.GetCapabilitiesResponse(
            capabilities=capabilities_pb2.Capabilities(
                contract_version=CONTRACT_VERSION,
                features=FEATURES,
                implementation="astra-weights",
                implementation_version=__version__,
            )
        )
