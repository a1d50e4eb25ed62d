"""The user's own data, reward, workflow and model, as docs/your-*.md show them: the pages'
code is the tested example (examples/my_task), the reward and the workflow resolve by dotted
path and by entry point, and `astra run` on the example and on `hf_cpu` with a toy Hugging Face
model (made here, tokenizer trained here) runs the pages' own commands to `completed`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from astra.rewards import REWARDS, get_reward
from astra.workflows import WORKFLOWS, get_workflow, run_episode
from astra.workflows.registry import UnknownWorkflow
from tests.test_workflows import ScriptedTestEngine, context, make_group, run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "my_task"
DOCS = ROOT / "docs"
PAGES = ("your-data", "your-model", "your-reward", "your-workflow")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def blocks(page: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall((DOCS / f"{page}.md").read_text()) if kind == lang]


def contained(part, whole) -> bool:
    """`part` is `whole` with keys (and list items' keys) left out."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(
            k in whole and contained(v, whole[k]) for k, v in part.items()
        )
    if isinstance(part, list):
        return isinstance(whole, list) and all(any(contained(p, w) for w in whole) for p in part)
    return part == whole


def test_every_page_shows_the_tested_example() -> None:
    recipe = yaml.safe_load((EXAMPLE / "recipe.yaml").read_text())
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    sources = {p.read_text() for p in (EXAMPLE / "my_task").glob("*.py")}
    train = (EXAMPLE / "data" / "train.jsonl").read_text()
    shown = 0
    for page in PAGES:
        for body in blocks(page, "python"):
            if body.startswith("def my_reward"):  # the signature, not a file
                continue
            assert body in sources, f"{page}.md shows Python that is not in examples/my_task"
            shown += 1
        for body in blocks(page, "yaml"):
            assert contained(yaml.safe_load(body), recipe), f"{page}.md: {body}"
            shown += 1
        for body in blocks(page, "toml"):
            assert contained(tomllib.loads(body), project), f"{page}.md: {body}"
            shown += 1
        for body in blocks(page, "jsonl"):
            assert train.startswith(body), f"{page}.md: not the start of train.jsonl"
            shown += 1
        assert blocks(page, "bash"), f"{page}.md has no command to copy"
    assert shown >= 8
    assert recipe["streams"][0]["workflow"] == "my_task.workflows:SecondTry"
    assert recipe["streams"][0]["reward"] == "my_task.rewards:reversal"


def test_workflows_and_rewards_resolve_by_dotted_path(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    workflow = get_workflow("my_task.workflows:SecondTry")
    assert type(workflow).__name__ == "SecondTry"
    assert get_workflow("my_task.workflows.SecondTry").default_reward == workflow.default_reward
    reversal = get_reward(workflow.default_reward)
    assert reversal({"answer": "cba"}, "cba\n") == 1.0
    partial = reversal({"answer": "cba"}, "cab")
    assert partial == pytest.approx(0.5 / 3) and partial.metadata == {"in_place": 1, "said": "cab"}
    with pytest.raises(UnknownWorkflow, match="cannot import no_such_pkg"):
        get_workflow("no_such_pkg.flows:Flow")
    with pytest.raises(UnknownWorkflow, match="has no callable 'Nope'"):
        get_workflow("my_task.workflows:Nope")


def test_the_example_installs_its_short_names_through_entry_points(tmp_path, monkeypatch) -> None:
    """What `pip install -e examples/my_task` leaves: the package importable and a dist-info
    with the pyproject's entry points."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    info = tmp_path / "my_task-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-task\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items())
            for group, entries in project["entry-points"].items()
        )
    )
    with pytest.raises(UnknownWorkflow):
        get_workflow("second_try")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert type(get_workflow("second_try")).__name__ == "SecondTry"
        assert get_reward("reversal")({"answer": "ab"}, "ab") == 1.0
    finally:
        WORKFLOWS.remove("second_try")
        REWARDS.remove("reversal")


@pytest.mark.parametrize(
    ("answers", "reward", "tries"), [(["cba\n"], 1.0, 1), (["abc\n", "cba\n"], 0.5, 2)]
)
def test_the_second_try_workflow(monkeypatch, answers, reward, tries) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    said = iter(answers)
    engine = ScriptedTestEngine(lambda p, prompt, s: next(said))
    group = make_group("reverse abc=", data={"answer": "cba"}, stop_strings=("\n",))
    ctx = context(engine, group, reward="my_task.rewards:reversal")
    t = run(run_episode(get_workflow("my_task.workflows:SecondTry"), ctx))
    assert t.error is None and t.reward == reward and t.metadata["tries"] == tries
    (seq,) = t.sequences
    prompt = len("reverse abc=")  # the scripted engine's tokenizer: one token per byte
    trained = [m for m in seq.loss_mask[prompt:]]
    if tries == 1:
        assert trained == [1] * len("cba\n")
    else:  # first answer, the prompt again (context), second answer
        assert trained == [1] * 4 + [0] * prompt + [1] * 4


# ----- end to end: the pages' commands -------------------------------------------------------


def astra(line: str) -> list[str]:
    """A command line of a page, run with this interpreter."""
    args = shlex.split(line)
    if args[0] == "astra":
        return [sys.executable, "-m", "astra.cli", *args[1:]]
    assert args[0] == "python", line
    return [sys.executable, *args[1:]]


def run_to_the_end(cmd: list[str], run_dir: Path, timeout_s: float) -> dict:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    finally:
        pids = [proc.pid]
        with contextlib.suppress(OSError, ValueError):
            pids += [c["pid"] for c in json.loads((run_dir / "run.json").read_text())["children"]]
        for pgid in pids:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.killpg(pgid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


QUICK = ["--set", "supervision.stop_grace_s=10", "--set", "trainer.num_steps=3"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_example_task_runs_end_to_end(tmp_path: Path) -> None:
    """docs/your-workflow.md's command: the example's data, reward and workflow, by dotted
    path on the recipe's PYTHONPATH (the supervisor, the RaaS and Dataflow all import them)."""
    (line,) = blocks("your-workflow", "bash")[0].strip().splitlines()
    assert line == "astra run examples/my_task/recipe.yaml"
    run_dir = tmp_path / "run"
    cmd = [*astra(line), "--run-dir", str(run_dir), *QUICK]
    cmd += ["--set", "warmup.steps=30", "--set", "eval.every_steps=2"]
    s = run_to_the_end(cmd, run_dir, 120)
    assert s["status"] == "completed" and s["steps_per_policy"] == {"policy": 3}
    assert s["counters"]["failed_groups"] == 0 and s["groups_lost"] == 0
    assert s["eval"]["first"] is not None  # eval.path's records, scored by the reward
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert evals and all(0.0 <= e["mean_reward"] <= 1.0 for e in evals)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hf_cpu_runs_a_toy_hf_model_from_the_model_page(tmp_path: Path) -> None:
    """docs/your-model.md's commands: a random Qwen3-shaped model with a tokenizer trained
    here, then `astra run hf_cpu` on it (the chat workflow: every prompt through its chat
    template) to `completed`. A random model learns nothing: only that the path works."""
    make, train = blocks("your-model", "bash")[0].strip().splitlines()
    model = tmp_path / "toy-qwen3"
    make, train = (line.replace("/tmp/toy-qwen3", str(model)) for line in (make, train))
    subprocess.run(astra(make), cwd=ROOT, check=True, timeout=60, capture_output=True)
    assert (model / "tokenizer.json").is_file() and (model / "config.json").is_file()
    run_dir = tmp_path / "run"
    cmd = [*astra(train), "--run-dir", str(run_dir), *QUICK]
    cmd += ["--set", "dataset.size=64", "--set", "eval.size=8", "--set", "eval.every_steps=2"]
    cmd += ["--set", "warmup.steps=2", "--set", "warmup.size=16", "--set", "warmup.batch_size=4"]
    cmd += ["--set", "observe.baseline_samples=4"]  # both on the chat-templated prompts
    s = run_to_the_end(cmd, run_dir, 120)
    assert s["status"] == "completed" and s["steps_per_policy"] == {"policy": 3}
    assert s["random_baseline"]["samples"] == 4 and s["warmup"]["accuracy_after"] is not None
    assert s["counters"]["failed_groups"] == 0 and s["groups_lost"] == 0
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert recipe["streams"][0]["workflow"] == "chat"
    assert recipe["policies"][0]["model"] == str(model)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_your_data_reward_and_workflow_on_your_model_from_one_page(tmp_path: Path) -> None:
    """docs/your-model.md's last commands: the example task's own data, reward and workflow on
    a Hugging Face model made here (its own BPE tokenizer), warm-up included, to `completed`."""
    make, train = blocks("your-model", "bash")[-1].strip().splitlines()
    assert train.startswith("astra run examples/my_task/recipe.yaml ")
    model = tmp_path / "toy-qwen3"
    make, train = (line.replace("/tmp/toy-qwen3", str(model)) for line in (make, train))
    subprocess.run(astra(make), cwd=ROOT, check=True, timeout=60, capture_output=True)
    run_dir = tmp_path / "run"
    cmd = [*astra(train), "--run-dir", str(run_dir), *QUICK]
    cmd += ["--set", "warmup.steps=5", "--set", "eval.every_steps=2"]
    s = run_to_the_end(cmd, run_dir, 120)
    assert s["status"] == "completed" and s["steps_per_policy"] == {"policy": 3}
    assert s["counters"]["failed_groups"] == 0 and s["groups_lost"] == 0
    assert s["warmup"]["steps"] == 5 and s["eval"]["first"] is not None
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert recipe["policies"][0]["model"] == str(model)
    assert recipe["streams"][0]["reward"] == "my_task.rewards:reversal"


def test_a_workflow_path_that_does_not_import_is_refused_at_start_up() -> None:
    from astra.run.preflight import PreflightError, check
    from astra.run.recipe import load_recipe

    with pytest.raises(PreflightError) as info:  # a package not on PYTHONPATH
        check(load_recipe(None, ["streams.0.workflow=not_on_path.workflows:Flow"]))
    message = str(info.value)
    assert message.startswith("streams.0.workflow=not_on_path.workflows:Flow: unknown workflow")
    assert "No module named 'not_on_path'" in message and "PYTHONPATH" in message
