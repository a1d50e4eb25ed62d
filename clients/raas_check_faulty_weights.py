"""The faulty-weights check of `astra raas check --serve-weights`: the checker acts as a
WeightService that serves damaged data, and the instance must not serve it.

A set of checks on astra.clients.raas_check_session.CheckSession, joined in
astra.clients.raas_check.RaasChecker. It starts, on 127.0.0.1, a WeightService of its
own (a temporary store), publishes there the next version of the policy and asks the
instance to load it, once per fault:
- corrupt: FetchVersion flips the first byte of every tensor chunk on the way out (no
  tensor matches its Adler-32);
- truncated: it sends only the first half of every chunk;
- wrong-base: the store holds the identity the instance serves, with other bytes, and
  the new version as an xor+zstd delta against those; an instance that offers its version
  as the delta's base gets frames that, applied to its real bytes, match no Adler-32.
An engine that verifies what it fetches refuses (an error status) and keeps the version it
serves, or (wrong-base only) distrusts its base and fetches the version again in full; one
that accepts the damaged bytes would train on garbage. An engine may refuse truncated data
only when its fetch deadline passes (Astra's: DEADLINE_EXCEEDED after its fetch timeout), so
this check can take that long per fault (at most CheckOptions.load_timeout_s).
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

import grpc
import numpy as np

from astra.clients.raas_check_session import CheckSession
from astra.clients.raas_rules import CheckFailed, Skipped
from astra.common.v1 import version_pb2

FAULTS = ("corrupt", "truncated", "wrong-base")
Tensors = dict[str, tuple[str, list[int], bytes]]


async def start_own_weights(store_dir: str, fault: str = "") -> Any:
    """A real WeightService over `store_dir` (a fake server when `fault` is set): "corrupt" flips
    the first byte of every fetched chunk, "truncated" sends only its first half; any other
    fault sends what the store holds. `server.servicer.plans` lists each FetchPlan it sent
    as its base_version_id ("" for a full version)."""
    from astra.servers.weights import SERVICE_NAME, WeightServicer
    from astra.servers.weights_serve import WeightServer, add_weight_service
    from astra.weights.store import Store, StoreConfig
    from astra.weights.v1 import weight_service_pb2 as wpb

    class CheckerWeightServicer(WeightServicer):
        plans: list[str]

        async def FetchVersion(self, request_iterator, context):
            async for resp in super().FetchVersion(request_iterator, context):
                msg = wpb.FetchVersionResponse.FromString(resp) if isinstance(resp, bytes) else resp
                part = msg.WhichOneof("part")
                if part == "plan":
                    self.plans.append(msg.plan.base_version_id)
                if part == "chunk" and msg.chunk.data and fault in ("corrupt", "truncated"):
                    data = bytearray(msg.chunk.data)
                    if fault == "corrupt":
                        data[0] ^= 0xFF
                    else:
                        del data[len(data) // 2 :]
                    msg.chunk.data = bytes(data)
                yield msg.SerializeToString()

    server = WeightServer("127.0.0.1", 0, grace_s=0.0)
    server.store = await asyncio.to_thread(Store, store_dir, StoreConfig(durable=False))
    server.servicer = CheckerWeightServicer(server.store)
    server.servicer.plans = []
    server.add_service(add_weight_service, server.servicer, SERVICE_NAME)
    await server.start(serving=True)
    return server


class FaultyWeightChecks(CheckSession):
    async def _publish_fault(self, address: str, fault: str, newer: Any) -> None:
        from astra.clients.weights_publish import publish_version

        if fault != "wrong-base":
            tensor = ("F32", [256], np.arange(256, dtype=np.float32).tobytes())
            await publish_version(
                address, self.policy, newer.version_id, newer.version, {"w": tensor}
            )
            return
        assert self.loaded is not None
        held = await self._loaded_tensors()
        real: Tensors = {n: (t.dtype, list(t.shape), t.data.tobytes()) for n, t in held.items()}
        other: Tensors = {
            n: (t.dtype, list(t.shape), (t.data ^ np.uint8(0x5A)).tobytes())
            for n, t in held.items()
        }
        files = dict(held.files)
        loaded = self.loaded
        await publish_version(address, self.policy, loaded.version_id, loaded.version, other, files)
        await publish_version(
            address, self.policy, newer.version_id, newer.version, real, files,
            base=(loaded.version_id, other),
        )  # fmt: skip

    async def load_weights_refuses_corrupt_data(self) -> str:
        if not self.options.serve_weights:
            raise Skipped("needs --serve-weights (the checker serves corrupt weights itself)")
        self._needs("loaded")
        loaded = self.loaded
        assert loaded is not None  # _needs("loaded") skipped the check otherwise
        seen = []
        for n, fault in enumerate(FAULTS, 1):
            newer = version_pb2.PolicyVersion(
                policy_id=self.policy,
                version=loaded.version + n,
                version_id=f"conformance-{fault}-{self.run_id}",
            )
            with tempfile.TemporaryDirectory(prefix="astra-raas-check-") as store:
                server = await start_own_weights(store, fault)
                try:
                    await self._publish_fault(server.address, fault, newer)
                    r = await self._load_from(server.address, newer, fault)
                    plans = list(server.servicer.plans)
                finally:
                    await server.stop(0)
            if fault == "wrong-base" and r.code == grpc.StatusCode.OK:
                seen.append(self._recovered(plans, loaded.version_id, newer))
                self.loaded = newer
                break  # the instance serves `newer` now: the last fault
            if r.code == grpc.StatusCode.OK:
                raise CheckFailed(
                    f"loaded {newer.version_id}, served {fault} (tensors that do not match "
                    "their Adler-32 or their size): OK"
                )
            if (now := await self._held()) != loaded.version:
                raise CheckFailed(
                    f"{fault} weights refused ({r.code.name}), yet GetStatus says version {now}"
                )
            seen.append(f"{fault}: {r.code.name} {r.reason}")
        serving = self.loaded or loaded
        return f"{'; '.join(seen)}; version {serving.version} in service"

    @staticmethod
    def _recovered(plans: list[str], base: str, newer: Any) -> str:
        """A wrong-base load that answered OK: right only if the instance fetched it in full
        after the delta (or never took the delta)."""
        if base not in plans:
            return f"wrong-base: OK, the instance never offered {base!r} as a base (plans {plans})"
        if "" not in plans[plans.index(base) + 1 :]:
            raise CheckFailed(
                f"loaded {newer.version_id} from a delta against a base whose bytes differ from "
                f"the {base!r} it holds, with no full fetch after it (plans {plans}): its "
                "tensors do not match their Adler-32"
            )
        return "wrong-base: OK after the delta failed, fetched again in full"
