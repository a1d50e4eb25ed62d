"""Checks a RolloutService implementation against the RaaS contract (`astra raas check ADDRESS`).

For engine authors: each check is one rule of rollout_service.proto, run over the
wire against a live server. A check passes, fails (saying what the contract
expects and what came), warns (a recommendation, not a rule), or is skipped (a
feature the server does not list in GetCapabilities, an optional RPC it answers
UNIMPLEMENTED, or a check that needs an earlier one). Results are validated by the
decoder Dataflow itself uses (`decode_results`), so a group that passes here is one
Dataflow trains on.

The checks run real groups, one sample of `max_new_tokens` tokens or two at a
time; point them at an instance that is not registered with a Dataflow, or
Dataflow's own groups change the counts the checks read. An instance that runs or
holds groups when the checks start is refused (InstanceInUse) unless
`allow_busy` is set: the checks would race whoever submitted them.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from astra.clients.raas import RolloutClient
from astra.clients.raas_check_batch import BatchChecks
from astra.clients.raas_check_faulty_weights import FaultyWeightChecks
from astra.clients.raas_check_identity import IdentityChecks
from astra.clients.raas_check_registration import RegistrationChecks
from astra.clients.raas_check_session import CheckOptions
from astra.clients.raas_check_trajectories import TrajectoryChecks
from astra.clients.raas_check_weights import WeightChecks
from astra.clients.raas_rules import (
    Check,
    CheckFailed,
    Skipped,
    Warned,
    rpc,
)
from astra.common.v1 import version_pb2
from astra.raas.v1 import rollout_service_pb2 as pb

__all__ = ["CHECKS", "CheckOptions", "RaasChecker"]

CONTRACT_MAJOR = "1"
MAX_WAIT_S = 30.0  # CollectResults.max_wait bound (rollout_service.proto)
# In order: each is the name of a method (here or in a check set it joins) that returns what
# it saw.
CHECKS = (
    "health",
    "reflection",
    "capabilities",
    "status",
    "registers",
    "registration_matches_status",
    "heartbeats",
    "submit_rejects_empty",
    "submit_rejects_duplicate_ids",
    "submit_rejects_unknown_policy",
    "submit_rejects_unknown_workflow",
    "submit_rejects_bad_sampling",
    "submit_refuses_over_capacity",
    "collect_rejects_long_wait",
    "collect_rejects_zero_max_groups",
    "submit",
    "submit_is_idempotent",
    "collect",
    "trajectories_are_well_formed",
    "collect_repeats_until_ack",
    "ack",
    "ack_removes_the_result",
    "ack_ignores_unknown_ids",
    "cancel",
    "cancel_keeps_a_finished_result",
    "batch_rejects_bad_fields",
    "batch_collect",
    "batch_repeats_until_ack",
    "batch_oldest_first_within_max_groups",
    "batch_acks_before_collecting",
    "batch_ack_removes_the_result",
    "load_weights_rejects_bad_requests",
    "load_weights",
    "claims_loaded_version",
    "load_weights_is_idempotent",
    "load_weights_refuses_regression",
    "load_weights_refuses_reused_request_id",
    "tokens_carry_the_loaded_version",
    "tokens_within_the_vocabulary",
    "load_weights_matches_by_identity",
    "load_weights_refuses_corrupt_data",
    "reregisters_on_not_found",
    "settles",
)


class RaasChecker(
    WeightChecks,
    TrajectoryChecks,
    BatchChecks,
    IdentityChecks,
    FaultyWeightChecks,
    RegistrationChecks,
):
    """Every check, in CHECKS order, against the instance at `address`."""

    async def run(self) -> list[Check]:
        """Every check in order, each on its own; the list of what they found."""
        self.client = RolloutClient(self.address, timeout_s=self.options.call_timeout_s)
        try:
            await self._refuse_if_busy()
            for name in CHECKS:
                try:
                    self.results.append(Check(name, "pass", await getattr(self, name)()))
                except CheckFailed as exc:
                    self.results.append(Check(name, "fail", str(exc)))
                except Skipped as exc:
                    self.results.append(Check(name, "skip", str(exc)))
                except Warned as exc:
                    self.results.append(Check(name, "warn", str(exc)))
                except grpc.aio.AioRpcError as exc:
                    text = f"unexpected {exc.code().name}: {exc.details()}"
                    self.results.append(Check(name, "fail", text))
                except Exception as exc:  # a response the checker cannot read: that server's
                    text = f"unexpected {type(exc).__name__}: {exc}"
                    self.results.append(Check(name, "fail", text))
        finally:
            await self.client.close()
        return self.results

    # ----- checks ----------------------------------------------------------------------------

    async def health(self) -> str:
        r = await rpc(self.client.check_health())
        if r.code != grpc.StatusCode.OK:
            raise CheckFailed(f"grpc.health.v1 Check({RolloutClient.SERVICE!r}): {r.code.name}")
        if not r.response:
            raise CheckFailed("not SERVING (the contract: SERVING once the model is loaded)")
        return "SERVING"

    async def reflection(self) -> str:
        stub = reflection_pb2_grpc.ServerReflectionStub(self.client.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        try:
            call = stub.ServerReflectionInfo(iter([request]), timeout=self.options.call_timeout_s)
            names = [s.name async for r in call for s in r.list_services_response.service]
        except grpc.aio.AioRpcError as exc:
            raise Warned(
                f"no server reflection ({exc.code().name}): grpcurl needs the protos"
            ) from None
        if RolloutClient.SERVICE not in names:
            raise Warned(f"reflection lists {names}, not {RolloutClient.SERVICE}")
        return f"{len(names)} services"

    async def capabilities(self) -> str:
        caps = (await self.client.get_capabilities()).capabilities
        self.features = set(caps.features)
        if caps.contract_version.split(".")[0] != CONTRACT_MAJOR:
            raise CheckFailed(
                f"contract_version {caps.contract_version!r}; this checker knows {CONTRACT_MAJOR}.x"
            )
        name = caps.implementation or "(no implementation name)"
        return f"{name} {caps.implementation_version}, contract {caps.contract_version}, features {sorted(self.features)}"

    async def status(self) -> str:
        s = await self.client.get_status()
        if s.capacity < 1 or not 0 <= s.free_slots <= s.capacity:
            raise CheckFailed(f"capacity {s.capacity}, free_slots {s.free_slots}")
        if not s.policy_ids or not s.workflows:
            raise CheckFailed(f"policy_ids {list(s.policy_ids)}, workflows {list(s.workflows)}")
        for kind, chosen, listed in (
            ("policy", self.policy, s.policy_ids),
            ("workflow", self.workflow, s.workflows),
        ):
            if chosen and chosen not in listed:
                raise CheckFailed(f"{kind} {chosen!r} not among {list(listed)}")
        self.policy = self.policy or s.policy_ids[0]
        self.workflow = self.workflow or s.workflows[0]
        self.capacity = s.capacity
        if s.running_groups or s.pending_results:
            raise Warned(
                f"{s.running_groups} running, {s.pending_results} pending: an instance in use "
                "(a Dataflow's groups) may make later checks fail"
            )
        return f"capacity {s.capacity}, serving {self.policy}/{self.workflow}"

    async def submit_rejects_empty(self) -> str:
        return (await self._submit()).expect(grpc.StatusCode.INVALID_ARGUMENT)

    async def submit_rejects_duplicate_ids(self) -> str:
        self._needs("policy")
        g = self._group()
        return (await self._submit(g, g)).expect(grpc.StatusCode.INVALID_ARGUMENT)

    async def submit_rejects_unknown_policy(self) -> str:
        self._needs("policy")
        r = await self._submit(self._group(policy=f"no-such-policy-{self.run_id}"))
        return r.expect(grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_POLICY")

    async def submit_rejects_unknown_workflow(self) -> str:
        self._needs("policy")
        r = await self._submit(self._group(workflow=f"no-such-workflow-{self.run_id}"))
        return r.expect(grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_WORKFLOW")

    async def submit_rejects_bad_sampling(self) -> str:
        self._needs("policy")
        g = self._group()
        g.sampling_params.max_new_tokens = 0
        r = await self._submit(g)
        text = r.expect(grpc.StatusCode.INVALID_ARGUMENT)
        if not any(f.endswith("max_new_tokens") for f in r.fields):
            raise CheckFailed(
                f"max_new_tokens 0 refused, but the error names fields {list(r.fields)}, not "
                "sampling_params.max_new_tokens (ErrorInfo metadata 'field' or BadRequest)"
            )
        return f"{text} naming {r.fields[0]}"

    async def submit_refuses_over_capacity(self) -> str:
        self._needs("policy", "capacity")
        per = min(1024, self.capacity)
        groups = [self._group(num_samples=per) for _ in range(self.capacity // per + 1)]
        r = await self._submit(*groups)
        text = r.expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "NO_FREE_SLOTS")
        if not r.retry:
            raise CheckFailed("RESOURCE_EXHAUSTED without a google.rpc.RetryInfo")
        s = await self.client.get_status()
        if s.running_groups:  # all or nothing: none of the groups may run
            raise CheckFailed(f"refused, yet {s.running_groups} groups run")
        return f"{text} for {len(groups)} x {per} samples, RetryInfo set, none run"

    async def collect_rejects_long_wait(self) -> str:
        req = pb.CollectResultsRequest(max_groups=1)
        req.max_wait.FromSeconds(int(MAX_WAIT_S) + 1)

        async def call() -> list:
            return [m async for m in self.client.stub.CollectResults(req, timeout=MAX_WAIT_S + 5)]

        return (await rpc(call())).expect(grpc.StatusCode.INVALID_ARGUMENT)

    async def collect_rejects_zero_max_groups(self) -> str:
        req = pb.CollectResultsRequest(max_groups=0)  # unset: required, not a default

        async def call() -> list:
            return [m async for m in self.client.stub.CollectResults(req, timeout=MAX_WAIT_S + 5)]

        r = await rpc(call())
        text = r.expect(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
        if "max_groups" not in r.fields and "max_groups" not in r.details:
            raise CheckFailed(f"refused, but naming no field max_groups: {r.details!r}")
        return text

    async def submit(self) -> str:
        self._needs("policy", "capacity")
        g = self._group(num_samples=min(2, self.capacity))
        r = await self._submit(g)
        r.expect(grpc.StatusCode.OK)
        if list(r.response.accepted_group_ids) != [g.group_id]:
            raise CheckFailed(
                f"accepted {list(r.response.accepted_group_ids)}, expected [{g.group_id!r}]"
            )
        self.group, self.submitted = g.group_id, g
        return f"{g.group_id} ({g.num_samples} samples) accepted"

    async def submit_is_idempotent(self) -> str:
        self._needs("group")
        r = await self._submit(self.submitted)
        if r.code == grpc.StatusCode.OK and self.group in r.response.accepted_group_ids:
            return "the same group again: reported accepted"
        raise CheckFailed(f"resubmitting a held group: {r.code.name} {r.details!r}")

    async def collect(self) -> str:
        self._needs("group")
        if missing := await self._until_collected(self.group):
            self.group = ""  # the checks that need a collected group are skipped
            raise CheckFailed(missing)
        return self._well_formed(self.group, self.submitted.num_samples)

    async def collect_repeats_until_ack(self) -> str:
        self._needs("group")
        got = await self._collect(0.0)
        if self.group not in got:
            raise CheckFailed("a result not yet acknowledged was not sent again")
        return "sent again before AckResults"

    async def ack(self) -> str:
        self._needs("group")
        first = await self.client.ack_results([self.group])
        if first.acknowledged != 1:
            raise CheckFailed(f"acknowledged {first.acknowledged}, expected 1")
        again = await rpc(self.client.ack_results([self.group]))
        again.expect(grpc.StatusCode.OK)
        if again.response.acknowledged != 0 or again.response.ignored != 1:
            raise CheckFailed(
                f"acknowledged again: acknowledged {again.response.acknowledged}, ignored "
                f"{again.response.ignored}, expected 0 and 1"
            )
        return "acknowledged once; again: ignored"

    async def ack_removes_the_result(self) -> str:
        self._needs("group")
        # Long enough for a second run of the resubmitted group to finish, were there one.
        got = await self._collect(2.0)
        if self.group in got:
            raise CheckFailed("delivered again after AckResults (or run twice: the resubmission)")
        return "not delivered again"

    async def ack_ignores_unknown_ids(self) -> str:
        r = await rpc(self.client.ack_results([f"conformance/{self.run_id}/unknown"]))
        r.expect(grpc.StatusCode.OK)
        if r.response.ignored != 1:
            raise CheckFailed(f"ignored {r.response.ignored}, expected 1")
        return "OK, ignored 1"

    async def cancel(self) -> str:
        unknown = await rpc(self.client.cancel_groups([f"conformance/{self.run_id}/unknown"]))
        unknown.expect(grpc.StatusCode.OK)
        if "cancel" not in self.features:
            raise Skipped("unknown ids OK; the cancel feature is not listed")
        self._needs("policy")
        g = self._group()
        (await self._submit(g)).expect(grpc.StatusCode.OK)
        cancelled = (await self.client.cancel_groups([g.group_id])).cancelled
        got = await self._collect(1.0)
        if cancelled and g.group_id in got:
            raise CheckFailed("a cancelled group produced a result")
        if g.group_id in got:  # finished before the cancel: fine, acknowledged like any other
            await self.client.ack_results([g.group_id])
            return "unknown ids OK; the group finished before the cancel"
        return f"unknown ids OK; a running group cancelled ({cancelled}), no result"

    async def cancel_keeps_a_finished_result(self) -> str:
        """A group that finished before CancelGroups keeps its result until acknowledged, and
        is not counted cancelled (rollout_service.proto, CancelGroups)."""
        self._needs("policy")
        g = self._group(num_samples=1)
        (await self._submit(g)).expect(grpc.StatusCode.OK)
        if missing := await self._until_collected(g.group_id):
            raise CheckFailed(missing)
        cancelled = (await self.client.cancel_groups([g.group_id])).cancelled
        got = await self._collect(0.5)
        await self.client.ack_results([g.group_id])
        if cancelled:
            raise CheckFailed(f"a finished group counted cancelled ({cancelled})")
        if g.group_id not in got:
            raise CheckFailed("CancelGroups dropped a finished, unacknowledged result")
        return "finished, then cancelled: not counted, its result still sent until acknowledged"

    async def load_weights_rejects_bad_requests(self) -> str:
        self._needs("policy")
        empty = await rpc(
            self.client.load_weights([], "127.0.0.1:1", f"conformance-{self.run_id}-1")
        )
        first = empty.expect(grpc.StatusCode.INVALID_ARGUMENT)
        unknown = version_pb2.PolicyVersion(
            policy_id=f"no-such-policy-{self.run_id}", version=1, version_id="v1"
        )
        r = await rpc(
            self.client.load_weights([unknown], "127.0.0.1:1", f"conformance-{self.run_id}-2")
        )
        return f"empty: {first}; unknown policy: {r.expect(grpc.StatusCode.INVALID_ARGUMENT, 'UNKNOWN_POLICY')}"

    async def settles(self) -> str:
        deadline = time.monotonic() + self.options.result_timeout_s
        while True:
            s = await self.client.get_status()
            if s.running_groups == 0 and s.pending_results == 0 and s.free_slots == s.capacity:
                return "nothing running or pending, every slot free"
            if time.monotonic() > deadline:
                raise CheckFailed(
                    f"running {s.running_groups}, pending {s.pending_results}, free "
                    f"{s.free_slots} of {s.capacity} after every group was acknowledged"
                )
            await asyncio.sleep(0.2)
