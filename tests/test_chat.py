"""A model directory's own tokenizer and chat template: a toy Qwen3/Llama-shaped model made here
(tokenizer trained with `tokenizers`, nothing downloaded), the template read and rendered as
transformers renders it, applied by the `chat` workflow only (single_turn and the char
tokenizer unchanged), and refused at start-up where the model has none."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from astra.engine.chat import has_chat_template, load_chat_template
from astra.engine.tiny import load_model
from astra.engine.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer
from astra.engine.torch_engine import TorchEngine
from astra.errors import FailedPrecondition
from astra.raas.engine_backend import EngineBackend
from astra.run.preflight import PreflightError, check_models
from astra.run.recipe import load_recipe
from astra.testing.toy_hf import make_toy_model
from tests.test_workflows import make_group

CHATML_OF = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n12+7=<|im_end|>\n"


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return make_toy_model(tmp_path_factory.mktemp("toy") / "qwen3")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_the_toy_model_loads_with_its_trained_tokenizer_and_chat_template(toy: Path) -> None:
    model, tok = load_model(toy)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == model.cfg.vocab_size
    assert tok.eos_id == json.loads((toy / "config.json").read_text())["eos_token_id"]
    assert tok.decode(tok.encode("reverse 12+7=19")) == "reverse 12+7=19"
    assert len(tok.encode("12+7=19")) < len("12+7=19")  # BPE merges learned here
    text = tok.chat_template.render(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+7="}]
    )
    assert text == CHATML_OF + "<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == tok._tok.token_to_id("<|im_start|>")  # specials are one token each
    assert tok.eos_id in ids  # <|im_end|>, the eos, closes each turn


def test_chat_template_sources_and_a_damaged_one(toy: Path, tmp_path: Path) -> None:
    d = _copy(toy, tmp_path / "m")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{{ eos_token }}{{ messages[0]['content'] }}"}
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(d).render([{"role": "user", "content": "hi"}]) == "<|im_end|>hi"
    (d / "chat_template.jinja").write_text("[{{ messages|length }}]")  # the file wins
    assert load_chat_template(d).render([{"role": "user", "content": "x"}]) == "[1]"
    (d / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(FailedPrecondition, match=r"chat_template\.jinja: chat template does not"):
        load_tokenizer(d)
    (d / "chat_template.jinja").unlink()
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(d).chat_template is None and not has_chat_template(str(d))
    assert CharTokenizer.chat_template is None and not has_chat_template("tiny")


def _episode(model_dir: Path, workflow: str, prompt: str, data: dict):
    async def go():
        model, tok = load_model(model_dir)
        engine = TorchEngine({"policy": (model, tok)}, "cpu", max_batch=4)
        try:
            backend = EngineBackend(engine, [workflow])
            group = make_group(prompt, n=2, tokens=6, workflow=workflow, seed=3, data=data)
            return tok, await backend.generate(group, {"policy": 0})
        finally:
            await engine.close()

    return asyncio.run(asyncio.wait_for(go(), 60))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_chat_workflow_sends_the_templated_prompt(tmp_path: Path, family: str) -> None:
    d = make_toy_model(tmp_path / family, family)
    data = {"answer": "19", "system": "be brief"}
    tok, out = _episode(d, "chat", "12+7=", data)
    want = tok.encode(CHATML_OF + "<|im_start|>assistant\n")
    for t in out:
        assert t.error is None, t.error
        (seq,) = t.sequences
        assert seq.prompt_length == len(want)
        assert list(seq.token_ids[: seq.prompt_length]) == want
        assert seq.loss_mask[: seq.prompt_length].sum() == 0
        assert seq.loss_mask[seq.prompt_length :].all() and len(seq.token_ids) > len(want)
    tok, out = _episode(d, "single_turn", "12+7=", data)  # completion style: the text as it is
    assert [list(t.sequences[0].token_ids[: len(tok.encode("12+7="))]) for t in out] == [
        tok.encode("12+7=")
    ] * 2
    assert all(t.sequences[0].prompt_length == len(tok.encode("12+7=")) for t in out)


def test_the_chat_workflow_on_a_model_without_a_template_fails_saying_so() -> None:
    async def go():
        model, tok = load_model("tiny")
        engine = TorchEngine({"policy": (model, tok)}, "cpu", max_batch=2)
        try:
            group = make_group("1+1=", n=1, tokens=2, workflow="chat")
            return await EngineBackend(engine, ["chat"]).generate(group, {"policy": 0})
        finally:
            await engine.close()

    (t,) = asyncio.run(asyncio.wait_for(go(), 60))
    assert t.error is not None and "has no chat template" in t.error


def test_preflight_refuses_a_chat_workflow_on_a_model_without_a_template(toy: Path) -> None:
    recipe = load_recipe(None, ["streams.0.workflow=chat"])
    with pytest.raises(PreflightError) as info:
        check_models(recipe)
    message = str(info.value)
    assert message.startswith("streams.0.workflow=chat: the model of policy policy (tiny)")
    assert "single_turn" in message and "\n" not in message
    check_models(load_recipe(None, ["streams.0.workflow=chat", f"policies.0.model={toy}"]))


def test_the_warm_up_and_the_baseline_of_a_chat_stream_render_prompts_through_the_template(
    toy: Path, tmp_path: Path
) -> None:
    """A chat stream's policy is warmed up and measured on the prompts the RaaS will send it
    (the template's), not on the bare prompt text."""
    from astra.run.baseline import random_baseline
    from astra.run.layout import RunDir, sft_command
    from astra.trainer.sft import encode_examples

    _, tokenizer = load_model(str(toy), "cpu")
    record = {"prompt": "12+7=", "answer": "19", "system": "be brief"}
    ((ids, n),) = encode_examples([record], tokenizer, chat=True)
    assert ids[:n] == list(tokenizer.encode(CHATML_OF + "<|im_start|>assistant\n"))
    assert ids[n:] == [*tokenizer.encode("19"), tokenizer.eos_id]
    ((plain, m),) = encode_examples([record], tokenizer)
    assert plain[:m] == list(tokenizer.encode("12+7="))

    chat = load_recipe(None, ["streams.0.workflow=chat", f"policies.0.model={toy}"])
    rd = RunDir(tmp_path / "run")
    assert "--chat" in sft_command(chat, chat.policies[0], rd, tmp_path / "d.jsonl")
    plain_recipe = load_recipe(None, [])
    assert "--chat" not in sft_command(plain_recipe, plain_recipe.policies[0], rd, tmp_path / "d")

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(3)))  # fmt: skip
    got = random_baseline(chat, data, 3)
    assert got["samples"] == 3 and got["accuracy"] is not None, got
