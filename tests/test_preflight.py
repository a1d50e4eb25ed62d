"""`astra run` refuses at start-up what would fail later (astra.run.preflight): a misspelled or
unimportable reward or workflow, a model directory that cannot load, data without the fields
the run reads. Each: exit 2, one line naming the key, the value and the fix, no run directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from astra.engine.tiny import save_tiny
from astra.run.preflight import PreflightError, check
from astra.run.recipe import load_recipe


def _refused(*overrides: str) -> str:
    with pytest.raises(PreflightError) as info:
        check(load_recipe(None, list(overrides)))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_misspelled_reward_is_refused_with_the_near_name() -> None:
    message = _refused("streams.0.reward=exact_mach")
    assert message.startswith("streams.0.reward=exact_mach: no such reward.")
    assert "Did you mean 'exact_match'?" in message


def test_an_unimportable_reward_path_says_why() -> None:
    message = _refused("streams.0.reward=no_such_pkg.rewards:score")
    assert "cannot import no_such_pkg.rewards" in message and "PYTHONPATH" in message


def test_a_misspelled_workflow_is_refused() -> None:
    message = _refused("streams.0.workflow=single_trn")
    assert "streams.0.workflow=single_trn" in message and "'single_turn'" in message


def test_a_reward_on_the_recipes_pythonpath_resolves(tmp_path: Path) -> None:
    """`env: {PYTHONPATH: ...}` reaches the supervisor too (its baseline scores with it)."""
    (tmp_path / "my_reward_mod.py").write_text(
        "def score(record, completion, **_):\n    return 1.0\n"
    )
    check(load_recipe(None, [f"env.PYTHONPATH={tmp_path}", "streams.0.reward=my_reward_mod:score"]))


def test_a_model_that_cannot_load_is_refused(tmp_path: Path) -> None:
    assert "no such directory" in _refused(f"policies.0.model={tmp_path / 'nope'}")
    model = save_tiny(tmp_path / "m")
    check(load_recipe(None, [f"policies.0.model={model}"]))  # a complete directory passes
    (model / "tokenizer.json").unlink()
    config = json.loads((model / "config.json").read_text())
    config.pop("astra_tokenizer", None)
    (model / "config.json").write_text(json.dumps(config))
    assert "no tokenizer.json" in _refused(f"policies.0.model={model}")
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    assert "no *.safetensors weights" in _refused(f"policies.0.model={model}")


def test_data_without_the_fields_the_reward_reads_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    file = ["dataset.kind=file", "warmup.steps=0"]
    message = _refused(*file, f"dataset.path={data}")
    assert f"dataset.path={data}: record 2 has no 'answer' field" in message
    data.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    assert "malformed JSON" in _refused(*file, f"dataset.path={data}")
    message = _refused(*file, f"dataset.path={tmp_path / 'none.jsonl'}")
    assert "not found" in message


def test_the_command_ends_in_one_line_and_leaves_no_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "astra.run", "--run-dir", str(run_dir)]
    done = subprocess.run(
        [*cmd, "--set", "streams.0.reward=exact_mach"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "streams.0.reward=exact_mach" in lines[0], done.stderr
    assert not run_dir.exists()


def test_recipes_are_found_by_name(tmp_path: Path, monkeypatch) -> None:
    from astra.run.recipe import RecipeError, find_recipe

    monkeypatch.chdir(tmp_path)  # by name from anywhere: the source tree's configs/recipes
    assert find_recipe("smoke").parts[-3:] == ("configs", "recipes", "smoke.yaml")
    with pytest.raises(RecipeError, match="Did you mean 'smoke'"):
        find_recipe("smok")
    (tmp_path / "configs" / "recipes").mkdir(parents=True)
    (tmp_path / "configs" / "recipes" / "mine.yaml").write_text("name: mine\n")
    assert find_recipe("mine") == tmp_path / "configs" / "recipes" / "mine.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "astra.run", "smok"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_fixed_port_in_use_is_refused_naming_its_key() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        message = _refused(f"dataflow.metrics_port={port}")
    assert message.startswith(f"dataflow.metrics_port={port}: cannot listen on it")
    assert "0 for any free one" in message
    check(load_recipe(None, [f"dataflow.metrics_port={port}"]))  # free again


def test_a_run_directory_that_cannot_be_written_ends_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cmd = [sys.executable, "-m", "astra.run", "--run-dir", str(blocker / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--run-dir {blocker / 'run'}: cannot write there" in lines[0]
