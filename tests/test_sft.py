"""The supervised warm-up: masks, learning, the written model, `astra sft`, and the run's data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from astra.cli import main
from astra.engine.tiny import load_model, tiny_model
from astra.engine.tokenizer import CharTokenizer
from astra.raas.tasks import generate_records, read_records, write_dataset
from astra.run import layout
from astra.run.recipe import RecipeError, load_recipe
from astra.trainer.sft import SftSettings, collate, encode_examples, run_sft, supervised_warmup

TOK = CharTokenizer()
SUMS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def greedy(model, prompt: str, max_new: int = 4) -> str:
    ids = TOK.encode(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            if nxt == TOK.eos_id:
                break
            out.append(nxt)
    return TOK.decode(out)


def test_targets_are_the_answer_and_end_of_sequence_only():
    examples = encode_examples([{"prompt": "10+2=", "answer": "12"}, SUMS[-1]], TOK)
    ids, mask = collate(examples, TOK.pad_id)
    assert ids.shape == (2, 8) and mask.shape == (2, 7)
    targets = [ids[0, t + 1].item() for t in range(7) if mask[0, t]]
    assert targets == [*TOK.encode("12"), TOK.eos_id]
    targets = [ids[1, t + 1].item() for t in range(7) if mask[1, t]]
    assert targets == [*TOK.encode("6"), TOK.eos_id]
    assert ids[1, 6:].tolist() == [TOK.pad_id, TOK.pad_id]


def test_records_without_prompt_or_answer_are_refused():
    with pytest.raises(ValueError, match="record 1: needs 'prompt' and 'answer'"):
        encode_examples([SUMS[0], {"prompt": "x"}], TOK)
    with pytest.raises(ValueError, match="no records"):
        encode_examples([], TOK)
    with pytest.raises(ValueError, match="lr"):
        SftSettings(steps=1, lr=0)


def test_warmup_learns_a_table_the_random_model_does_not_know():
    model = tiny_model()
    assert sum(greedy(model, r["prompt"]) == r["answer"] for r in SUMS) <= 2
    result = supervised_warmup(model, TOK, SUMS, SftSettings(steps=150, lr=3e-3, batch_size=16))
    assert result.loss_last < 0.05 < result.loss_first
    assert [greedy(model, r["prompt"]) for r in SUMS] == [r["answer"] for r in SUMS]


def test_same_seed_same_weights_other_seed_other_weights():
    def train(seed: int) -> torch.Tensor:
        model = tiny_model()
        supervised_warmup(model, TOK, SUMS, SftSettings(steps=5, batch_size=3, seed=seed))
        return model.lm_head.weight.detach().clone()

    first = train(0)
    assert torch.equal(first, train(0))
    assert not torch.equal(first, train(1))


def test_run_sft_writes_a_model_the_engine_loads(tmp_path: Path):
    out = tmp_path / "model"
    result = run_sft("tiny", SUMS, out, SftSettings(steps=150, batch_size=16))
    assert result.steps == 150 and result.examples == len(SUMS)
    assert not (tmp_path / "model.partial").exists()
    loaded, tokenizer = load_model(str(out))
    assert isinstance(tokenizer, CharTokenizer)
    assert [greedy(loaded, r["prompt"]) for r in SUMS] == [r["answer"] for r in SUMS]
    with pytest.raises(FileExistsError):
        run_sft("tiny", SUMS, out, SftSettings(steps=1))


def test_astra_sft_command(tmp_path: Path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SUMS))
    runner = CliRunner()
    out = tmp_path / "m"
    args = ["sft", "tiny", str(data), "--out", str(out), "--steps", "3", "--threads", "1"]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["steps"] == 3 and Path(line["out"]) == out.resolve()
    assert (out / "config.json").is_file()
    res = runner.invoke(main, args)  # --out exists
    assert res.exit_code == 2 and "exists" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1"}) + "\n")
    res = runner.invoke(
        main, ["sft", "tiny", str(bad), "--out", str(tmp_path / "x"), "--steps", "1"]
    )
    assert res.exit_code == 1 and "needs 'prompt' and 'answer'" in res.output


def test_generated_records_leave_out_excluded_prompts():
    first = generate_records("arithmetic", 200, seed=0, ops="+", max_operand=20)
    assert all(r["prompt"].count("+") == 1 for r in first)
    assert all(int(a) <= 20 for r in first for a in r["prompt"][:-1].split("+"))
    seen = {r["prompt"] for r in first}
    other = generate_records("arithmetic", 200, seed=0, ops="+", max_operand=20, exclude=seen)
    assert not seen & {r["prompt"] for r in other}
    with pytest.raises(ValueError, match="too few distinct problems"):
        all_four = {"0+0=", "0+1=", "1+0=", "1+1="}
        generate_records("arithmetic", 1, ops="+", max_operand=1, exclude=all_four)
    with pytest.raises(ValueError, match="ops"):
        generate_records("arithmetic", 1, ops="/")


def test_run_warmup_data_is_disjoint_from_the_rl_prompts(tmp_path: Path):
    recipe = load_recipe(None, ["dataset.size=300", "warmup.size=500"])
    rd = layout.RunDir(tmp_path / "run")
    dataset = layout.prepare(recipe, rd)
    data = layout.warmup_data(recipe, rd, dataset)
    rl = {r["prompt"] for r in read_records(dataset)}
    warm = read_records(data)
    assert len(warm) == 500 and len(rl) > 100
    assert not rl & {r["prompt"] for r in warm}
    assert data.stat().st_mtime_ns == layout.warmup_data(recipe, rd, dataset).stat().st_mtime_ns
    started = layout.after_warmup(recipe, rd)
    assert started.policies[0].model == str(rd.warmup_model("policy"))
    assert recipe.policies[0].model == "tiny"
    off = load_recipe(None, ["warmup.steps=0"])
    assert layout.after_warmup(off, rd) is off


def test_a_file_dataset_needs_warmup_data(tmp_path: Path):
    path = write_dataset("arithmetic", tmp_path / "p.jsonl", 4)
    with pytest.raises(RecipeError, match=r"warmup\.path"):
        load_recipe(None, ["dataset.kind=file", f"dataset.path={path}"])
    ok = load_recipe(None, ["dataset.kind=file", f"dataset.path={path}", "warmup.steps=0"])
    assert ok.warmup.steps == 0
