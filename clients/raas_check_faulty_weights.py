"""The faulty-weights check of `astra raas check --serve-weights`: the checker acts as a
WeightService that serves corrupt data, and the instance must refuse it.

A mixin of astra.clients.raas_check.RaasChecker. It starts, on 127.0.0.1, a WeightService of its
own (a temporary store) whose FetchVersion flips a byte of every tensor chunk on the way out,
so no tensor matches its Adler-32; it publishes there the next version of the policy and asks
the instance to load it. An engine that verifies what it fetches refuses (an error status) and
keeps the version it serves; one that accepts it (OK, or a changed version in GetStatus) would
train on garbage. Truncated data and a delta on the wrong base are not served yet.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from astra.clients.raas_rules import CheckFailed, Skipped, rpc
from astra.common.v1 import version_pb2

if TYPE_CHECKING:
    from astra.clients.raas_check import RaasChecker


async def start_faulty_weights(store_dir: str) -> Any:
    """A real WeightService over `store_dir` whose fetched chunks are corrupted (a fake server)."""
    from astra.servers.weights import (
        SERVICE_NAME,
        WeightServer,
        WeightServicer,
        add_weight_service,
    )
    from astra.weights.store import Store, StoreConfig
    from astra.weights.v1 import weight_service_pb2 as wpb

    class FaultyWeightServicer(WeightServicer):
        async def FetchVersion(self, request_iterator, context):
            async for resp in super().FetchVersion(request_iterator, context):
                msg = wpb.FetchVersionResponse.FromString(resp) if isinstance(resp, bytes) else resp
                if msg.WhichOneof("part") == "chunk" and msg.chunk.data:
                    data = bytearray(msg.chunk.data)
                    data[0] ^= 0xFF
                    msg.chunk.data = bytes(data)
                yield msg.SerializeToString()

    server = WeightServer("127.0.0.1", 0, grace_s=0.0)
    server.store = await asyncio.to_thread(Store, store_dir, StoreConfig(durable=False))
    server.servicer = FaultyWeightServicer(server.store)
    server.add_service(add_weight_service, server.servicer, SERVICE_NAME)
    await server.start(serving=True)
    return server


class FaultyWeightChecks:
    async def load_weights_refuses_corrupt_data(self: RaasChecker) -> str:
        if not self.options.serve_weights:
            raise Skipped("needs --serve-weights (the checker serves corrupt weights itself)")
        self._needs("loaded")
        from astra.clients.weights_publish import publish_version

        newer = version_pb2.PolicyVersion(
            policy_id=self.policy,
            version=self.loaded.version + 1,
            version_id=f"conformance-corrupt-{self.run_id}",
        )
        with tempfile.TemporaryDirectory(prefix="astra-raas-check-") as store:
            server = await start_faulty_weights(store)
            try:
                tensor = ("F32", [256], np.arange(256, dtype=np.float32).tobytes())
                await publish_version(
                    server.address, self.policy, newer.version_id, newer.version, {"w": tensor}
                )
                r = await rpc(
                    self.client.load_weights(
                        [newer],
                        server.address,
                        f"conformance-{self.run_id}-corrupt",
                        timeout_s=self.options.load_timeout_s,
                    )
                )
            finally:
                await server.stop(0)
        if r.code == grpc.StatusCode.OK:
            raise CheckFailed(
                f"loaded {newer.version_id}, whose tensors do not match their Adler-32 (OK)"
            )
        if (now := await self._held()) != self.loaded.version:
            raise CheckFailed(f"refused ({r.code.name}), yet GetStatus says version {now}")
        return f"corrupt chunks refused ({r.code.name} {r.reason}); version {now} still in service"
