"""The shipped recipes multi_policy, tool_use and gpu_hf: they load, resolve into the service
configs and child commands they mean (parsed by the real `astra serve` command lines), and
tool_use starts and trains a few steps with real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from astra.cli import main as astra_cli
from astra.run import layout
from astra.run.layout import RunDir
from astra.run.recipe import Recipe, RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "configs" / "recipes"
MODEL = "/models/Qwen3-0.6B"  # never read: only the commands are built


def serve_params(args: list[str]) -> dict:
    """`astra serve <service> ...` parsed by the real click command: its parameters."""
    assert args[1:4] == ["-m", "astra.cli", "serve"], args
    serve = astra_cli.commands["serve"]
    command = serve.commands[args[4]]
    ctx = command.make_context(args[4], list(args[5:]))
    return ctx.params


def built(recipe: Recipe, tmp_path: Path) -> tuple[RunDir, Path]:
    rd = RunDir(tmp_path / "run")
    return rd, layout.prepare(recipe, rd)


def test_multi_policy_is_two_trainers_one_stream_under_lockstep(tmp_path: Path) -> None:
    r = load_recipe(RECIPES / "multi_policy.yaml")
    assert [p.id for p in r.policies] == ["solver", "verifier"] and r.warmup.steps > 0
    rd, dataset = built(r, tmp_path)
    df = layout.dataflow_config(r, rd, dataset)
    assert df.versions.barrier == "lockstep"
    (stream,) = [s for s in df.streams if not s.eval_every_versions]
    assert stream.workflow == "multi_agent" and stream.policy_ids == ["solver", "verifier"]
    assert stream.reward == "exact_match"
    assert [p.id for p in df.policies] == ["solver", "verifier"]
    assert all(not p.buffer.drop_equal_rewards for p in df.policies)
    for i in range(len(r.raas)):
        raas = serve_params(layout.raas_command(r, i, rd, "127.0.0.1:1"))
        assert raas["policies"] == ("solver", "verifier")  # one RaaS serves both agents
        assert raas["workflows"] == ("multi_agent",) and raas["engine"] == "torch"
    for p in r.policies:  # one trainer per policy
        args = layout.trainer_command(r, p, rd, dataflow="h:1", weights="h:2", resume=False)
        cfg = layout.trainer_config(r, p, rd, dataflow="h:1", weights="h:2", resume=False)
        assert serve_params(args)["config_path"] == str(rd.config / f"trainer-{p.id}.yaml")
        assert cfg.policy_id == p.id and cfg.batch.num_groups == r.trainer.batch_groups


def test_tool_use_serves_the_multi_turn_workflow(tmp_path: Path) -> None:
    r = load_recipe(RECIPES / "tool_use.yaml")
    rd, dataset = built(r, tmp_path)
    records = [json.loads(x) for x in dataset.read_text().splitlines()]
    assert all("*" in rec["prompt"] for rec in records)
    (stream,) = [
        s for s in layout.dataflow_config(r, rd, dataset).streams if not s.eval_every_versions
    ]
    assert stream.workflow == "multi_turn_tools" and stream.reward == "numeric"
    raas = serve_params(layout.raas_command(r, 0, rd, "127.0.0.1:1"))
    assert raas["workflows"] == ("multi_turn_tools",) and raas["model"] == "tiny"


def test_gpu_hf_needs_a_model_path_and_resolves_to_cuda_and_vllm(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"policies\.0\.model"):
        load_recipe(RECIPES / "gpu_hf.yaml")
    r = load_recipe(RECIPES / "gpu_hf.yaml", [f"policies.0.model={MODEL}"])
    assert r.warmup.steps == 0 and r.observe.baseline_samples == 0
    rd, dataset = built(r, tmp_path)
    (stream,) = [
        s for s in layout.dataflow_config(r, rd, dataset).streams if not s.eval_every_versions
    ]
    assert stream.reward == "countdown" and stream.sampling.stop_strings == ["\n"]
    raas = serve_params(layout.raas_command(r, 0, rd, "127.0.0.1:1"))
    assert raas["engine"] == "vllm" and raas["model"] == MODEL and raas["device"] == "cuda"
    assert raas["engine_args"] == "--gpu-memory-utilization 0.4"
    assert raas["policies"] == ("policy",) and raas["instance_id"] == "vllm-0"
    trainer = layout.trainer_config(
        r, r.policies[0], rd, dataflow="h:1", weights="h:2", resume=False
    )
    assert (trainer.model, trainer.device, trainer.dtype) == (MODEL, "cuda", "bfloat16")
    sglang = load_recipe(
        RECIPES / "gpu_hf.yaml",
        [
            f"policies.0.model={MODEL}",
            "raas.0.engine=sglang",
            "raas.0.engine_args=--mem-fraction-static 0.4",
        ],
    )
    raas = serve_params(layout.raas_command(sglang, 0, rd, "127.0.0.1:1"))
    assert raas["engine"] == "sglang" and raas["engine_args"] == "--mem-fraction-static 0.4"
    with pytest.raises(RecipeError, match=r"raas\.0\.engine"):
        load_recipe(RECIPES / "gpu_hf.yaml", [f"policies.0.model={MODEL}", "raas.0.engine=tgi"])


def test_the_default_raas_engine_is_torch(tmp_path: Path) -> None:
    r = load_recipe(None)
    rd, _ = built(
        r.model_copy(update={"dataset": r.dataset.model_copy(update={"size": 8})}), tmp_path
    )
    args = layout.raas_command(r, 0, rd, "127.0.0.1:1")
    assert serve_params(args)["engine"] == "torch"
    assert not any(a.startswith("--engine-args") for a in args)


def test_a_lora_recipe_on_vllm_launches_it_with_its_lora_api(tmp_path: Path) -> None:
    """trainer.lora on a vLLM RaaS: --enable-lora and the smallest --max-lora-rank vLLM
    accepts that holds the rank; a rank the engine args set is kept; torch gets nothing."""
    over = ["raas.0.engine=vllm", "raas.0.engine_args=--enforce-eager", "trainer.lora.rank=4"]
    r = load_recipe(RECIPES / "lora.yaml", over)
    rd, _ = built(
        r.model_copy(update={"dataset": r.dataset.model_copy(update={"size": 8})}), tmp_path
    )
    raas = serve_params(layout.raas_command(r, 0, rd, "127.0.0.1:1"))
    want = "--enforce-eager --enable-lora --max-lora-rank 8 --max-loras 1"
    assert raas["engine_args"] == want
    mine = load_recipe(RECIPES / "lora.yaml", [*over[:1], "raas.0.engine_args=--max-lora-rank 64"])
    raas = serve_params(layout.raas_command(mine, 0, rd, "127.0.0.1:1"))
    assert raas["engine_args"] == "--max-lora-rank 64 --enable-lora --max-loras 1"
    torch_raas = layout.raas_command(load_recipe(RECIPES / "lora.yaml"), 0, rd, "127.0.0.1:1")
    assert not any(a.startswith("--engine-args") for a in torch_raas)


@pytest.mark.slow
def test_tool_use_recipe_starts_and_trains_a_few_steps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "astra.run", str(RECIPES / "tool_use.yaml")]
    cmd += ["--run-dir", str(run_dir)]
    for override in (
        "trainer.num_steps=2",
        "trainer.batch_groups=2",
        "dataset.size=32",
        "streams.0.sampling.max_new_tokens=24",
        "raas=[{capacity: 16}]",
        "supervision.stop_grace_s=10",
        "eval.size=8",
    ):
        cmd += ["--set", override]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        pids = [proc.pid]
        with contextlib.suppress(OSError, ValueError):
            pids += [c["pid"] for c in json.loads((run_dir / "run.json").read_text())["children"]]
        for pgid in pids:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.killpg(pgid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps_per_policy"] == {"policy": 2}
    assert s["groups_trained"] == 2 * 2 and s["versions_per_policy"]["policy"] >= 2
    assert s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    assert s["counters"]["failed_groups"] == 0 and s["counters"]["malformed_results"] == 0
    assert "--workflow multi_turn_tools" in " ".join(
        next(
            c
            for c in json.loads((run_dir / "run.json").read_text())["children"]
            if c["role"] == "raas"
        )["command"]
    )


def test_eval_streams_evaluate_each_named_stream_with_its_own_workflow(tmp_path: Path) -> None:
    r = load_recipe(RECIPES / "heterogeneous.yaml", ["eval.streams=[large, main]"])
    assert [name for name, _ in r.eval_streams()] == ["eval-large", "eval-main"]
    rd, dataset = built(r, tmp_path)
    df = layout.dataflow_config(r, rd, dataset)
    evals = {s.name: s for s in df.streams if s.eval_every_versions}
    trained = {s.name: s for s in df.streams if not s.eval_every_versions}
    assert sorted(evals) == ["eval-large", "eval-main"]
    for name in ("large", "main"):
        e, s = evals[f"eval-{name}"], trained[name]
        assert (e.workflow, e.policy_ids, e.reward, e.raas_labels) == (
            s.workflow,
            s.policy_ids,
            s.reward,
            s.raas_labels,
        )
        assert e.dataset.path != s.dataset.path and e.eval_every_versions == r.eval.every_steps
    assert evals["eval-large"].dataset.path == evals["eval-main"].dataset.path  # one held-out set
    one = load_recipe(RECIPES / "heterogeneous.yaml", ["eval.streams=[large]"])
    assert [(n, s.name) for n, s in one.eval_streams()] == [("eval", "large")]
    default = load_recipe(RECIPES / "heterogeneous.yaml")
    assert [(n, s.name) for n, s in default.eval_streams()] == [("eval", "main")]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.streams=[nope]"], r"eval\.streams: unknown streams \['nope'\]"),
        (["eval.streams=[main, main]"], r"eval\.streams: a stream is named twice"),
        (
            [f"streams=[{{name: {'s' * 124}a}}, {{name: {'s' * 124}b}}]", "eval.streams=[]"],
            None,
        ),
        (
            [
                f"streams=[{{name: {'s' * 124}a}}, {{name: {'s' * 124}b}}]",
                f"eval.streams=[{'s' * 124}a, {'s' * 124}b]",
            ],
            r"would be named over 128 characters",
        ),
        (["streams=[{name: eval}]"], r"streams: the names \['eval'\] are the evaluations'"),
        (
            ["streams=[{name: a}, {name: eval-a}]", "eval.streams=[a, eval-a]"],
            r"the names \['eval-a'\] are the evaluations'",
        ),
    ],
)
def test_eval_streams_that_cannot_be_run_are_refused(overrides, message) -> None:
    if message is None:  # long stream names are fine when one stream is evaluated (`eval`)
        load_recipe(None, overrides)
        return
    with pytest.raises(RecipeError, match=message):
        load_recipe(None, overrides)


def test_lora_recipe_trains_publishes_and_serves_adapters_only(tmp_path: Path) -> None:
    """configs/recipes/lora.yaml in CI size: every published version holds the adapter only
    (adapter_config.json naming the base's digest), the RaaS load each one (swapped unmerged),
    and the run completes with nothing lost."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "astra.run", str(RECIPES / "lora.yaml"), "--run-dir", str(run_dir)]
    for override in ("trainer.num_steps=3", "warmup.steps=20", "eval.size=8"):
        cmd += ["--set", override]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    versions = run_dir / "state" / "weights" / "policies" / "policy" / "versions"
    stored = sorted(versions.iterdir())
    assert len(stored) >= 3
    for version in stored:
        record = json.loads((version / "record.json").read_text())
        names = set(record["tensors"])
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names
        primary = version / record["kind"]
        config = json.loads((primary / "adapter_config.json").read_text())
        assert config["rank"] == 8 and config["base_digest"].startswith("blake3:")
    swaps = [r["work"]["weight_swaps"] for r in s["raas"].values()]
    assert all(n >= 1 for n in swaps), s["raas"]


def test_agent_recipe_trains_on_an_agent_program_s_calls(tmp_path: Path) -> None:
    """configs/recipes/agent.yaml in CI size: the example agent (the `openai` client) runs per
    sample, its calls are trained, the run completes with nothing lost."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "astra.run",
        str(RECIPES / "agent.yaml"),
        "--run-dir",
        str(run_dir),
    ]
    for override in ("trainer.num_steps=2", "warmup.steps=20", "eval.size=8"):
        cmd += ["--set", override]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    assert s["steps_per_policy"] == {"policy": 2} and s["groups_trained"] == 2 * 4
    assert s["counters"]["failed_groups"] == 0, s["counters"]


def test_an_agent_command_that_does_not_exist_fails_the_recipe_naming_the_key(
    tmp_path: Path,
) -> None:
    with pytest.raises(RecipeError, match=r"agent_command.*no-such-agent"):
        load_recipe(RECIPES / "agent.yaml", ["raas.0.agent_command=[no-such-agent]"])


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_multi_lora_recipe_trains_two_adapters_on_one_served_base(tmp_path: Path) -> None:
    """configs/recipes/multi_lora.yaml in CI size: one warm-up shared by both policies, each
    trainer publishes adapters only, each RaaS serves both on one base (its log says the second
    policy joined the first's), and the run completes with nothing lost."""
    run_dir = tmp_path / "run"
    recipe = str(RECIPES / "multi_lora.yaml")
    cmd = [sys.executable, "-m", "astra.run", recipe, "--run-dir", str(run_dir)]
    for override in ("trainer.num_steps=3", "warmup.steps=20", "eval.size=8"):
        cmd += ["--set", override]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["groups_lost"] == 0 and s["groups_duplicated"] == 0
    warm = run_dir / "warmup"
    assert (warm / "g8" / "model").resolve() == (warm / "g4" / "model").resolve()
    for policy in ("g4", "g8"):
        versions = run_dir / "state" / "weights" / "policies" / policy / "versions"
        for version in sorted(versions.iterdir()):
            names = set(json.loads((version / "record.json").read_text())["tensors"])
            assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names
    logs = [p.read_text() for p in (run_dir / "logs").glob("raas-*.log")]
    assert logs and all("serves on the shared base" in t for t in logs)
    joined = [t for t in logs if "with ['g4']" in t or "with ['g8']" in t]
    assert len(joined) == len(logs), "the second policy did not join the first's base"
