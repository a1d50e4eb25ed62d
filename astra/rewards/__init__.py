"""Reward functions: `(record, completion, **context) -> float`, found by name.

Built-ins: exact_match, numeric, arithmetic, countdown (astra.rewards.answers)
and code_tests (astra.rewards.code_tests). Plugins: entry-point group
`astra.rewards`. Any importable function: `package.module:function`.
"""

from astra.rewards import answers, code_tests
from astra.rewards.registry import (
    REWARDS,
    RewardFn,
    Scored,
    UnknownReward,
    get_reward,
    known_rewards,
    register_reward,
    score,
)

__all__ = [
    "REWARDS",
    "RewardFn",
    "Scored",
    "UnknownReward",
    "answers",
    "code_tests",
    "get_reward",
    "known_rewards",
    "register_reward",
    "score",
]
