"""A dense reward for runs on random models (tools/gpu/device_check.sh): a random model solves
no task, so every group's rewards are equal and GRPO has nothing to learn from. The share of
decimal digits in the completion varies from sample to sample and can be learned, so a run on
it shows whether weights really move and rollouts follow them.

Used by dotted path: `streams.0.reward=shaped_reward:digit_share` with tools/gpu on PYTHONPATH.
"""

from __future__ import annotations

from typing import Any


def digit_share(record: dict[str, Any], completion: str, **_: Any) -> float:
    """Fraction of the completion's characters that are ASCII digits (0.0 when empty)."""
    if not completion:
        return 0.0
    return sum(ch in "0123456789" for ch in completion) / len(completion)
