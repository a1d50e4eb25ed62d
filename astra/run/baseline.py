"""The random baseline of summary.json: the initial (untrained) model sampled on the run's prompts.

What a policy scores before any training, measured the way the RaaS measures it:
the first `samples` records of the dataset, each sampled once with the first
stream's sampling settings (seeded per sample) by the built-in torch engine
on the starting weights of the stream's first policy, scored by the stream's
reward. Only the `single_turn` and `chat` workflows are reproduced here (prompt,
through the model's chat template for `chat` -> one generation -> reward); other
workflows get None. Also the rule-of-three 95%
upper bound when nothing scored (3 / samples).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from astra.run.recipe import Recipe


def _records(path: Path, n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if path.suffix != ".jsonl":
        return out
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
            if len(out) >= n:
                break
    return out


async def _sample(recipe: Recipe, records: list[dict[str, Any]]) -> list[float]:
    from astra.engine.api import Sampling
    from astra.engine.chat import render_chat, user_messages
    from astra.engine.tiny import load_model
    from astra.engine.torch_engine import TorchEngine
    from astra.rewards.registry import get_reward, score
    from astra.workflows.episode import generated_text
    from astra.workflows.registry import get_workflow

    stream = recipe.streams[0]
    policy_id = recipe.stream_policies(stream)[0]
    policy = next(p for p in recipe.policies if p.id == policy_id)
    reward_name = recipe.stream_reward(stream) or get_workflow(stream.workflow).default_reward
    reward_fn = get_reward(reward_name)
    chat = recipe.chat_shaped(policy_id)
    model, tokenizer = await asyncio.to_thread(load_model, policy.model, "cpu")
    engine = TorchEngine({policy_id: (model, tokenizer)}, "cpu", max_batch=64)
    s = stream.sampling
    try:

        async def one(i: int, record: dict[str, Any]) -> float:
            sampling = Sampling(
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                stop_strings=tuple(s.stop_strings),
                stop_token_ids=tuple(s.stop_token_ids),
                seed=s.seed + i,
            )
            text = str(record["prompt"])
            if chat:  # as the chat workflow renders it
                text = render_chat(tokenizer, user_messages(text, record.get("system") or None))
            ids = list(tokenizer.encode(text))
            gen = await engine.generate(policy_id, ids, sampling)
            text = generated_text(gen, tokenizer)
            value, _ = await asyncio.to_thread(score, reward_fn, record, text)
            return value

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(records))))
    finally:
        await engine.close()


def random_baseline(recipe: Recipe, dataset: Path, samples: int) -> dict[str, Any]:
    """{"accuracy", "samples", "correct", "upper95", "method"}; accuracy None when not measured."""
    stream = recipe.streams[0]
    out: dict[str, Any] = {"accuracy": None, "samples": 0, "correct": 0, "upper95": None}
    if samples <= 0:
        return {**out, "method": "not measured (observe.baseline_samples = 0)"}
    if stream.workflow not in ("single_turn", "chat"):
        return {
            **out,
            "method": f"not measured: workflow {stream.workflow} is neither single_turn nor chat",
        }
    records = _records(dataset, samples)
    if not records:
        return {**out, "method": f"not measured: {dataset.name} is not JSONL"}
    rewards = asyncio.run(_sample(recipe, records))
    correct = sum(1 for r in rewards if r >= 1.0)
    n = len(rewards)
    return {
        "accuracy": correct / n,
        "samples": n,
        "correct": correct,
        "mean_reward": sum(rewards) / n,
        "upper95": 3.0 / n if correct == 0 else None,
        "method": "initial weights of the first stream's first policy, one sample per record "
        "with the stream's sampling, scored by the stream's reward; correct = reward >= 1",
    }
