"""Typed configuration of the trainer: every field documented and bounded, unknown keys refused.

Plain pydantic, no torch: the command line parses and validates it before
importing anything heavy, so `--help` and config errors are fast.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from astra.config import Strict

POLICY_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
MODULE_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LossConfig(Strict):
    """The policy loss (formulas in astra.trainer.losses)."""

    kind: Literal["ppo", "decoupled", "tis"] = Field(
        "decoupled",
        description="ppo: ratio against the behaviour policy; decoupled: AReaL's decoupled PPO "
        "(ratio against the proximal policy, behaviour weight capped); tis: truncated "
        "importance-sampling policy gradient.",
    )
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="Ratio lower clip: 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0.0, description="Ratio upper clip: 1 + clip_high.")
    dual_clip: float | None = Field(
        None,
        gt=1.0,
        description="Dual clip c: negative-advantage loss bounded by c*|A|; None: off.",
    )
    behaviour_cap: float | None = Field(
        5.0, gt=0.0, description="Cap C on the behaviour (decoupled) or TIS weight; None: uncapped."
    )
    behaviour_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="A weight above the cap: truncated to C, or its token masked."
    )
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the KL penalty to the reference.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL estimator of the penalty."
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus.")
    aggregation: Literal["token", "sequence"] = Field(
        "token",
        description="token: mean over every trained token of the batch; sequence: mean over "
        "sequences of each sequence's token mean (GRPO).",
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="Log-probs are log_softmax(logits / temperature); must equal the rollout "
        "temperature so behaviour and trainer log-probs describe the same policy.",
    )
    m2po_tau: float | None = Field(
        None,
        gt=0.0,
        description="M2PO's second-moment trust region: the trained tokens with the largest "
        "(log r)^2, r = trainer / behaviour probability, are masked until the mean over the "
        "rest is <= m2po_tau (the paper uses 0.04); None: off.",
    )
    ratio_band: tuple[float, float] | None = Field(
        None,
        description="IcePop's acceptance band [low, high] of r = trainer / behaviour "
        "probability: a token outside it gets no policy gradient (e.g. [0.5, 2.0]); None: off.",
    )

    @field_validator("ratio_band")
    @classmethod
    def _band(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not 0.0 < value[0] < 1.0 < value[1]:
            raise ValueError(f"{list(value)}: needs 0 < low < 1 < high, e.g. [0.5, 2.0]")
        return value


class OptimConfig(Strict):
    """AdamW and gradient clipping."""

    lr: float = Field(1e-6, gt=0.0, description="Learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay.")
    max_grad_norm: float = Field(1.0, ge=0.0, description="Global grad-norm clip; 0 disables.")


class BatchConfig(Strict):
    """What a step trains on."""

    num_groups: int = Field(8, ge=1, le=65536, description="Prompt groups fetched per step.")
    max_wait_s: float = Field(10.0, gt=0.0, le=60.0, description="FetchBatch max_wait per call.")
    max_tokens_per_microbatch: int = Field(
        4096, ge=1, description="Padded tokens (rows x longest row) per forward/backward."
    )
    max_seq_len: int | None = Field(
        None, ge=2, description="Longest sequence accepted; default the model's context."
    )
    advantages: Literal["dataflow", "group", "batch"] = Field(
        "dataflow",
        description="dataflow: use the advantages Dataflow stamped; group/batch: recompute from "
        "rewards here, normalised per prompt group or over the batch. An episode in which the "
        "policy plays several agents credits each agent with its own reward, normalised over "
        "that agent's episodes (per group under dataflow), as two policies would be.",
    )
    std_normalize: bool = Field(True, description="Recomputed advantages divided by the std.")
    adv_eps: float = Field(1e-6, gt=0.0, description="Added to the std before dividing.")


class PublishConfig(Strict):
    """Weights out."""

    enabled: bool = Field(True, description="Publish every version to the WeightService.")
    dtype: Literal["model", "bfloat16", "float32"] = Field(
        "model", description="Dtype of the host copy that is published; model: the compute dtype."
    )
    max_pending: int = Field(
        2, ge=1, le=16, description="Host copies waiting to stream before a step blocks."
    )
    publish_initial: bool = Field(
        True, description="Publish the starting weights as version 0 when the service has none."
    )
    pin_host_copy: bool = Field(
        True,
        description="On CUDA, copy each version to pinned host memory (fast, asynchronous). Up "
        "to max_pending + 3 copies are page-locked at once (queued, publishing, being made, "
        "the sink's delta base), and torch keeps freed pinned blocks for the next copy; false: "
        "pageable memory, a slower copy that blocks the step longer.",
    )


class CheckpointConfig(Strict):
    """Checkpoints: HF safetensors model + optimizer + RNG + trainer state."""

    dir: str | None = Field(None, description="Root directory; None disables checkpoints.")
    every_steps: int = Field(0, ge=0, description="Automatic checkpoint every N steps; 0: never.")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept (older ones deleted).")
    resume: bool = Field(False, description="Continue from the newest checkpoint under dir.")
    stop_timeout_s: float = Field(
        10.0,
        ge=0,
        description="On SIGTERM/SIGINT: how long the step in progress, the versions queued for "
        "publishing and a checkpoint of the last step may take before the trainer exits "
        "without that checkpoint. Keep it under the supervisor's supervision.stop_grace_s.",
    )


class LoraConfig(Strict):
    """LoRA: train a low-rank adapter on a frozen base; versions hold the adapter only
    (astra.lora.format). Absent: full fine-tuning."""

    rank: int = Field(
        16, ge=1, le=4096, description="Rank r of every adapter (A [r, in], B [out, r])."
    )
    alpha: float = Field(32.0, gt=0.0, description="The update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(ALL_LINEAR),
        min_length=1,
        description="Linear layers adapted, by the last component of their name (q_proj, "
        "down_proj, ...): every layer of the model with that name.",
    )

    @field_validator("target_modules")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.match(MODULE_NAME_PATTERN, name):
                raise ValueError(f"{name!r} is not a module name like q_proj")
        if len(set(value)) != len(value):
            raise ValueError(f"{value} names a module twice")
        return value


class TrainerConfig(Strict):
    """One trainer process (one rank; FSDP2 across ranks under torchrun)."""

    policy_id: str = Field(pattern=POLICY_ID_PATTERN, description="Policy trained.")
    model: str = Field("tiny", description="'tiny' or a local Hugging Face directory.")
    reference_model: str | None = Field(
        None, description="Frozen KL reference: 'initial' (the starting weights), 'tiny' or a path."
    )
    dataflow: str | None = Field(None, description="Dataflow host:port; None for custom sources.")
    weights: str | None = Field(None, description="WeightService host:port; None: no publishing.")
    trainer_id: str = Field("trainer", min_length=1, max_length=64, description="Trainer name.")
    host: str = Field("127.0.0.1", description="TrainerService listen address.")
    port: int | None = Field(50053, ge=0, le=65535, description="TrainerService port; 0 picks.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus /metrics port (rank 0); 0 picks; None: off."
    )
    device: str = Field("cpu", description="Torch device: cpu or cuda.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Compute dtype of forward and backward; the optimiser always updates fp32 "
        "master weights (a frozen KL reference is held in this dtype).",
    )
    seed: int = Field(0, ge=0, description="Seed of torch and Python RNGs.")
    num_steps: int = Field(0, ge=0, description="Optimiser steps to run when served; 0: no end.")
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    publish: PublishConfig = Field(default_factory=PublishConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    lora: LoraConfig | None = Field(
        None, description="Train a LoRA adapter on the frozen model; None: full fine-tuning."
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.loss.kl_coef > 0 and self.reference_model is None:
            raise ValueError("loss.kl_coef > 0 needs reference_model")
        if self.checkpoint.resume and self.checkpoint.dir is None:
            raise ValueError("checkpoint.resume needs checkpoint.dir")
        return self
