"""The typed recipe of `astra run`: what to start, with which settings, and how to supervise it.

A recipe is YAML; every field is documented and bounded here and unknown keys
are an error naming the key. `Recipe()` (no file) is the embedded default: the
`tiny` model on synthetic two-digit additions, CPU only: a supervised warm-up
on problems disjoint from the RL prompts, then Dataflow, a WeightService, two
RaaS and one trainer. `elastic:` adds and removes RaaS during the run by
schedule (astra.run.elastic; `astra raas add|remove` does it by hand). Dotted
overrides (`trainer.num_steps=5`, `raas.0.capacity=4`; values parsed as YAML
scalars) apply on top of the file.
The sections (astra.run.sections) reuse the Dataflow and trainer config models.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from astra.config import ConfigError, Strict
from astra.dataflow.config import POLICY_ID_PATTERN, BufferSettings
from astra.run.overrides import OverrideError, apply_override, parse_overrides
from astra.run.sections import (
    DataflowSection,
    DatasetSpec,
    ElasticEvent,
    EvalSpec,
    ObserveSpec,
    PolicySpec,
    RaasSpec,
    StreamSpec,
    SupervisionSpec,
    TrainerSpec,
    WarmupSpec,
    WeightsSpec,
)

# The synthetic tasks' rewards: an arithmetic answer is right when the text before
# end-of-sequence is exactly the number (astra.rewards.answers).
TASK_REWARDS = {"arithmetic": "exact_match", "countdown": "countdown"}


class RecipeError(ConfigError):
    """A recipe that cannot be used; the message names the key."""


# Names of the run's other children (and their logs): a RaaS may not take them.
RESERVED_NAMES = frozenset({"dataflow", "weights", "supervisor"})
RESERVED_PREFIXES = ("trainer-", "warmup-")
EVAL_STREAM = "eval"  # the Dataflow stream of the recipe's `eval:` section (one stream evaluated)
EVAL_PREFIX = "eval-"  # with several, `eval-<stream>` each


def reserved_name(name: str) -> bool:
    """Whether `name` is (or may be) another child's: a RaaS may not be called so."""
    return name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES)


__all__ = [
    "DatasetSpec",
    "ElasticEvent",
    "EvalSpec",
    "OverrideError",
    "PolicySpec",
    "RaasSpec",
    "Recipe",
    "RecipeError",
    "StreamSpec",
    "TrainerSpec",
    "WarmupSpec",
    "dump_recipe",
    "load_recipe",
]


class Recipe(Strict):
    """One run of the whole system."""

    name: str = Field("default", pattern=POLICY_ID_PATTERN, description="Run name.")
    description: str = Field("", description="Free text.")
    dataset: DatasetSpec = Field(default_factory=DatasetSpec, description="Prompts.")
    warmup: WarmupSpec = Field(
        default_factory=WarmupSpec,
        description="Supervised warm-up before RL; steps 0 turns it off.",
    )
    eval: EvalSpec = Field(
        default_factory=EvalSpec,
        description="Held-out evaluation while training; every_steps 0 turns it off.",
    )
    policies: list[PolicySpec] = Field(
        default_factory=lambda: [
            PolicySpec(id="policy", buffer=BufferSettings(drop_equal_rewards=False))
        ],
        min_length=1,
        description="Policies trained, one trainer each.",
    )
    streams: list[StreamSpec] = Field(
        default_factory=lambda: [StreamSpec()], min_length=1, description="Prompt streams."
    )
    dataflow: DataflowSection = Field(  # type: ignore[valid-type]
        default_factory=lambda: DataflowSection(grace_s=2.0), description="Dataflow settings."
    )
    weights: WeightsSpec = Field(default_factory=WeightsSpec, description="WeightService.")
    raas: list[RaasSpec] = Field(
        default_factory=lambda: [RaasSpec(), RaasSpec()], min_length=1, description="RaaS."
    )
    elastic: list[ElasticEvent] = Field(
        default_factory=list,
        description="RaaS added and removed during the run, by schedule, in list order.",
    )
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Every trainer.")
    on_raas_death: Literal["restart", "continue", "stop"] = Field(
        "restart",
        description="A RaaS that dies: start it again (supervision.max_restarts, then carry "
        "on without it), carry on without it, or stop the run.",
    )
    supervision: SupervisionSpec = Field(default_factory=SupervisionSpec, description="Children.")
    observe: ObserveSpec = Field(default_factory=ObserveSpec, description="Outputs.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra child environment.")
    tls: bool = Field(
        False,
        description="Mutual TLS between the run's processes: a CA and a loopback credential "
        "are made in RUN_DIR/tls (kept on --resume); with --ray each child also gets one for "
        "its node's address, in RUN_DIR/tls/nodes. `astra --tls DIR run` uses DIR instead.",
    )

    @property
    def evaluating(self) -> bool:
        """Whether the run evaluates on held-out data: eval.every_steps > 0 and held-out
        records to use (eval.path, or a synthetic dataset kind to generate them from; a
        `file` dataset without eval.path has none, so nothing is evaluated)."""
        return bool(self.eval.every_steps) and (
            self.dataset.kind != "file" or self.eval.path is not None
        )

    @model_validator(mode="after")
    def _refs(self) -> Recipe:
        if self.warmup.steps and self.dataset.kind == "file" and self.warmup.path is None:
            raise ValueError(
                "warmup: with dataset kind 'file' the warm-up needs warmup.path "
                "(prompt/answer JSONL), or warmup.steps=0"
            )
        names = [s.name for s in self.streams]
        if unknown := [n for n in self.eval.streams if n not in names]:
            raise ValueError(f"eval.streams: unknown streams {unknown} (streams: {names})")
        if len(set(self.eval.streams)) != len(self.eval.streams):
            raise ValueError("eval.streams: a stream is named twice")
        if self.evaluating and (long := [n for n, _ in self.eval_streams() if len(n) > 128]):
            raise ValueError(
                f"eval.streams: the evaluation streams {long} would be named over 128 "
                "characters (eval-<stream>): shorten those streams' names"
            )
        if self.evaluating and (taken := {n for n, _ in self.eval_streams()} & set(names)):
            raise ValueError(f"streams: the names {sorted(taken)} are the evaluations'")
        ids = [p.id for p in self.policies]
        if len(set(ids)) != len(ids):
            raise ValueError("policies: duplicate policy id")
        for kind, names in (("streams", [s.name for s in self.streams]), ("raas", self.raas_names)):
            if len(set(names)) != len(names):
                raise ValueError(f"{kind}: duplicate name")
        if reserved := [n for n in self.raas_names if reserved_name(n)]:
            raise ValueError(f"raas: names {reserved} are the run's other children's")
        for label, refs in [(f"streams.{s.name}", s.policy_ids) for s in self.streams] + [
            (f"raas.{n}", r.policies) for n, r in zip(self.raas_names, self.raas, strict=True)
        ]:
            if unknown := [p for p in refs if p not in ids]:
                raise ValueError(f"{label}: unknown policies {unknown}")
        for s in self.streams:
            if not any(self.serves(r, s) for r in self.raas):
                raise ValueError(
                    f"streams.{s.name}: no RaaS serves its workflow, policies and raas_labels"
                )
            temperature = s.sampling.temperature
            if temperature > 0 and temperature != self.trainer.loss.temperature:
                raise ValueError(
                    f"streams.{s.name}.sampling.temperature {temperature} differs from "
                    f"trainer.loss.temperature {self.trainer.loss.temperature}"
                )
        self._check_elastic()
        return self

    def _check_elastic(self) -> None:
        """Plays the schedule in list order: every name and step must make sense then."""
        live = dict(zip(self.raas_names, self.raas, strict=True))
        last: dict[str, tuple[int, float]] = {}
        for i, e in enumerate(self.elastic):
            key = f"elastic.{i}"
            kind, at = ("at_step", e.at_step) if e.at_step is not None else ("at_s", e.at_s)
            assert at is not None  # ElasticEvent checks one trigger is given
            if kind == "at_step" and at > self.trainer.num_steps:
                raise ValueError(
                    f"{key}.at_step: {at} is beyond trainer.num_steps "
                    f"{self.trainer.num_steps}: it would never happen"
                )
            if kind in last and at < last[kind][1]:
                raise ValueError(
                    f"{key}.{kind}: {at:g} is before elastic.{last[kind][0]}.{kind} "
                    f"{last[kind][1]:g}: the events happen in list order"
                )
            last[kind] = (i, at)
            if e.add is not None:
                name = str(e.add.name)
                if name in live:
                    raise ValueError(f"{key}.add.name: RaaS {name!r} is already running then")
                if reserved_name(name):
                    raise ValueError(f"{key}.add.name: {name!r} is another child's name")
                ids = [p.id for p in self.policies]
                if unknown := [p for p in e.add.policies if p not in ids]:
                    raise ValueError(f"{key}.add.policies: unknown policies {unknown}")
                live[name] = e.add
            else:
                if e.remove not in live:
                    raise ValueError(
                        f"{key}.remove: no RaaS {e.remove!r} is running then "
                        f"(running: {', '.join(live)})"
                    )
                del live[str(e.remove)]
                if not live:
                    raise ValueError(f"{key}.remove: it would leave no RaaS")
            for s in self.streams:
                if not any(self.serves(r, s) for r in live.values()):
                    raise ValueError(f"{key}: after it no RaaS serves streams.{s.name}")

    def eval_streams(self) -> list[tuple[str, StreamSpec]]:
        """(Dataflow stream name, recipe stream) of each evaluation, in `eval.streams` order:
        `eval` when one stream is evaluated, `eval-<stream>` each when several are."""
        by_name = {s.name: s for s in self.streams}  # (eval.streams names only these: _refs)
        chosen = [by_name[n] for n in self.eval.streams] or self.streams[:1]
        if len(chosen) == 1:
            return [(EVAL_STREAM, chosen[0])]
        return [(f"{EVAL_PREFIX}{s.name}", s) for s in chosen]

    @property
    def raas_names(self) -> list[str]:
        return [r.name or f"raas-{i}" for i, r in enumerate(self.raas)]

    def stream_policies(self, stream: StreamSpec) -> list[str]:
        return stream.policy_ids or [p.id for p in self.policies]

    def chat_shaped(self, policy_id: str) -> bool:
        """Whether the first stream serving the policy runs a chat-shaped workflow (the prompt
        through the model's chat template): its warm-up and baseline render prompts so too."""
        from astra.workflows.registry import get_workflow

        for stream in self.streams:
            if policy_id in self.stream_policies(stream):
                return bool(getattr(get_workflow(stream.workflow), "chat", False))
        return False

    def raas_policies(self, raas: RaasSpec) -> list[str]:
        return raas.policies or [p.id for p in self.policies]

    def raas_workflows(self, raas: RaasSpec) -> list[str]:
        return raas.workflows or sorted({s.workflow for s in self.streams})

    def serves(self, raas: RaasSpec, stream: StreamSpec) -> bool:
        """Whether Dataflow may route the stream's work to the RaaS (astra.dataflow.pool)."""
        return (
            set(self.stream_policies(stream)) <= set(self.raas_policies(raas))
            and stream.workflow in self.raas_workflows(raas)
            and stream.raas_labels.items() <= raas.labels.items()
        )

    def batch_groups(self, policy: PolicySpec) -> int:
        return policy.batch_groups or self.trainer.batch_groups

    def stream_reward(self, stream: StreamSpec) -> str:
        return stream.reward or TASK_REWARDS.get(self.dataset.kind, "")


RECIPES_DIR = Path("configs") / "recipes"


def recipe_dirs() -> list[Path]:
    """Where recipes are found by name: ./configs/recipes, then the source tree's."""
    source = Path(__file__).resolve().parents[2] / RECIPES_DIR
    return list(dict.fromkeys(p for p in (Path.cwd() / RECIPES_DIR, source) if p.is_dir()))


def find_recipe(name: str) -> Path:
    """A recipe file: `name` itself when it is a file, else configs/recipes/<name>.yaml;
    RecipeError (naming the known recipes, and the near one) when neither exists."""
    path = Path(name)
    if path.is_file():
        return path
    if path.is_dir():
        raise RecipeError(f"{name}: a directory, not a recipe file (--resume DIR resumes a run)")
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    if path.parent == Path("."):
        for directory in recipe_dirs():
            if (directory / f"{stem}.yaml").is_file():
                return directory / f"{stem}.yaml"
    known = sorted({p.stem for d in recipe_dirs() for p in d.glob("*.yaml")})
    close = difflib.get_close_matches(stem, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise RecipeError(
        f"recipe {name!r}: no such file, nor a recipe of that name in configs/recipes.{hint} "
        f"Known: {', '.join(known) or 'none'}."
    )


def load_recipe(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Recipe:
    """The recipe in `path` (None: the embedded default) with dotted overrides applied."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise RecipeError(f"{path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise RecipeError(f"{path}: the top level must be a mapping")
        data = loaded or {}
    defaults = Recipe().model_dump(mode="json")
    try:
        for keys, value in parse_overrides(overrides):
            apply_override(data, keys, value, defaults)
    except OverrideError as exc:
        raise RecipeError(str(exc)) from exc
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
        raise RecipeError(f"invalid recipe{f' {path}' if path else ''}: {problems}") from exc


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (what the run dir keeps, and what --resume reads)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
