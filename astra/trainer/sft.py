"""Supervised fine-tuning on prompt/answer records: the warm-up stage before RL.

A record is `{"prompt": str, "answer": str, ...}` (astra.raas.tasks writes
them). A training sequence is the prompt's tokens, the answer's tokens and
end-of-sequence; the loss is the mean cross-entropy over the answer tokens and
end-of-sequence only (the prompt is context, not a target), so the model
learns to answer and to stop, the way the RL rewards then score it (exact
match of the text before end-of-sequence). Batches are drawn with a seeded
generator, so the same records, seed and settings give the same weights on
the same machine.

`supervised_warmup` trains a model in place; `run_sft` loads a model ('tiny'
or a local Hugging Face directory), trains it and writes the result as a Hugging
Face directory (config, tokenizer files, checksummed safetensors) that the
RaaS engines and the trainer load like any other model.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from astra.durable import fsync_dir, write_durably
from astra.engine.api import Tokenizer
from astra.engine.model import CausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SftSettings:
    steps: int
    lr: float = 3e-3
    batch_size: int = 64
    seed: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    log_every: int = 50
    chat: bool = False  # prompts through the model's chat template (the chat workflow's way)

    def __post_init__(self) -> None:
        for name, bad in (
            ("steps", self.steps < 1),
            ("lr", not 0 < self.lr <= 1),
            ("batch_size", self.batch_size < 1),
            ("max_grad_norm", self.max_grad_norm <= 0),
        ):
            if bad:
                raise ValueError(f"{name}: out of range ({getattr(self, name)!r})")


@dataclass
class SftResult:
    steps: int
    examples: int
    seconds: float
    loss_first: float
    loss_last: float
    losses: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("losses")
        return out


def encode_examples(
    records: Sequence[dict[str, Any]], tokenizer: Tokenizer, chat: bool = False
) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per record: prompt + answer + end-of-sequence. With `chat`
    the prompt is the record's one-turn conversation (its optional `system`, then the prompt
    as the user's message) through the tokenizer's chat template, as the chat workflow
    renders it for the RaaS."""
    from astra.engine.chat import render_chat, user_messages

    out = []
    for i, record in enumerate(records):
        if "prompt" not in record or "answer" not in record:
            raise ValueError(f"record {i}: needs 'prompt' and 'answer' (has {sorted(record)})")
        text = str(record["prompt"])
        if chat:
            text = render_chat(tokenizer, user_messages(text, record.get("system") or None))
        prompt = list(tokenizer.encode(text))
        answer = list(tokenizer.encode(str(record["answer"])))
        if not prompt:
            raise ValueError(f"record {i}: empty prompt")
        out.append((prompt + answer + [tokenizer.eos_id], len(prompt)))
    if not out:
        raise ValueError("no records to train on")
    return out


def collate(examples: Sequence[tuple[list[int], int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(ids [B, T], target mask [B, T-1]): mask[b, t] says ids[b, t+1] is a target."""
    width = max(len(ids) for ids, _ in examples)
    ids_BT = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(examples), width - 1), dtype=torch.float32)
    for b, (ids, prompt_len) in enumerate(examples):
        ids_BT[b, : len(ids)] = torch.tensor(ids)
        mask_BT[b, prompt_len - 1 : len(ids) - 1] = 1.0
    return ids_BT, mask_BT


def answer_loss(model: CausalLM, ids_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean cross-entropy of the masked next-token targets."""
    logits = model(ids_BT[:, :-1]).float()
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids_BT[:, 1:].reshape(-1), reduction="none"
    )
    return (ce * mask_BT.reshape(-1)).sum() / mask_BT.sum().clamp_min(1.0)


def supervised_warmup(
    model: CausalLM,
    tokenizer: Tokenizer,
    records: Sequence[dict[str, Any]],
    settings: SftSettings,
    *,
    progress: Callable[[int, float], None] | None = None,
) -> SftResult:
    """Trains `model` in place for `settings.steps` steps; returns the losses."""
    examples = encode_examples(records, tokenizer, chat=settings.chat)
    pad_id = int(getattr(tokenizer, "pad_id", tokenizer.eos_id))
    device = model.device
    rng = random.Random(f"astra-sft/{settings.seed}")
    torch.manual_seed(settings.seed)
    optim = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay
    )
    model.train()
    losses: list[float] = []
    started = time.monotonic()
    order: list[int] = []
    for step in range(1, settings.steps + 1):
        batch: list[Any] = []
        while len(batch) < settings.batch_size:  # epochs of a seeded shuffle
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        ids_BT, mask_BT = collate(batch, pad_id)
        loss = answer_loss(model, ids_BT.to(device), mask_BT.to(device))
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"step {step}: loss is {loss.item()}")
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        optim.step()
        losses.append(loss.item())
        if progress is not None and (step % settings.log_every == 0 or step == settings.steps):
            progress(step, loss.item())
    model.eval()
    return SftResult(
        steps=settings.steps,
        examples=len(examples),
        seconds=time.monotonic() - started,
        loss_first=losses[0],
        loss_last=losses[-1],
        losses=losses,
    )


def run_sft(
    model_path: str,
    records: Sequence[dict[str, Any]],
    out: str | Path,
    settings: SftSettings,
    *,
    device: str = "cpu",
) -> SftResult:
    """Fine-tunes `model_path` ('tiny' or a local HF directory) on `records` into `out`.

    `out` must not exist; it appears complete or not at all (written beside it,
    then renamed), so a run that dies here starts the stage again.
    """
    from astra.engine.tiny import TINY, TINY_CONFIG, load_model
    from astra.engine.torch_weights import save_state
    from astra.trainer.sources import model_files

    target = Path(out)
    if target.exists():
        raise FileExistsError(f"{target} exists")
    if model_path == TINY:
        hf_config = dict(TINY_CONFIG)
    else:  # the config only: the weights are read once, by load_model
        hf_config = json.loads((Path(model_path) / "config.json").read_text())
    model, tokenizer = load_model(model_path, device, torch.float32)
    result = supervised_warmup(
        model,
        tokenizer,
        records,
        settings,
        progress=lambda step, loss: log.info("sft step %d loss %.4f", step, loss),
    )
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    config = {**hf_config, "torch_dtype": "float32"}
    save_state(tmp, model.hf_state_dict(), config)
    for name, data in model_files(model_path, config).items():
        if name != "config.json" and not (tmp / name).exists():
            write_durably(tmp / name, data)
    tmp.rename(target)
    fsync_dir(target.parent)  # else a power cut takes the warm-up back: --resume redoes it
    return result
