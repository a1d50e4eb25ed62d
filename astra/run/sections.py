"""The sections of an `astra run` recipe (astra.run.recipe): every field documented and bounded,
unknown keys refused.

The Dataflow section reuses astra.dataflow.config: it is DataflowConfig with the
fields the run owns (host, port, state_dir, policies, streams) left out; buffers
and sampling are DataflowConfig's own models, the trainer's loss, optimiser and
publishing are TrainerConfig's (astra.trainer.config).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, create_model, model_validator

from astra.config import Strict
from astra.dataflow.config import (
    POLICY_ID_PATTERN,
    BufferSettings,
    DataflowConfig,
    SamplingSettings,
)
from astra.run.external import check_command, check_labels
from astra.trainer.config import LoraConfig, LossConfig, OptimConfig, PublishConfig

RUN_OWNED_DATAFLOW_FIELDS = frozenset({"host", "port", "state_dir", "policies", "streams"})


# Every DataflowConfig field the run does not own, with its type, default, bound and docs.
DataflowSection: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "DataflowSection",
    __base__=Strict,
    __doc__="Dataflow settings passed through to DataflowConfig (astra/dataflow/config.py).",
    **{
        name: (info.annotation, info)
        for name, info in DataflowConfig.model_fields.items()
        if name not in RUN_OWNED_DATAFLOW_FIELDS
    },
)


class DatasetSpec(Strict):
    """The prompts: a synthetic task (astra.raas.tasks) written into the run dir, or a file."""

    kind: Literal["arithmetic", "countdown", "file"] = Field(
        "arithmetic", description="Synthetic task, or 'file' to read `path`."
    )
    size: int = Field(512, ge=1, le=10_000_000, description="Synthetic records generated.")
    seed: int = Field(0, ge=0, description="Seed of the synthetic generator.")
    path: str | None = Field(None, description="JSONL or Parquet file; required by kind 'file'.")
    num_epochs: int = Field(0, ge=0, description="Epochs Dataflow runs; 0 means unbounded.")
    shuffle: bool = Field(True, description="Shuffle each epoch (seeded by `seed`).")
    ops: str = Field(
        "+", pattern=r"^[+*-]{1,3}$", description="Arithmetic: operators drawn from, of + - *."
    )
    max_operand: int = Field(99, ge=1, le=10**9, description="Arithmetic: operands 0..this.")

    @model_validator(mode="after")
    def _path(self) -> DatasetSpec:
        if (self.kind == "file") != (self.path is not None):
            raise ValueError("path is required with kind 'file' and only then")
        return self

    def task_params(self) -> dict[str, object]:
        """The generator's keyword arguments (astra.raas.tasks) for this kind."""
        if self.kind == "arithmetic":
            return {"ops": self.ops, "max_operand": self.max_operand}
        return {}


class WarmupSpec(Strict):
    """Supervised warm-up (`astra sft`) of every policy's model before RL starts.

    The records are the synthetic task's, generated with `seed` and disjoint from
    the RL prompts (no prompt in both), or the prompt/answer JSONL at `path`.
    The fine-tuned model (<run>/warmup/<policy>/model) is what the RaaS serve and
    the trainer starts from; summary.json reports the accuracy before and after.
    """

    steps: int = Field(1000, ge=0, le=10_000_000, description="SFT steps; 0: no warm-up.")
    lr: float = Field(3e-3, gt=0, le=1, description="AdamW learning rate.")
    batch_size: int = Field(64, ge=1, le=65536, description="Records per step.")
    size: int = Field(4096, ge=1, le=10_000_000, description="Synthetic records generated.")
    seed: int = Field(1, ge=0, description="Seed of the records and of the batch order.")
    path: str | None = Field(None, description="prompt/answer JSONL; None: synthetic.")
    threads: int = Field(1, ge=0, le=1024, description="torch CPU threads; 0: torch default.")


class EvalSpec(Strict):
    """Evaluation on held-out problems while the run trains (Dataflow evaluation streams).

    For each stream of `streams` (default: the first), at every `every_steps`-th
    version of that stream's first policy (version 0 included), the RaaS run `size`
    problems that neither RL nor the warm-up ever sees, `group_size` samples each at
    `temperature` (0: greedy), with the stream's workflow and scored by its reward
    (each policy of the stream on its own samples); never trained on. One evaluated stream runs as the
    Dataflow stream `eval`, several as `eval-<stream>`. Results: evals.jsonl,
    TensorBoard `eval/...` (`eval-<stream>/...`), plot.png and summary.json `eval`
    (the first evaluated stream; with several, each under `eval.streams`). The run
    waits (up to `final_wait_s`) for the evaluations of the last multiple before it
    stops. With a `file` dataset the held-out records come from `path` (without it:
    no evaluation).
    """

    every_steps: int = Field(50, ge=0, le=1_000_000, description="0: no evaluation.")
    size: int = Field(256, ge=1, le=1_000_000, description="Held-out problems generated.")
    seed: int = Field(2, ge=0, description="Seed of the held-out problems.")
    group_size: int = Field(1, ge=1, le=1024, description="Samples per problem.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature; 0 is greedy.")
    path: str | None = Field(None, description="prompt/answer JSONL; None: synthetic.")
    final_wait_s: float = Field(120.0, ge=0, description="Wait for the last evaluation.")
    streams: list[str] = Field(
        default_factory=list,
        description="Recipe streams evaluated, each with its workflow, policies and reward; "
        "empty: the first stream.",
    )


class PolicySpec(Strict):
    """One policy: trained by its own trainer process, served by the RaaS that name it."""

    id: str = Field(pattern=POLICY_ID_PATTERN, description="Policy id.")
    model: str = Field("tiny", description="'tiny' or a local Hugging Face directory.")
    batch_groups: int | None = Field(
        None, ge=1, le=65536, description="Groups per step; None: trainer.batch_groups."
    )
    buffer: BufferSettings = Field(default_factory=BufferSettings, description="Its buffer.")


class StreamSpec(Strict):
    """A prompt stream over the recipe's dataset."""

    name: str = Field("main", pattern=POLICY_ID_PATTERN, description="Prefix of group ids.")
    workflow: str = Field("single_turn", min_length=1, description="Workflow name.")
    policy_ids: list[str] = Field(default_factory=list, description="Policies; empty: all.")
    group_size: int = Field(4, ge=1, le=1024, description="Samples per prompt.")
    reward: str = Field(
        "", description="Reward name; empty: the synthetic task's, else the workflow default."
    )
    raas_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Only RaaS whose labels include all of these serve it; empty: any RaaS.",
    )
    sampling: SamplingSettings = Field(
        default_factory=lambda: SamplingSettings(max_new_tokens=8),
        description="Sampling of the rollouts.",
    )


class WeightsSpec(Strict):
    """Options of `astra serve weights`."""

    full_every: int = Field(20, ge=1, le=64, description="A full version every K versions.")
    max_chain: int = Field(128, ge=1, le=128, description="Most deltas a fetch plan bridges.")
    keep_versions: int = Field(8, ge=1, description="Newest versions always kept.")


def resolve_agent_command(argv: list[str]) -> list[str]:
    """`{python}` as this Python, and relative paths that exist as absolute ones (the agent
    runs in a directory of its own)."""
    import sys
    from pathlib import Path

    out = []
    for arg in argv:
        arg = arg.replace("{python}", sys.executable)
        if not arg.startswith("-") and "/" in arg and Path(arg).exists():
            arg = str(Path(arg).absolute())  # not resolve(): a venv's python is a link
        out.append(arg)
    return out


class RaasSpec(Strict):
    """One rollout service process (`astra serve raas`)."""

    name: str | None = Field(
        None, pattern=POLICY_ID_PATTERN, description="Instance id; None: raas-<index>."
    )
    capacity: int = Field(16, ge=1, le=1 << 20, description="Samples generated at once.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels for routing.")
    policies: list[str] = Field(default_factory=list, description="Policies; empty: all.")
    workflows: list[str] = Field(default_factory=list, description="Workflows; empty: streams'.")
    model: str | None = Field(None, description="Model; None: its first policy's model.")
    device: str = Field("cpu", description="Torch device.")
    on_swap: Literal["continue", "finish_old"] = Field("continue", description="On weight swap.")
    engine: Literal["torch", "vllm", "sglang", "openai"] = Field(
        "torch", description="Inference engine (vllm, sglang, openai: one policy per RaaS)."
    )
    engine_args: str = Field("", description="Extra arguments of a launched vLLM/SGLang server.")
    engine_python: str = Field(
        "",
        description="Python that runs a launched vLLM/SGLang server; empty: for vLLM "
        "$ASTRA_VLLM_PYTHON, else .venv-vllm (`make vllm`), else this Python.",
    )
    command: list[str] = Field(
        default_factory=list,
        description="An external RaaS instead of `astra serve raas`: its command line, with "
        "placeholders (astra.run.external); empty: the built-in one.",
    )
    agent_command: list[str] = Field(
        default_factory=list,
        description="Workflow agent: the program run per sample ({python}: this Python; "
        "relative paths from where `astra run` starts); it gets OPENAI_BASE_URL, "
        "OPENAI_API_KEY, ASTRA_MODEL, ASTRA_PROMPT and ASTRA_RECORD.",
    )
    agent_timeout_s: float = Field(60.0, gt=0.0, description="Workflow agent: time per run.")
    verifiers_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Workflow verifiers: verifiers' env config (taskset id, agent runtime, ...), "
        "as `verifiers eval` takes it (astra.workflows.verifiers_env).",
    )
    workflow_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Settings of the workflows it serves, by workflow name (e.g. openenv: "
        "{url: ..., max_turns: 3}; docs/agents.md).",
    )

    @model_validator(mode="after")
    def _external(self) -> RaasSpec:
        if self.agent_command:
            from astra.workflows.agent import check_command as check_agent

            self.agent_command = resolve_agent_command(self.agent_command)
            try:
                check_agent(self.agent_command)
            except ValueError as exc:
                raise ValueError(f"agent_command: {exc}") from None
        if "agent" in self.workflow_options:
            from astra.workflows.agent import check_options

            check_options(self.workflow_options["agent"])  # says workflow_options.agent.X
        if "openenv" in self.workflow_options:
            from astra.workflows.openenv_env import parse_options

            parse_options(self.workflow_options["openenv"])  # says workflow_options.openenv.X
        if not self.command:
            return self
        check_command(self.command)
        check_labels(self.command, self.labels)
        fields = type(self).model_fields
        built_in = [
            name
            for name in ("model", "device", "on_swap", "engine", "engine_args", "engine_python")
            if getattr(self, name) != fields[name].default
        ]
        if built_in:
            raise ValueError(
                f"command: {built_in} are options of `astra serve raas`; an external "
                "RaaS takes its own in its command line"
            )
        return self


class CheckpointSpec(Strict):
    """Trainer checkpoints under <run dir>/checkpoints/<policy>."""

    every_steps: int = Field(10, ge=0, description="A checkpoint every N steps; 0: never.")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept per policy.")


class TrainerSpec(Strict):
    """Settings of every trainer (one process per policy)."""

    num_steps: int = Field(300, ge=1, le=10_000_000, description="Steps; the run ends after.")
    batch_groups: int = Field(
        8, ge=1, le=65536, description="Groups per step (also Dataflow's batch_groups)."
    )
    device: str = Field("cpu", description="Torch device.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype.")
    seed: int = Field(0, ge=0, description="Seed of torch and Python RNGs.")
    max_wait_s: float = Field(10.0, gt=0, le=60, description="FetchBatch max_wait per call.")
    max_tokens_per_microbatch: int = Field(4096, ge=1, description="Padded tokens per forward.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy loss.")
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=1e-4), description="AdamW and clipping."
    )
    publish: PublishConfig = Field(default_factory=PublishConfig, description="Weights out.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoints.")
    lora: LoraConfig | None = Field(
        None, description="Train a LoRA adapter on the frozen model; None: full fine-tuning."
    )


class SupervisionSpec(Strict):
    """How children are started and stopped."""

    startup_timeout_s: float = Field(180.0, gt=0, description="Wait for a child's address line.")
    stop_grace_s: float = Field(15.0, ge=0, description="SIGTERM to SIGKILL.")
    log_tail_lines: int = Field(20, ge=0, le=1000, description="Log lines shown on a death.")
    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Times a child that died is started again (Dataflow, WeightService and "
        "trainers always, RaaS with on_raas_death: restart); 0: a death stops the run.",
    )
    restart_backoff_s: float = Field(
        1.0, ge=0, le=60, description="Wait before a restart; doubles with each of a child's."
    )
    max_dropped_in_a_row: int = Field(
        2000,
        ge=0,
        description="End the run as stalled when this many finished groups of one policy in a "
        "row were dropped (filtered, failed, stale, malformed) and its buffer holds less than a "
        "batch: no batch can form (say, every group equal-reward once the policy solves its "
        "data); 0: wait forever. Keep it above the groups one version can have in flight.",
    )
    max_refused_in_a_row: int = Field(
        20,
        ge=0,
        description="End the run as failed when every active RaaS refused this many submits "
        "in a row as invalid (a reward or workflow it cannot resolve, say): Dataflow keeps "
        "sending, nothing is ever accepted; 0: wait forever.",
    )
    max_load_failures_in_a_row: int = Field(
        20,
        ge=0,
        description="End the run as failed when every active RaaS failed to load the policies' "
        "new weights this many times in a row (retries back off to 30 s: 20 is about 9 "
        "minutes): a version that cannot be loaded (refused as VERSION_BAD, a WeightService "
        "it cannot reach) holds the run; 0: wait forever.",
    )
    progress_warn_s: float = Field(
        300.0,
        ge=0,
        description="Warn, saying what Dataflow reports (gate, buffer, RaaS), while a trainer "
        "has taken no step for this long; again as often while it lasts; 0: never.",
    )
    max_idle_s: float = Field(
        0.0,
        ge=0,
        description="End the run as stalled once a trainer has taken no step for this long "
        "(not while it is paused); 0: wait forever.",
    )
    max_log_bytes: int = Field(
        256 << 20,
        ge=0,
        description="A log in RUN_DIR/logs past this size is copied to <name>.log.1 and "
        "emptied (astra.run.logrotate; the supervisor's own log rolls over the same way); "
        "0: logs grow without bound. Children placed by Ray have theirs rotated by their "
        "actor, on their node.",
    )
    log_backups: int = Field(
        3,
        ge=0,
        le=100,
        description="Rotated copies kept of each log (<name>.log.1 the newest); 0: a full log "
        "is emptied, nothing kept.",
    )
    log_check_interval_s: float = Field(
        2.0, gt=0, le=3600, description="How often the logs' sizes are looked at."
    )


class ObserveSpec(Strict):
    """The live view, metrics.jsonl and summary.json."""

    poll_interval_s: float = Field(1.0, gt=0, le=60, description="GetStatus period.")
    baseline_samples: int = Field(
        256, ge=0, le=100_000, description="Samples of the initial model for the random baseline."
    )
    status_every_s: float = Field(5.0, gt=0, description="Status line period when not a TTY.")
    prometheus: bool = Field(
        False,
        description="Every service serves Prometheus /metrics on a free port (run.json "
        "`metrics_port`); Dataflow's own `dataflow.metrics_port` wins when set.",
    )


class ElasticEvent(Strict):
    """One scheduled change of the RaaS pool (`elastic:`).

    The events happen in list order, each once its trigger is reached and the one
    before it has happened: `at_step` when every trainer has reached that step
    (Dataflow's current version or the trainer's step line, whichever is further),
    `at_s` that many seconds after the run's services were all up. `add` starts a
    RaaS (like an entry of `raas:`, its name required); `remove` stops one by name:
    SIGTERM, it deregisters, and Dataflow dispatches again what it held.
    """

    at_step: int | None = Field(None, ge=1, le=10_000_000, description="Trainer step reached.")
    at_s: float | None = Field(
        None, ge=0, le=31_536_000, description="Seconds after the services were all up."
    )
    add: RaasSpec | None = Field(None, description="A RaaS started; `name` is required.")
    remove: str | None = Field(
        None, pattern=POLICY_ID_PATTERN, description="Name of a running RaaS to stop."
    )

    @model_validator(mode="after")
    def _one_of_each(self) -> ElasticEvent:
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError("give exactly one of at_step and at_s")
        if (self.add is None) == (self.remove is None):
            raise ValueError("give exactly one of add and remove")
        if self.add is not None and self.add.name is None:
            raise ValueError("add.name is required")
        return self

    @property
    def trigger(self) -> str:
        return f"step {self.at_step}" if self.at_step is not None else f"{self.at_s:g}s"
