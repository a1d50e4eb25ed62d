"""The faulty-weights check of `astra raas check --serve-weights`: the checker acts as a
WeightService that serves corrupt data, and the instance must refuse it.

A mixin of astra.clients.raas_check.RaasChecker. It starts, on 127.0.0.1, a WeightService of its
own (a temporary store) whose FetchVersion damages every tensor chunk on the way out (one
byte flipped: no tensor matches its Adler-32; or half the bytes dropped: truncated), publishes
there the next version of the policy and asks the instance to load it, once per fault. An engine that verifies what it fetches refuses (an error status) and
keeps the version it serves; one that accepts it (OK, or a changed version in GetStatus) would
train on garbage. A delta on the wrong base is not served yet. An engine may refuse truncated
data only when its fetch deadline passes (Astra's: DEADLINE_EXCEEDED after its fetch timeout),
so this check can take that long per fault (at most CheckOptions.load_timeout_s).
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


FAULTS = ("corrupt", "truncated")


async def start_faulty_weights(store_dir: str, fault: str) -> Any:
    """A real WeightService over `store_dir` whose fetched chunks are damaged (a fake server):
    "corrupt" flips their first byte, "truncated" sends only their first half."""
    from astra.servers.weights import SERVICE_NAME, WeightServicer
    from astra.servers.weights_serve import WeightServer, add_weight_service
    from astra.weights.store import Store, StoreConfig
    from astra.weights.v1 import weight_service_pb2 as wpb

    class FaultyWeightServicer(WeightServicer):
        async def FetchVersion(self, request_iterator, context):
            async for resp in super().FetchVersion(request_iterator, context):
                msg = wpb.FetchVersionResponse.FromString(resp) if isinstance(resp, bytes) else resp
                if msg.WhichOneof("part") == "chunk" and msg.chunk.data:
                    data = bytearray(msg.chunk.data)
                    if fault == "corrupt":
                        data[0] ^= 0xFF
                    else:
                        del data[len(data) // 2 :]
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

        seen = []
        for n, fault in enumerate(FAULTS, 1):
            newer = version_pb2.PolicyVersion(
                policy_id=self.policy,
                version=self.loaded.version + n,
                version_id=f"conformance-{fault}-{self.run_id}",
            )
            with tempfile.TemporaryDirectory(prefix="astra-raas-check-") as store:
                server = await start_faulty_weights(store, fault)
                try:
                    tensor = ("F32", [256], np.arange(256, dtype=np.float32).tobytes())
                    await publish_version(
                        server.address, self.policy, newer.version_id, newer.version, {"w": tensor}
                    )
                    r = await rpc(
                        self.client.load_weights(
                            [newer],
                            server.address,
                            f"conformance-{self.run_id}-{fault}",
                            timeout_s=self.options.load_timeout_s,
                        )
                    )
                finally:
                    await server.stop(0)
            if r.code == grpc.StatusCode.OK:
                raise CheckFailed(
                    f"loaded {newer.version_id}, served {fault} (tensors that do not match "
                    "their Adler-32 or their size): OK"
                )
            if (now := await self._held()) != self.loaded.version:
                raise CheckFailed(
                    f"{fault} weights refused ({r.code.name}), yet GetStatus says version {now}"
                )
            seen.append(f"{fault}: {r.code.name} {r.reason}")
        return f"{'; '.join(seen)}; version {self.loaded.version} still in service"
