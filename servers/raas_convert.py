"""RolloutService wire <-> domain: prompt groups in, group results out, with validation.

Field names in errors are wire names, so a RaaS in any language reports the same fields.
"""

from __future__ import annotations

import math

from google.protobuf import json_format

from astra.common.v1 import rollout_pb2
from astra.engine.validate import MIN_TEMPERATURE
from astra.errors import invalid_field
from astra.raas.backend import GroupSpec
from astra.servers.convert import Malformed, from_array

MAX_IDS = 4096


def check_ids(ids, field: str = "group_ids") -> None:
    if not 1 <= len(ids) <= MAX_IDS:
        raise invalid_field(field, f"{len(ids)} ids, expected 1..{MAX_IDS}")


MAX_NAME = 128  # workflow and reward names
MAX_PROMPT_BYTES = 1 << 20
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKENS = 64, 1024, 1024


def check_bounds(g: rollout_pb2.PromptGroup, where: str) -> None:
    """The size bounds rollout.proto states for a PromptGroup's fields."""
    if len(g.workflow) > MAX_NAME:
        raise invalid_field(f"{where}.workflow", f"longer than {MAX_NAME} characters")
    if len(g.reward) > MAX_NAME:
        raise invalid_field(f"{where}.reward", f"longer than {MAX_NAME} characters")
    if len(g.prompt.text.encode()) > MAX_PROMPT_BYTES:
        raise invalid_field(f"{where}.prompt.text", "longer than 1 MiB")
    sp = g.sampling_params
    at = f"{where}.sampling_params"
    if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        raise invalid_field(f"{at}.temperature", "must be finite and >= 0")
    if 0 < sp.temperature < MIN_TEMPERATURE:  # logits / temperature would overflow
        raise invalid_field(f"{at}.temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}")
    if not 0 <= sp.top_p <= 1:
        raise invalid_field(f"{at}.top_p", "must be in (0, 1] (0 means 1)")
    if sp.top_k < 0:
        raise invalid_field(f"{at}.top_k", "must be >= 0 (0 = no limit)")
    if any(t < 0 for t in sp.stop_token_ids):
        raise invalid_field(f"{at}.stop_token_ids", "token ids must be >= 0")
    if len(sp.stop_strings) > MAX_STOP_STRINGS:
        raise invalid_field(f"{at}.stop_strings", f"more than {MAX_STOP_STRINGS} strings")
    for i, s in enumerate(sp.stop_strings):
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise invalid_field(f"{at}.stop_strings[{i}]", f"must be 1-{MAX_STOP_CHARS} characters")
    if len(sp.stop_token_ids) > MAX_STOP_TOKENS:
        raise invalid_field(f"{at}.stop_token_ids", f"more than {MAX_STOP_TOKENS} ids")


def group_spec(g: rollout_pb2.PromptGroup, where: str) -> GroupSpec:
    sp = g.sampling_params
    tokens = None
    if g.prompt.HasField("token_ids"):
        try:
            tokens = from_array(g.prompt.token_ids, f"{where}.prompt.token_ids")
        except Malformed as exc:
            raise invalid_field(f"{where}.prompt.token_ids", str(exc)) from exc
        if tokens.ndim != 1 or tokens.dtype.kind != "i":
            raise invalid_field(f"{where}.prompt.token_ids", "must be a 1-D integer array")
    data = {}
    if g.prompt.HasField("data"):
        try:
            data = json_format.MessageToDict(g.prompt.data)
        except ValueError as exc:  # NaN or an infinity: not a JSON record
            raise invalid_field(f"{where}.prompt.data", str(exc)) from exc
    return GroupSpec(
        group_id=g.group_id,
        workflow=g.workflow,
        policy_ids=tuple(g.policy_ids),
        num_samples=g.num_samples,
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        stop_strings=tuple(sp.stop_strings),
        stop_token_ids=tuple(sp.stop_token_ids),
        seed=sp.seed,
        prompt_text=g.prompt.text,
        prompt_token_ids=tokens,
        data=data,
        reward=g.reward,
        epoch=g.epoch,
    )
