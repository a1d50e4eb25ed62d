"""Checks one generate request against an engine's limits, naming the field at fault.

Every engine (the built-in torch engine, HTTP adapters) refuses the same bad
input the same way: InvalidArgument with a BadRequest field violation
(`prompt_ids`, `sampling.temperature`, ...), which the RaaS returns at submit.
Plain Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from astra.engine.api import Sampling
from astra.errors import invalid_field

# Smallest positive temperature: far below it logits / temperature overflow float32 (inf
# logits, NaN log-probs, an arbitrary token). Use 0 for greedy.
MIN_TEMPERATURE = 1e-4


def check_request(
    prompt_ids: Sequence[int], s: Sampling, *, vocab_size: int, max_seq_len: int
) -> None:
    """Raises InvalidArgument for the first bad field; returns None when the request is valid."""
    if not prompt_ids:
        raise invalid_field("prompt_ids", "must not be empty")
    if any(not 0 <= int(t) < vocab_size for t in prompt_ids):
        raise invalid_field("prompt_ids", f"token ids must be in [0, {vocab_size})")
    if s.max_new_tokens < 1:
        raise invalid_field("sampling.max_new_tokens", "must be >= 1")
    if len(prompt_ids) + s.max_new_tokens > max_seq_len:
        raise invalid_field(
            "prompt_ids",
            f"{len(prompt_ids)} prompt + {s.max_new_tokens} new tokens exceed the "
            f"context of {max_seq_len}",
            reason="PROMPT_TOO_LONG",
        )
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise invalid_field("sampling.temperature", "must be finite and >= 0")
    if 0 < s.temperature < MIN_TEMPERATURE:
        raise invalid_field(
            "sampling.temperature",
            f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {s.temperature:g}",
        )
    if not 0 < s.top_p <= 1:
        raise invalid_field("sampling.top_p", "must be in (0, 1]")
    if s.top_k < 0:
        raise invalid_field("sampling.top_k", "must be >= 0 (0 = no limit)")
    if any(not 0 <= t < vocab_size for t in s.stop_token_ids):
        raise invalid_field("sampling.stop_token_ids", f"token ids must be in [0, {vocab_size})")
    if any(not stop for stop in s.stop_strings):
        raise invalid_field("sampling.stop_strings", "must not contain empty strings")
    if s.seed is not None and not 0 <= s.seed < 2**63:
        raise invalid_field("sampling.seed", "must be in [0, 2**63)")
