"""`astra run` recipes: defaults, YAML, dotted overrides, unknown keys, and the service configs
built from them (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from astra.run import layout
from astra.run.cli import run_command
from astra.run.layout import RunDir
from astra.run.recipe import Recipe, RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_embedded_default_is_the_documented_file() -> None:
    default = load_recipe(None)
    assert default == Recipe()
    assert load_recipe(ROOT / "configs/recipes/default.yaml") == default
    assert [p.id for p in default.policies] == ["policy"]
    assert len(default.raas) == 2 and default.raas_names == ["raas-0", "raas-1"]
    assert default.dataset.kind == "arithmetic" and default.trainer.device == "cpu"
    assert default.stream_reward(default.streams[0]) == "exact_match"
    assert default.warmup.steps > 0 and default.warmup.path is None


def test_dotted_overrides_apply_with_yaml_values_and_list_indexes(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("name: mine\ntrainer:\n  num_steps: 7\n")
    r = load_recipe(
        path,
        [
            "trainer.num_steps=5",
            "raas.1.capacity=4",
            "raas.0.labels={zone: a}",
            "dataflow.pool.confirm_failures=5",
            "dataflow.gate.max_version_lag=null",
            "streams.0.sampling.stop_strings=[';']",
            "on_raas_death=stop",
        ],
    )
    assert r.name == "mine" and r.trainer.num_steps == 5
    assert [x.capacity for x in r.raas] == [16, 4] and r.raas[0].labels == {"zone": "a"}
    assert r.dataflow.pool.confirm_failures == 5 and r.dataflow.gate.max_version_lag is None
    assert r.streams[0].sampling.stop_strings == [";"] and r.on_raas_death == "stop"


@pytest.mark.parametrize(
    ("overrides", "text", "message"),
    [
        (["trainer.foo=1"], "", "trainer.foo: Extra inputs are not permitted"),
        (["dataflow.pool.bogus=1"], "", "dataflow.pool.bogus: Extra inputs"),
        ([], "trainer:\n  nmu_steps: 3\n", "trainer.nmu_steps: Extra inputs"),
        ([], "raas:\n  - capacity: 2\n    color: red\n", "raas.0.color: Extra inputs"),
        (["raas.5.capacity=1"], "", "raas.5: no item 5"),
        (["trainer.num_steps.x=1"], "", "trainer.num_steps: "),
        (["trainer.num_steps=0"], "", "trainer.num_steps: Input should be greater"),
        (["no_equals_sign"], "", "expected DOTTED.KEY=VALUE"),
        (
            ["dataflow.gate.max_offpolicyness=1"],
            "",
            "dataflow.gate: Value error, 'max_offpolicyness' was renamed: write max_version_lag: 1",
        ),
        (
            [],
            "policies:\n  - id: policy\n    buffer:\n      max_staleness: 2\n",
            "'max_staleness' was renamed: write max_version_lag: 2",
        ),
        (["dataset.kind=file"], "", "path is required"),
        (["raas.0.policies=[ghost]"], "", "unknown policies ['ghost']"),
        (["streams.0.sampling.temperature=0.7"], "", "differs from trainer.loss.temperature"),
        (["raas.0.command=[my-raas, '{nope}']"], "", "command[1] '{nope}': unknown placeholder"),
        (["raas.0.command=[my-raas, '{dataflow']"], "", "command[1] '{dataflow': expected '}'"),
        (["raas.0.command=[my-raas, '{capacity:4}']"], "", "takes no format or conversion"),
        (["raas.0.command=['']"], "", "command: the first argument (the program) is empty"),
        (
            ["raas.0.command=[my-raas]", "raas.0.engine=vllm"],
            "",
            "command: ['engine'] are options of `astra serve raas`",
        ),
    ],
)
def test_bad_recipes_name_the_key(
    tmp_path: Path, overrides: list[str], text: str, message: str
) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    assert message in str(info.value)


def test_cli_rejects_unknown_key_with_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        run_command, ["--set", "trainer.foo=1", "--run-dir", str(tmp_path / "run")]
    )
    assert result.exit_code == 2 and "trainer.foo" in result.output
    assert not (tmp_path / "run").exists()
    printed = CliRunner().invoke(run_command, ["--print-recipe", "--set", "trainer.num_steps=9"])
    assert printed.exit_code == 0 and "num_steps: 9" in printed.output


def test_service_configs_agree_with_the_recipe(tmp_path: Path) -> None:
    r = load_recipe(None, ["trainer.batch_groups=3", "raas.1.labels={hw: cpu}", "dataset.size=8"])
    rd = RunDir(tmp_path / "run")
    dataset = layout.prepare(r, rd)
    assert len(dataset.read_text().splitlines()) == 8 and rd.recipe.is_file()
    df = layout.dataflow_config(r, rd, dataset)
    assert df.port == 0 and df.state_dir == str(rd.dataflow_state)
    assert df.policies[0].batch_groups == 3 and df.streams[0].reward == "exact_match"
    assert df.streams[0].dataset.path == str(dataset) and df.grace_s == 2.0
    trainer = layout.trainer_config(
        r, r.policies[0], rd, dataflow="h:1", weights="h:2", resume=False
    )
    # The trainer asks for exactly Dataflow's batch_groups (else the off-policy bound stalls it).
    assert trainer.batch.num_groups == 3 and trainer.num_steps == r.trainer.num_steps
    assert trainer.checkpoint.dir == str(rd.checkpoints("policy")) and not trainer.checkpoint.resume
    args = layout.raas_command(r, 1, rd, "h:1")
    assert args[args.index("--instance-id") + 1] == "raas-1"
    assert args[args.index("--label") + 1] == "hw=cpu"
    assert args[args.index("--workflow") + 1] == "single_turn"


def test_resume_counts_the_steps_left(tmp_path: Path) -> None:
    r = load_recipe(None, ["trainer.num_steps=10"])
    rd = RunDir(tmp_path)
    assert layout.remaining_steps(r, rd) == {"policy": 10}
    (rd.checkpoints("policy") / "step-000000004").mkdir(parents=True)
    (rd.checkpoints("policy") / "step-000000004" / "trainer.json").write_text('{"step": 4}')
    assert layout.remaining_steps(r, rd) == {"policy": 6}
    trainer = layout.trainer_config(r, r.policies[0], rd, dataflow="a", weights="b", resume=True)
    assert trainer.checkpoint.resume and trainer.num_steps == 6


def test_an_external_raas_command_is_filled_in_per_raas(tmp_path: Path) -> None:
    """raas.N.command replaces `astra serve raas` with the user's program, its placeholders
    filled in for that RaaS (astra.run.external); `{{` stays a literal brace."""
    cmd = "[my-raas, --at, '{dataflow}', --id, '{instance_id}', '--cap={capacity}', '{state_dir}',"
    cmd += " '{policy}', '{policies}', '{workflow}', '{workflows}', '{{x}}']"
    r = load_recipe(None, [f"raas.1.command={cmd}", "raas.1.capacity=3"])
    rd = RunDir(tmp_path / "run")
    args = layout.raas_command(r, 1, rd, "h:1")
    assert args == [
        "my-raas", "--at", "h:1", "--id", "raas-1", "--cap=3", str(rd.state / "raas-1"),
        "policy", "policy", "single_turn", "single_turn", "{x}",
    ]  # fmt: skip
    assert (rd.state / "raas-1").is_dir()
    assert layout.raas_command(r, 0, rd, "h:1")[:4] == layout.serve_command("raas")[:4]
