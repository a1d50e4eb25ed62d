"""astra.run.evals: finished evaluations become evals.jsonl rows once, across a --resume."""

from __future__ import annotations

import json
from pathlib import Path

from astra.run.evals import EvalLog, final_target
from astra.run.plot import read_evals


def result(version: int, mean: float, *, complete: bool = True) -> dict:
    return {
        "stream": "eval",
        "policy_id": "policy",
        "version": version,
        "groups": 4,
        "groups_done": 4 if complete else 1,
        "samples": 4,
        "failed_samples": 0,
        "mean_reward": mean,
        "solved_groups": round(mean * 4),
        "min_token_version": version,
        "max_token_version": version + 1,
        "complete": complete,
    }


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, dict]] = []

    def write_scalars(self, policy: str, step: int, values: dict) -> None:
        self.calls.append((policy, step, values))


def test_rows_are_written_once_and_survive_a_resume(tmp_path: Path) -> None:
    path = tmp_path / "evals.jsonl"
    log, sink = EvalLog(path, every_steps=5), Sink()
    assert log.newest() is None and log.summary()["last"] is None
    new = log.update([result(0, 0.25), result(5, 0.5, complete=False)], sink)
    assert [r["version"] for r in new] == [0]
    assert log.update([result(0, 0.25), result(5, 0.75)], sink)[0]["solved_share"] == 0.75
    assert log.update([result(0, 0.25), result(5, 0.75)], sink) == []
    assert sink.calls == [
        ("policy", 0, {"eval/mean_reward": 0.25, "eval/solved_share": 0.25}),
        ("policy", 5, {"eval/mean_reward": 0.75, "eval/solved_share": 0.75}),
    ]
    again = EvalLog(path, every_steps=5)  # a --resume: Dataflow reports both again
    assert again.update([result(0, 0.25), result(5, 0.75)]) == []
    s = again.summary()
    assert (s["first"], s["last"], s["best"], s["last_version"]) == (0.25, 0.75, 0.75, 5)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["token_versions"] for r in rows] == [[0, 1], [5, 6]]
    assert read_evals(path) == {"policy": [(0, 0.25), (5, 0.75)]}


def test_final_target_is_the_last_multiple_reached() -> None:
    assert final_target({"policy": 299}, "policy", 50) == 250
    assert final_target({"policy": 300}, "policy", 50) == 300
    assert final_target({"policy": 3}, "policy", 50) == 0
    assert final_target({"other": 3}, "policy", 50) is None
    assert final_target({"policy": 3}, "policy", 0) is None


def test_held_out_warm_up_and_rl_prompts_are_disjoint(tmp_path: Path) -> None:
    from astra.raas.tasks import read_records
    from astra.run import layout
    from astra.run.recipe import load_recipe

    recipe = load_recipe(None, ["dataset.size=300", "eval.size=200", "warmup.size=400"])
    rd = layout.RunDir(tmp_path / "run")
    dataset = layout.prepare(recipe, rd)
    held_out = layout.eval_data(recipe, rd, dataset)
    warmup = layout.warmup_data(recipe, rd, dataset)
    assert [len(read_records(p)) for p in (dataset, held_out, warmup)] == [300, 200, 400]
    prompts = [{r["prompt"] for r in read_records(p)} for p in (dataset, held_out, warmup)]
    rl, ev, wu = prompts
    assert not (rl & ev) and not (rl & wu) and not (ev & wu)
    stream = layout.dataflow_config(recipe, rd, dataset).streams[-1]
    assert stream.name == "eval" and stream.eval_every_versions == recipe.eval.every_steps
    assert stream.sampling.temperature == 0.0 and stream.dataset.path == str(held_out)


def test_several_evaluation_streams_are_summarised_and_tagged_each(tmp_path: Path) -> None:
    path = tmp_path / "evals.jsonl"
    log, sink = EvalLog(path, every_steps=5, streams={"eval-b": [], "eval-a": []}), Sink()
    rows = [
        {**result(0, 0.5), "stream": "eval-a"},
        {**result(0, 0.25), "stream": "eval-b"},
        {**result(5, 1.0), "stream": "eval-a"},
    ]
    assert len(log.update(rows, sink)) == 3
    assert log.newest("eval-a") == 5 and log.newest("eval-b") == 0 and log.newest() == 5
    assert log.newest("eval-c") is None
    s = log.summary()
    assert s["stream"] == "eval-b" and (s["first"], s["last"]) == (0.25, 0.25)  # the first
    assert s["streams"]["eval-a"]["results"] == [
        {"version": 0, "mean_reward": 0.5, "solved_share": 0.5, "samples": 4},
        {"version": 5, "mean_reward": 1.0, "solved_share": 1.0, "samples": 4},
    ]
    assert sink.calls[0] == ("policy", 0, {"eval-a/mean_reward": 0.5, "eval-a/solved_share": 0.5})
    assert read_evals(path) == {"policy eval-a": [(0, 0.5), (5, 1.0)], "policy eval-b": [(0, 0.25)]}
    assert "streams" not in EvalLog(tmp_path / "one.jsonl", every_steps=5).summary()


def test_each_policy_of_an_evaluated_stream_is_summarised(tmp_path: Path) -> None:
    log = EvalLog(tmp_path / "evals.jsonl", every_steps=1, streams={"eval": ["solver", "verifier"]})
    both = [
        {**result(0, 0.5), "policy_id": "verifier"},
        {**result(0, 0.25), "policy_id": "solver"},
        {**result(1, 0.75), "policy_id": "solver"},
    ]
    assert len(log.update(both)) == 3 and log.update(both) == []  # once each (stream, v, policy)
    s = log.summary()
    assert (s["first"], s["last"], s["last_version"]) == (0.25, 0.75, 1)  # the first policy's
    assert s["policies"]["verifier"]["results"][0]["mean_reward"] == 0.5
    assert [r["version"] for r in s["policies"]["solver"]["results"]] == [0, 1]
    assert log.lead() == ("eval", "solver")  # what the status line shows
