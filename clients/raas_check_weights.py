"""The LoadWeights checks of `astra raas check` (with --weights HOST:PORT --version ID).

A set of checks on astra.clients.raas_check_session.CheckSession, joined in
astra.clients.raas_check.RaasChecker: with a WeightService that holds a
version of the policy, the instance must load it and show it in GetStatus, answer
retries and the same versions under a new request id at once, refuse an older
version (VERSION_REGRESSION) and keep the loaded one, refuse a request id reused for
other versions (REQUEST_ID_REUSED), and stamp every token it generates afterwards
with the loaded version (what Dataflow's staleness bound reads), every token id below the
`vocab_size` of the loaded version's config.json.
"""

from __future__ import annotations

import json

import grpc

from astra.clients.raas_check_session import CheckSession
from astra.clients.raas_rules import CheckFailed, Skipped, rpc
from astra.common.arrays import from_array
from astra.common.v1 import version_pb2


class WeightChecks(CheckSession):
    async def load_weights(self) -> str:
        if not (self.options.weights and self.options.version_id):
            raise Skipped("needs --weights HOST:PORT and --version ID")
        self._needs("policy")
        from astra.clients.weights import WeightClient

        async with WeightClient(self.options.weights) as weights:
            info = (await weights.get_version(self.policy, self.options.version_id)).version
        want = version_pb2.PolicyVersion(
            policy_id=self.policy, version=info.version, version_id=info.version_id
        )
        held = await self._held()
        if held is not None and held > want.version:
            raise Skipped(f"the instance holds version {held}, newer than {want.version}")
        r = await rpc(self._load([want], f"conformance-{self.run_id}-load"))
        r.expect(grpc.StatusCode.OK)
        got = {(v.policy_id, v.version) for v in r.response.loaded_versions}
        if (self.policy, want.version) not in got:
            raise CheckFailed(
                f"loaded_versions {sorted(got)}, expected ({self.policy}, {want.version})"
            )
        if (now := await self._held()) != want.version:
            raise CheckFailed(f"GetStatus says version {now} after loading {want.version}")
        self.loaded = want
        return f"{self.policy} {want.version_id} (version {want.version}), {r.response.fetched_bytes:,} bytes fetched"

    async def load_weights_is_idempotent(self) -> str:
        self._needs("loaded")
        again = await rpc(self._load([self.loaded], f"conformance-{self.run_id}-load"))
        again.expect(grpc.StatusCode.OK)
        other = await rpc(self._load([self.loaded], f"conformance-{self.run_id}-again"))
        other.expect(grpc.StatusCode.OK)
        for r in (again, other):
            if (self.policy, self.loaded.version) not in {
                (v.policy_id, v.version) for v in r.response.loaded_versions
            }:
                raise CheckFailed(f"loaded_versions {list(r.response.loaded_versions)}")
        return "the same request again, and the same versions under a new request_id: OK"

    async def load_weights_refuses_regression(self) -> str:
        self._needs("loaded")
        if self.loaded.version < 1:
            raise Skipped("the loaded version is 0: nothing older to ask for")
        older = version_pb2.PolicyVersion(
            policy_id=self.policy, version=self.loaded.version - 1, version_id="conformance-older"
        )
        r = await rpc(self._load([older], f"conformance-{self.run_id}-older"))
        text = r.expect(grpc.StatusCode.FAILED_PRECONDITION, "VERSION_REGRESSION")
        if (now := await self._held()) != self.loaded.version:
            raise CheckFailed(f"after the refusal GetStatus says version {now}")
        return f"{text}; version {self.loaded.version} still in service"

    async def load_weights_refuses_reused_request_id(self) -> str:
        self._needs("loaded")
        newer = version_pb2.PolicyVersion(
            policy_id=self.policy, version=self.loaded.version + 1, version_id="conformance-newer"
        )
        r = await rpc(self._load([newer], f"conformance-{self.run_id}-load"))
        return r.expect(grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED")

    async def tokens_carry_the_loaded_version(self) -> str:
        self._needs("loaded")
        g = self._group()
        (await self._submit(g)).expect(grpc.StatusCode.OK)
        if missing := await self._until_collected(g.group_id):
            raise CheckFailed(missing)
        await self.client.ack_results([g.group_id])
        result, _ = self.decoded[g.group_id]
        if result.error is not None or result.invalid is not None:
            raise CheckFailed(f"the group: {result.error or result.invalid}")
        self.after_load = g.group_id
        seen = {(t.min_version, t.max_version) for t in result.per_policy.get(self.policy, [])}
        want = (self.loaded.version, self.loaded.version)
        if seen != {want}:
            raise CheckFailed(
                f"generated tokens carry versions (oldest, newest) {sorted(seen)}, expected {want}"
            )
        return f"every generated token: version {self.loaded.version}"

    async def tokens_within_the_vocabulary(self) -> str:
        """Every token id below the loaded version's config.json `vocab_size` (rollout.proto)."""
        self._needs("loaded")
        if self.after_load is None:
            raise Skipped("needs the group of tokens_carry_the_loaded_version")
        raw = (await self._loaded_tensors()).files.get("config.json")
        vocab = int(json.loads(raw).get("vocab_size") or 0) if raw else 0
        if vocab < 1:
            raise Skipped("the loaded version's config.json names no vocab_size")
        _, wire = self.decoded[self.after_load]
        for i, t in enumerate(wire.result.trajectories):
            for j, s in enumerate(t.sequences):
                where = f"trajectories[{i}].sequences[{j}].token_ids"
                ids = from_array(s.token_ids, where)
                if len(ids) and int(ids.max()) >= vocab:
                    raise CheckFailed(
                        f"{where}: id {int(ids.max())} >= vocab_size {vocab} of the loaded "
                        "version's config.json"
                    )
        return f"every id below vocab_size {vocab}"
