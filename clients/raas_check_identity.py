"""The identity check of `astra raas check --serve-weights`: "already loaded" means by
counter AND identity (rollout_service.proto, LoadWeights; version.proto, PolicyVersion).

A set of checks on astra.clients.raas_check_session.CheckSession, joined in
astra.clients.raas_check.RaasChecker. The checker publishes, on a WeightService of its own
(127.0.0.1, a temporary store), the bytes of the version the instance serves under the same
counter and another identity, and asks the instance to load it. The rule: the same counter
under another identity is not loaded, so the instance fetches it (fetched_bytes > 0) and
serves it (GetStatus names the new identity), neither answering "already loaded" at once
nor refusing it as a regression. An instance that matches by counter alone would keep
serving other bytes than the ones Dataflow believes it holds.
"""

from __future__ import annotations

import tempfile

import grpc

from astra.clients.raas_check_faulty_weights import start_own_weights
from astra.clients.raas_check_session import CheckSession
from astra.clients.raas_rules import CheckFailed, Skipped
from astra.clients.weights_publish import publish_version
from astra.common.v1 import version_pb2


class IdentityChecks(CheckSession):
    async def load_weights_matches_by_identity(self) -> str:
        if not self.options.serve_weights:
            raise Skipped("needs --serve-weights (the checker publishes the version itself)")
        self._needs("loaded")
        loaded = self.loaded
        assert loaded is not None
        held = await self._loaded_tensors()
        same = version_pb2.PolicyVersion(
            policy_id=self.policy,
            version=loaded.version,
            version_id=f"conformance-identity-{self.run_id}",
        )
        tensors = {n: (t.dtype, list(t.shape), t.data.tobytes()) for n, t in held.items()}
        with tempfile.TemporaryDirectory(prefix="astra-raas-check-") as store:
            server = await start_own_weights(store)
            try:
                await publish_version(
                    server.address, self.policy, same.version_id, same.version, tensors,
                    dict(held.files),
                )  # fmt: skip
                r = await self._load_from(server.address, same, "identity")
            finally:
                await server.stop(0)
        what = f"version {same.version} as {same.version_id!r} while serving {loaded.version_id!r}"
        r.expect(grpc.StatusCode.OK)
        fetched = getattr(r.response, "fetched_bytes", 0)
        now = await self._held_id()
        if now != same.version_id:
            raise CheckFailed(
                f"loaded {what}: OK with fetched_bytes {fetched}, yet GetStatus names "
                f"{now!r} (the same counter under another identity is not loaded)"
            )
        if fetched <= 0:
            raise CheckFailed(f"loaded {what} with fetched_bytes {fetched}, expected > 0")
        self.loaded = same
        return f"{what}: fetched {fetched} bytes, serves {now!r}"
