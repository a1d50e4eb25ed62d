"""Each agent episode's calls, recorded token for token, and the trajectories built from them.

An episode is opened per prompt with a key of its own (the agent's API key): every call made
with that key is recorded as the exact prompt token ids the engine consumed (the chat template
applied by the endpoint, never the agent's text tokenized again) and what it generated, with
log-probs and per-token weight versions. A call with a key that is unknown, or whose episode
ended, is refused.

The `agent` workflow turns an episode's calls into sequences (astra.workflows.agent
`trajectories`). Knows nothing of HTTP, gRPC or workflows.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from astra.engine.api import Generation

KEY_PREFIX = "astra-ep-"
# The key in a header of its own (lower case, as the HTTP layer reads names), for callers
# whose `Authorization` is not theirs to set (verifiers' relay); it wins over the bearer token.
EPISODE_HEADER = "x-astra-episode"


@dataclass(frozen=True)
class Call:
    """One completion: the prompt tokens the engine consumed and what it generated."""

    prompt_ids: tuple[int, ...]
    generation: Generation
    policy_id: str


@dataclass
class Episode:
    key: str
    policy_id: str
    max_calls: int
    calls: list[Call] = field(default_factory=list)
    open: bool = True

    def record(
        self, prompt_ids: Sequence[int], generation: Generation, policy_id: str = ""
    ) -> None:
        ids = tuple(int(t) for t in prompt_ids)
        self.calls.append(Call(ids, generation, policy_id or self.policy_id))


class EpisodeLimit(Exception):
    """The episode made more calls than it may (an agent flooding the endpoint)."""


class Episodes:
    """The open episodes by key; a closed one is forgotten (its key refused from then on)."""

    def __init__(self) -> None:
        self._open: dict[str, Episode] = {}

    def open(self, policy_id: str, *, max_calls: int = 64) -> Episode:
        key = KEY_PREFIX + secrets.token_urlsafe(24)
        episode = self._open[key] = Episode(key, policy_id, max_calls)
        return episode

    def get(self, key: str) -> Episode | None:
        return self._open.get(key)

    def close(self, key: str) -> Episode | None:
        episode = self._open.pop(key, None)
        if episode is not None:
            episode.open = False
        return episode

    def __len__(self) -> int:
        return len(self._open)


def check_room(episode: Episode) -> None:
    if len(episode.calls) >= episode.max_calls:
        raise EpisodeLimit(f"the episode made {len(episode.calls)} calls, its limit")
