"""What a RaaS needs from an inference engine plus workflow: the `RolloutBackend` protocol.

Admission and results are astra.raas.groups' (over astra.raas.results),
versions astra.raas.versions', the wire the servicer's (astra.servers.raas);
a backend only turns one prompt group into trajectories with the weights it
holds, and loads new weights when told. Everything here is plain
Python and numpy: no gRPC, no protobuf, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

FinishReason = Literal["stop", "length", "aborted", "error"]


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One prompt group to run, as the servicer validated it (PromptGroup on the wire)."""

    group_id: str
    workflow: str
    policy_ids: tuple[str, ...]
    num_samples: int
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    prompt_text: str = ""
    # int32 [T] when the dataset ships pre-tokenised prompts; engines then ignore prompt_text.
    prompt_token_ids: np.ndarray | None = None
    # The dataset record (reference answer, tests), for the workflow and reward function.
    data: dict[str, Any] = field(default_factory=dict)
    reward: str = ""
    epoch: int = 0


@dataclass(slots=True)
class SequenceSpec:
    """One token sequence of one policy; the four arrays have the same length T.

    token_ids int32 [T], logprobs float32 [T] (0 where not sampled), loss_mask
    uint8 [T], weight_versions int64 [T] (-1 where not generated).
    """

    policy_id: str
    token_ids: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    weight_versions: np.ndarray
    prompt_length: int
    finish_reason: FinishReason
    reward: float
    agent_id: str = ""


@dataclass(slots=True)
class TrajectorySpec:
    """One episode (one sample of a group). `error` set means it failed and is not trained on."""

    sample_index: int
    sequences: list[SequenceSpec]
    reward: float
    agent_rewards: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class VersionSpec:
    """A policy version to load: step counter plus WeightService identity.

    `weights_address` is the WeightService this policy's version comes from when it is not
    the load's own address (policies published by trainers on different WeightServices);
    empty: the address `load_weights` is given.
    """

    version: int
    version_id: str = ""
    weights_address: str = ""


class RolloutBackend(Protocol):
    """An inference engine with its workflows, as a RaaS servicer drives it.

    `generate` is called once per accepted group, concurrently for many
    groups; it may be cancelled at any await (CancelGroups) and must then
    stop quickly. An exception fails the whole group (reported with an error,
    never dropped). `load_weights` is awaited under a lock, never
    concurrently with itself; `generate` calls that started before it keep
    the versions they were given.
    """

    engine: str
    policy_ids: tuple[str, ...]
    workflows: tuple[str, ...]

    async def generate(self, group: GroupSpec, versions: dict[str, int]) -> list[TrajectorySpec]:
        """Runs `group.num_samples` episodes; `versions` are the versions in service now."""
        ...

    async def load_weights(self, versions: dict[str, VersionSpec], weights_address: str) -> int:
        """Loads all `versions` together; returns the bytes fetched.

        Each policy comes from its `VersionSpec.weights_address`, else from
        `weights_address`.

        Raises astra.errors.Unavailable (service unreachable) or DataLoss (a
        checksum failed); either way the previous versions stay in service.
        """
        ...
