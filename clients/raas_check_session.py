"""The state every check of `astra raas check` shares, and the helpers they call.

`CheckSession` holds the client, the options, what earlier checks found (the group
submitted, the results decoded, the version loaded) and the ways to submit, collect
and load; the check sets (astra.clients.raas_check and its raas_check_* modules)
extend it, and `RaasChecker` joins them. Never decides a check's outcome itself.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import struct_pb2

from astra.clients.raas import RolloutClient
from astra.clients.raas_rules import Check, CheckFailed, InstanceInUse, Rpc, Skipped, rpc
from astra.clients.rollout_port import decode_results
from astra.clients.weights_stream import Receiver
from astra.common.v1 import rollout_pb2, version_pb2
from astra.dataflow.ports import IncomingGroup
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.weights.memory import MemoryVersion


@dataclass
class CheckOptions:
    policy: str = ""  # default: the first policy the server lists
    workflow: str = ""  # default: the first workflow it lists
    reward: str = ""  # default: the workflow's
    prompt: str = "1+1="
    answer: str = "2"  # the dataset record's "answer", for rewards that need one
    max_new_tokens: int = 8
    result_timeout_s: float = 120.0  # for one group to finish
    call_timeout_s: float = 10.0
    # A WeightService holding `version_id` of the policy: the LoadWeights checks run with it.
    weights: str = ""
    version_id: str = ""
    load_timeout_s: float = 300.0
    # Run even when the instance has groups running or results pending that are not ours.
    allow_busy: bool = False
    # Serve corrupt weights from an in-process WeightService: the instance must refuse them.
    serve_weights: bool = False
    # The checker's own DataflowService records what the instance registers (--as-dataflow):
    # an astra.raas.registration_record.Recording; None skips the registration checks.
    recording: Any = None
    register_timeout_s: float = 60.0


@dataclass
class CheckSession:
    address: str
    options: CheckOptions = field(default_factory=CheckOptions)

    def __post_init__(self) -> None:
        self.client: RolloutClient  # opened by `run`, on its event loop
        self.run_id = secrets.token_hex(4)
        self.capacity = 0
        self.features: set[str] = set()
        self.policy, self.workflow = self.options.policy, self.options.workflow
        self.loaded: version_pb2.PolicyVersion | None = None  # what `load_weights` loaded
        # The group `submit` sent (group_id empty until it passes) and what collects decoded.
        self.group, self.submitted = "", rollout_pb2.PromptGroup()
        self.decoded: dict[str, tuple[IncomingGroup, pb.CollectResultsResponse]] = {}
        self.results: list[Check] = []
        self._n = 0
        self._loaded_copy: MemoryVersion | None = None  # its bytes, for the checker's own service
        self.after_load: str | None = None  # a group generated on the loaded version
        # CollectResultBatch: None until a call tells, False when it answers UNIMPLEMENTED; the
        # groups its checks submitted, and the two they collected, in the order they finished.
        self.batch: bool | None = None
        self.batch_groups: list[str] = []
        self.batch_first, self.batch_second = "", ""

    async def _refuse_if_busy(self) -> None:
        """InstanceInUse when groups run or wait there: a live Dataflow's, which the checks
        would race (and whose counts they would misread)."""
        if self.options.allow_busy:
            return
        try:
            s = await self.client.get_status()
        except grpc.aio.AioRpcError:
            return  # the checks report what is wrong with GetStatus
        if s.running_groups or s.pending_results:
            raise InstanceInUse(
                f"{self.address} has {s.running_groups} groups running and "
                f"{s.pending_results} results pending that this checker did not submit: it looks "
                "in use (registered with a Dataflow?). Check an instance no Dataflow dispatches "
                "to, or pass --allow-busy to run anyway (later checks may then fail)"
            )

    def _group(
        self, *, num_samples: int = 1, policy: str = "", workflow: str = ""
    ) -> rollout_pb2.PromptGroup:
        self._n += 1
        data = struct_pb2.Struct()
        data.update({"prompt": self.options.prompt, "answer": self.options.answer})
        return rollout_pb2.PromptGroup(
            group_id=f"conformance/{self.run_id}/{self._n}",
            workflow=workflow or self.workflow,
            policy_ids=[policy or self.policy],
            prompt=rollout_pb2.Prompt(text=self.options.prompt, data=data),
            num_samples=num_samples,
            sampling_params=rollout_pb2.SamplingParams(
                temperature=1.0, top_p=1.0, max_new_tokens=self.options.max_new_tokens, seed=self._n
            ),
            reward=self.options.reward,
        )

    def _needs(self, *attrs: str) -> None:
        for attr in attrs:
            if not getattr(self, attr):
                raise Skipped(f"needs an earlier check ({attr} unknown)")

    async def _submit(self, *groups: rollout_pb2.PromptGroup) -> Rpc:
        return await rpc(self.client.submit_groups(list(groups)))

    async def _collect(self, max_wait_s: float) -> dict[str, int]:
        """group id -> results delivered for it by one CollectResults call (our groups only)."""
        raw = await self.client.collect_results_raw(64, max_wait_s)
        out: dict[str, int] = {}
        for msg, group in zip(raw, decode_results(raw), strict=True):
            if group.group_id.startswith(f"conformance/{self.run_id}/"):
                out[group.group_id] = out.get(group.group_id, 0) + 1
                self.decoded[group.group_id] = (group, pb.CollectResultsResponse.FromString(msg))
        return out

    async def _until_collected(self, group_id: str) -> str:
        """Collects until `group_id`'s result arrives: "" then, else why it did not (none within
        result_timeout_s); CheckFailed when one collect delivers it twice."""
        deadline = time.monotonic() + self.options.result_timeout_s
        while time.monotonic() < deadline:
            got = await self._collect(min(5.0, max(0.1, deadline - time.monotonic())))
            if got.get(group_id, 0) > 1:
                raise CheckFailed(f"{got[group_id]} results for {group_id} in one collect")
            if group_id in got:
                return ""
        return f"no result within {self.options.result_timeout_s:g} s"

    def _well_formed(self, group_id: str, num_samples: int) -> str:
        """What a collect decoded for `group_id`, as Dataflow takes it in: CheckFailed when the
        group or a sample failed, Dataflow would refuse it, or samples are missing."""
        result, wire = self.decoded[group_id]
        if result.error is not None:
            raise CheckFailed(f"the group failed: {result.error}")
        if result.invalid is not None:
            raise CheckFailed(f"Dataflow would refuse the result: {result.invalid}")
        errors = [t.error.message for t in wire.result.trajectories if t.error.code]
        if errors:  # not trained on: the engine could not generate them
            n = len(wire.result.trajectories)
            raise CheckFailed(f"{len(errors)} of {n} samples failed, the first: {errors[0]}")
        trajectories = result.per_policy.get(self.policy, [])
        if len(trajectories) != num_samples:
            raise CheckFailed(
                f"{len(trajectories)} trajectories of {self.policy}, expected {num_samples}"
            )
        tokens = sum(t.num_tokens for t in trajectories)
        return f"{len(trajectories)} trajectories, {tokens} trained tokens, as Dataflow reads them"

    def _load(self, versions: list, request_id: str) -> Awaitable:
        return self.client.load_weights(
            versions, self.options.weights, request_id, timeout_s=self.options.load_timeout_s
        )

    async def _load_from(self, address: str, version: Any, tag: str) -> Rpc:
        """LoadWeights of one version from the checker's own WeightService at `address`."""
        request_id = f"conformance-{self.run_id}-{tag}"
        return await rpc(
            self.client.load_weights(
                [version], address, request_id, timeout_s=self.options.load_timeout_s
            )
        )

    async def _held_id(self) -> str | None:
        """The version_id the instance reports in service for the policy."""
        s = await self.client.get_status()
        return next((v.version_id for v in s.loaded_versions if v.policy_id == self.policy), None)

    async def _loaded_tensors(self) -> MemoryVersion:
        """The bytes of the version `load_weights` loaded, read from --weights (once)."""
        if self._loaded_copy is None:
            assert self.loaded is not None
            async with Receiver(
                self.options.weights, self.policy, None, in_memory=True, durable=False
            ) as receiver:
                await receiver.fetch(self.loaded.version_id)
                self._loaded_copy = receiver.current
        assert self._loaded_copy is not None
        return self._loaded_copy

    async def _held(self) -> int | None:
        s = await self.client.get_status()
        return next((v.version for v in s.loaded_versions if v.policy_id == self.policy), None)
