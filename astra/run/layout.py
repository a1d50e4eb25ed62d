"""The run directory and the command line of every child service, built from a recipe.

Layout of a run directory:
    recipe.yaml              the resolved recipe (what --resume reads back)
    run.json                 supervisor (pid, state), children (name, role, pid, address,
                             command, returncode), RaaS removed, elastic events
    control/                 `astra raas add|remove` requests and answers (astra.run.control)
    data/prompts.jsonl       the synthetic dataset (kind != file)
    data/eval.jsonl          the held-out evaluation records (synthetic, disjoint)
    warmup/data.jsonl        the warm-up's prompt/answer records (synthetic, disjoint)
    warmup/<policy>/data.jsonl   a policy's own warm-up records, when its role has them
    warmup/<policy>/model/   each policy's model after the warm-up (what RL starts from)
    config/*.yaml            Dataflow and trainer configs as the services read them
    state/dataflow/          Dataflow's SQLite state and blob log
    state/weights/           the WeightService's version store
    state/<raas name>/       each RaaS's receiver directories
    checkpoints/<policy>/    trainer checkpoints
    logs/<child>.log         each child's stderr (and anything after its address line)
    metrics.jsonl            one row per trainer step observed (astra.run.observe)
    evals.jsonl              one row per finished held-out evaluation
    summary.json             end-of-run figures (astra.run.summary)
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from astra.damage import Damaged
from astra.dataflow.config import DataflowConfig
from astra.durable import make_dirs, write_durably
from astra.run import external
from astra.run.recipe import PolicySpec, RaasSpec, Recipe, dump_recipe
from astra.trainer.ckpt_verify import list_checkpoints, newest_good
from astra.trainer.config import TrainerConfig


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", self.root.resolve())

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def dataset(self) -> Path:
        return self.root / "data" / "prompts.jsonl"

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def dataflow_state(self) -> Path:
        return self.state / "dataflow"

    @property
    def weights_store(self) -> Path:
        return self.state / "weights"

    def log(self, child: str) -> Path:
        return self.root / "logs" / f"{child}.log"

    def checkpoints(self, policy_id: str) -> Path:
        return self.root / "checkpoints" / policy_id

    @property
    def eval_data(self) -> Path:
        return self.root / "data" / "eval.jsonl"

    @property
    def evals(self) -> Path:
        return self.root / "evals.jsonl"

    @property
    def warmup_data(self) -> Path:
        return self.root / "warmup" / "data.jsonl"

    def warmup_model(self, policy_id: str) -> Path:
        return self.root / "warmup" / policy_id / "model"


def prepare(recipe: Recipe, rd: RunDir) -> Path:
    """Creates the directories, writes the recipe and the dataset; returns the dataset path."""
    for d in (rd.config, rd.state, rd.root / "logs", rd.root / "data"):
        make_dirs(d)
    write_durably(rd.recipe, dump_recipe(recipe))
    ds = recipe.dataset
    if ds.kind == "file":
        assert ds.path is not None  # the recipe checks it
        path = Path(ds.path).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"dataset.path: {path} is not a file")
        return path
    if not rd.dataset.is_file():  # on --resume the file is kept: Dataflow refuses a changed one
        from astra.raas.tasks import write_dataset

        write_dataset(ds.kind, rd.dataset, ds.size, ds.seed, **ds.task_params())
    return rd.dataset


def _records_apart(
    recipe: Recipe, given: str | None, key: str, out: Path, size: int, seed: int, apart: list[Path]
) -> Path:
    """The JSONL the recipe names at `key` (`given`), or `size` records of the dataset's
    synthetic task written once to `out`, sharing no prompt with the files in `apart`."""
    if given is not None:
        path = Path(given).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{key}: {path} is not a file")
        return path
    if not out.is_file():
        from astra.raas.tasks import generate_records, read_records, write_records

        ds = recipe.dataset
        seen = {str(r["prompt"]) for p in apart for r in read_records(p)}
        write_records(generate_records(ds.kind, size, seed, exclude=seen, **ds.task_params()), out)
    return out


def eval_data(recipe: Recipe, rd: RunDir, dataset: Path) -> Path:
    """The held-out records: eval.path, or synthetic ones that share no prompt with the RL
    dataset (nor, since the warm-up excludes them in turn, with the warm-up's)."""
    e = recipe.eval
    return _records_apart(recipe, e.path, "eval.path", rd.eval_data, e.size, e.seed, [dataset])


def warmup_data(recipe: Recipe, rd: RunDir, dataset: Path) -> Path:
    """The warm-up's records: warmup.path, or synthetic ones that share no prompt with the RL
    dataset (so what RL scores was never shown with its answer) nor with the held-out ones."""
    w = recipe.warmup
    apart = [dataset, *([eval_data(recipe, rd, dataset)] if recipe.evaluating else [])]
    return _records_apart(recipe, w.path, "warmup.path", rd.warmup_data, w.size, w.seed, apart)


def policy_warmup_data(recipe: Recipe, rd: RunDir, data: Path, policy_id: str) -> Path:
    """The records `policy_id` is fine-tuned on: `data`, or, when the workflow of the first
    stream naming it gives its position there records of its own (`warmup_records(records,
    role, seed)`, e.g. multi_agent's verifier), those (written once)."""
    from astra.workflows.registry import get_workflow

    stream = next((s for s in recipe.streams if policy_id in recipe.stream_policies(s)), None)
    if stream is None or recipe.warmup.path is not None:
        return data
    make = getattr(get_workflow(stream.workflow), "warmup_records", None)
    role = recipe.stream_policies(stream).index(policy_id)
    if make is None or role == 0:
        return data
    path = rd.warmup_model(policy_id).parent / "data.jsonl"
    if not path.is_file():
        from astra.raas.tasks import read_records, write_records

        path.parent.mkdir(parents=True, exist_ok=True)
        write_records(make(read_records(data), role, recipe.warmup.seed), path)
    return path


def sft_command(recipe: Recipe, policy: PolicySpec, rd: RunDir, data: Path) -> list[str]:
    w = recipe.warmup
    return [
        *(sys.executable, "-m", "astra.cli", "sft", policy.model, str(data)),
        *("--out", str(rd.warmup_model(policy.id)), "--steps", str(w.steps)),
        *("--lr", str(w.lr), "--batch-size", str(w.batch_size), "--seed", str(w.seed)),
        *("--device", recipe.trainer.device, "--threads", str(w.threads)),
        *(("--chat",) if recipe.chat_shaped(policy.id) else ()),
    ]


def after_warmup(recipe: Recipe, rd: RunDir) -> Recipe:
    """The recipe the services start from: each warmed-up policy's model is its warm-up output
    (RaaS that name a model of their own keep it)."""
    if not recipe.warmup.steps:
        return recipe
    policies = [p.model_copy(update={"model": str(rd.warmup_model(p.id))}) for p in recipe.policies]
    return recipe.model_copy(update={"policies": policies})


def vocab_size(model: str) -> int | None:
    """Rows of the model's embedding: `tiny`'s, or config.json `vocab_size` of a directory
    (None when it says none: Dataflow then leaves token ids unchecked)."""
    # astra.engine.tiny.TINY: importing that module imports torch (a second or more on a
    # loaded machine), which a directory (a warm-up's, whose services start next) never needs.
    if model == "tiny":
        from astra.engine.tiny import TINY_CONFIG

        return int(TINY_CONFIG["vocab_size"])
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") if isinstance(config, dict) else None
    return size if isinstance(size, int) and size > 0 else None


def dataflow_config(recipe: Recipe, rd: RunDir, dataset: Path, port: int = 0) -> DataflowConfig:
    section = recipe.dataflow.model_dump(mode="json")
    ds = recipe.dataset
    policies = [
        {
            "id": p.id,
            "batch_groups": recipe.batch_groups(p),
            "buffer": p.buffer.model_dump(),
            "vocab_size": vocab_size(p.model),
        }
        for p in recipe.policies
    ]
    streams = [
        {
            "name": s.name,
            "dataset": {
                "path": str(dataset),
                "num_epochs": ds.num_epochs,
                "shuffle": ds.shuffle,
                "seed": ds.seed,
            },
            "workflow": s.workflow,
            "policy_ids": recipe.stream_policies(s),
            "group_size": s.group_size,
            "reward": recipe.stream_reward(s),
            "raas_labels": dict(s.raas_labels),
            "sampling": s.sampling.model_dump(),
        }
        for s in recipe.streams
    ]
    if recipe.evaluating:
        by_name = {s["name"]: s for s in streams}
        for name, spec in recipe.eval_streams():
            streams.append(eval_stream(recipe, rd, dataset, by_name[spec.name], name))
    raw = {**section, "host": "127.0.0.1", "port": port, "state_dir": str(rd.dataflow_state)}
    if recipe.observe.prometheus and raw.get("metrics_port") is None:
        raw["metrics_port"] = 0
    return DataflowConfig.model_validate({**raw, "policies": policies, "streams": streams})


def eval_stream(recipe: Recipe, rd: RunDir, dataset: Path, stream: dict, name: str) -> dict:
    """An evaluation stream `name`: `stream`'s workflow, policies and reward on held-out data."""
    e = recipe.eval
    return {
        **stream,
        "name": name,
        "dataset": {"path": str(eval_data(recipe, rd, dataset)), "shuffle": False},
        "group_size": e.group_size,
        "sampling": {**stream["sampling"], "temperature": e.temperature},
        "eval_every_versions": e.every_steps,
    }


def trainer_config(
    recipe: Recipe, policy: PolicySpec, rd: RunDir, *, dataflow: str, weights: str, resume: bool
) -> TrainerConfig:
    t = recipe.trainer
    done = checkpoint_step(rd.checkpoints(policy.id)) if resume else None
    raw = {
        "policy_id": policy.id,
        "model": policy.model,
        "dataflow": dataflow,
        "weights": weights,
        "trainer_id": f"trainer-{policy.id}"[:64],
        "host": "127.0.0.1",
        "port": 0,
        "device": t.device,
        "dtype": t.dtype,
        "seed": t.seed,
        "num_steps": max(1, t.num_steps - (done or 0)),
        "loss": t.loss.model_dump(),
        "optim": t.optim.model_dump(),
        "publish": t.publish.model_dump(),
        "lora": t.lora.model_dump() if t.lora is not None else None,
        "batch": {
            "num_groups": recipe.batch_groups(policy),
            "max_wait_s": t.max_wait_s,
            "max_tokens_per_microbatch": t.max_tokens_per_microbatch,
        },
        "metrics_port": 0 if recipe.observe.prometheus else None,
        "checkpoint": {
            "dir": str(rd.checkpoints(policy.id)),
            "every_steps": t.checkpoint.every_steps,
            "keep_last": t.checkpoint.keep_last,
            "resume": done is not None,
            # The checkpoint a SIGTERM writes must land before the stop's SIGKILL.
            "stop_timeout_s": recipe.supervision.stop_grace_s * 2 / 3,
        },
    }
    return TrainerConfig.model_validate(raw)


def checkpoint_step(root: Path) -> int | None:
    """Step of the checkpoint a trainer resumes from under `root`: the newest that verifies
    (astra.trainer.ckpt_verify). With every one damaged, the newest's step: the trainer is
    started to resume, and refuses them naming the directory."""
    try:
        found = newest_good(root)
    except Damaged:
        found = list_checkpoints(root)[-1]
    if found is None:
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return int(json.loads((found / "trainer.json").read_text()).get("step", 0))
    return int(found.name.removeprefix("step-"))


def remaining_steps(recipe: Recipe, rd: RunDir) -> dict[str, int]:
    """Steps each policy's trainer still has to run (recipe steps minus its checkpoint)."""
    return {
        p.id: recipe.trainer.num_steps - (checkpoint_step(rd.checkpoints(p.id)) or 0)
        for p in recipe.policies
    }


def serve_command(service: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "astra.cli", "serve", service, *args]


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def dataflow_command(recipe: Recipe, rd: RunDir, dataset: Path, port: int = 0) -> list[str]:
    config = dataflow_config(recipe, rd, dataset, port)
    path = write_yaml(rd.config / "dataflow.yaml", config.model_dump(mode="json"))
    return serve_command("dataflow", "--config", str(path))


def previous_run(rd: RunDir) -> dict:
    """The run dir's run.json as the last run left it ({} if none or unreadable)."""
    try:
        return json.loads(rd.run_json.read_text())
    except (OSError, ValueError):
        return {}


def previous_port(previous: dict, child: str) -> int:
    """The port `child` had in a run dir's previous run.json (0 if none): on --resume the
    WeightService comes back on it, because Dataflow keeps each announced version's address."""
    for c in previous.get("children", []):
        if c.get("name") == child and c.get("address"):
            return int(str(c["address"]).rpartition(":")[2])
    return 0


def weights_command(recipe: Recipe, rd: RunDir, port: int = 0) -> list[str]:
    w = recipe.weights
    return serve_command(
        "weights",
        *("--store", str(rd.weights_store), "--port", str(port)),
        *("--full-every", str(w.full_every), "--max-chain", str(w.max_chain)),
        *("--keep-versions", str(w.keep_versions)),
        *(("--metrics-port", "0") if recipe.observe.prometheus else ()),
    )


def raas_command(recipe: Recipe, index: int, rd: RunDir, dataflow: str) -> list[str]:
    return raas_spec_command(recipe, recipe.raas[index], recipe.raas_names[index], rd, dataflow)


def raas_spec_command(
    recipe: Recipe, spec: RaasSpec, name: str, rd: RunDir, dataflow: str
) -> list[str]:
    """`astra serve raas` for one RaaS, of the recipe's `raas:` or added during the run."""
    policies = recipe.raas_policies(spec)
    if spec.command:  # an external RaaS (astra.run.external)
        workflows = recipe.raas_workflows(spec)
        (rd.state / name).mkdir(parents=True, exist_ok=True)
        return external.fill(
            spec.command,
            {
                "dataflow": dataflow,
                "instance_id": name,
                "capacity": spec.capacity,
                "state_dir": rd.state / name,
                "run_dir": rd.root,
                "policy": policies[0],
                "policies": ",".join(policies),
                "workflow": workflows[0] if workflows else "",
                "workflows": ",".join(workflows),
                "labels": external.labels_text(spec.labels),
            },
        )
    model = spec.model or next(p.model for p in recipe.policies if p.id == policies[0])
    args = ["--dataflow", dataflow, "--model", model, "--capacity", str(spec.capacity)]
    args += ["--instance-id", name, "--state-dir", str(rd.state / name), "--port", "0"]
    args += ["--device", spec.device, "--on-swap", spec.on_swap]
    args += ["--engine", spec.engine]
    engine_args = spec.engine_args
    if spec.engine == "vllm" and recipe.trainer.lora is not None:  # adapter versions: LoRA API
        from astra.engine.http.vllm_lora import server_args

        extra = server_args(recipe.trainer.lora.rank, engine_args.split())
        engine_args = " ".join([engine_args, *extra]).strip()
    args += [f"--engine-args={engine_args}"] if engine_args else []
    args += ["--engine-python", spec.engine_python] if spec.engine_python else []
    args += [a for p in policies for a in ("--policy", p)]
    args += [a for w in recipe.raas_workflows(spec) for a in ("--workflow", w)]
    if spec.agent_command:
        args += ["--agent-command", shlex.join(spec.agent_command)]
        args += ["--agent-timeout", str(spec.agent_timeout_s)]
    if spec.verifiers_env:
        args += ["--verifiers-env", json.dumps(spec.verifiers_env)]
    if spec.workflow_options:
        args += ["--workflow-options", json.dumps(spec.workflow_options)]
    args += [a for k, v in sorted(spec.labels.items()) for a in ("--label", f"{k}={v}")]
    args += ["--metrics-port", "0"] if recipe.observe.prometheus else []
    return serve_command("raas", *args)


def trainer_command(recipe: Recipe, policy: PolicySpec, rd: RunDir, **kw: object) -> list[str]:
    config = trainer_config(recipe, policy, rd, **kw)  # type: ignore[arg-type]
    path = write_yaml(rd.config / f"trainer-{policy.id}.yaml", config.model_dump(mode="json"))
    return serve_command("trainer", "--config", str(path))
