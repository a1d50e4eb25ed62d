"""The engine's model, files, tokenizer and sampler, without the scheduler."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from astra.engine.api import Sampling  # noqa: E402
from astra.engine.model_config import ModelConfig  # noqa: E402
from astra.engine.sampler import sample  # noqa: E402
from astra.engine.tiny import (  # noqa: E402
    TINY_CONFIG,
    load_model,
    random_model,
    save_model,
    save_tiny,
    tiny_model,
)
from astra.engine.tokenizer import CharTokenizer, load_tokenizer  # noqa: E402
from astra.engine.torch_engine import TorchEngine  # noqa: E402
from astra.errors import FailedPrecondition, InvalidArgument  # noqa: E402
from astra.weights.checkpoint import load_tensors  # noqa: E402

LLAMA_CONFIG = {
    **{k: v for k, v in TINY_CONFIG.items() if k != "head_dim"},
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def test_save_tiny_load_round_trip_gives_identical_logits(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "tiny", version="v0")
    names = set(load_tensors(path))  # a full astra.weights version
    assert "lm_head.weight" not in names and "model.layers.1.self_attn.q_norm.weight" in names
    loaded, tok = load_model(path)
    assert isinstance(tok, CharTokenizer)
    ids = torch.randint(0, 100, (3, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.forward_full(ids), tiny_model().forward_full(ids))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_bf16_load_and_lone_model_safetensors(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "tiny")
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "config.json").write_text((path / "config.json").read_text())
    (path / "model-00001-of-00001.safetensors").rename(lone / "model.safetensors")
    model, _ = load_model(lone, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        ref = tiny_model(dtype=torch.bfloat16).forward_full(torch.tensor([[5, 6, 7]]))
        assert torch.equal(model.forward_full(torch.tensor([[5, 6, 7]])), ref)


def test_llama_config_without_qk_norm_loads_and_runs(tmp_path: Path) -> None:
    cfg = ModelConfig.from_hf(LLAMA_CONFIG)
    assert not cfg.qk_norm and cfg.head_dim == 16 and cfg.rope_type == "llama3"
    model = random_model(cfg, seed=3)
    assert not any("q_norm" in n for n, _ in model.named_parameters())
    save_model(tmp_path / "llama", model, LLAMA_CONFIG)
    loaded, _ = load_model(tmp_path / "llama", dtype="float32")
    prompt = [5, 9, 40, 41, 42]

    async def go() -> list[float]:
        engine = TorchEngine({"llama": (loaded, CharTokenizer())})
        try:
            gen = await engine.generate("llama", prompt, Sampling(max_new_tokens=30, temperature=0))
            return [*gen.token_ids, *gen.logprobs]
        finally:
            await engine.close()

    out = asyncio.run(asyncio.wait_for(go(), 30))
    tokens, logprobs = out[:30], torch.tensor(out[30:])
    with torch.no_grad():
        logits = model.forward_full(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1 :]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert tokens == logits.argmax(-1).tolist() and torch.allclose(logprobs, ref, atol=1e-4)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        ModelConfig.from_hf({**TINY_CONFIG, **change})
    assert info.value.metadata["field"] == field


def test_transformers5_rope_parameters_are_read() -> None:
    raw = {k: v for k, v in TINY_CONFIG.items() if k != "rope_theta"}
    cfg = ModelConfig.from_hf(
        {**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    )
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == ()


def test_state_checks_name_the_tensor() -> None:
    model = tiny_model()
    state = model.hf_state_dict()
    with pytest.raises(InvalidArgument, match="missing"):
        model.load_weights({k: v for k, v in state.items() if "norm" not in k})
    with pytest.raises(InvalidArgument, match="unknown tensor"):
        model.load_weights({**state, "model.extra.weight": torch.zeros(1)})
    with pytest.raises(InvalidArgument) as info:
        model.load_weights({**state, "model.norm.weight": torch.zeros(3)})
    assert info.value.metadata["tensor"] == "model.norm.weight"


def test_char_tokenizer_ids_are_fixed() -> None:
    tok = CharTokenizer()
    assert tok.vocab_size == 100 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("\n A~") == [4, 5, 5 + 33, 99]
    assert tok.encode("é") == [tok.unk_id] and tok.decode([1, 2, 3, 0]) == "\ufffd"
    text = "def f(x):\n    return x * 2  # ok!"
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError):
        tok.decode([100])


def test_tokenizer_json_without_the_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(FailedPrecondition, match="pip install tokenizers") as info:
        load_tokenizer(tmp_path)
    assert info.value.reason == "TOKENIZERS_NOT_INSTALLED"
    with pytest.raises(FailedPrecondition, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path / "missing")


def test_tokenizer_json_loads_with_the_package(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<eos>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_id == 0 and loaded.encode("hello world") == [1, 2]


def test_top_p_top_k_cut_and_renormalise() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(400, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(400)]
    draws = sample(logits, [Sampling(max_new_tokens=1, top_p=0.8)] * 400, gens)
    counts = torch.bincount(torch.tensor(draws.tokens), minlength=4)
    assert counts[2:].sum() == 0 and 200 < counts[0] < 300  # p(0) = 0.5 / 0.8
    cut = {t: lp for t, lp in zip(draws.tokens, draws.sampling_logprobs, strict=True)}
    assert abs(cut[0] - torch.log(torch.tensor(0.625)).item()) < 1e-5
    assert abs(draws.logprobs[draws.tokens.index(1)] - torch.log(torch.tensor(0.3)).item()) < 1e-5
    top1 = sample(logits[:3], [Sampling(max_new_tokens=1, top_k=1)] * 3, gens[:3])
    assert top1.tokens == [0, 0, 0] and top1.sampling_logprobs == [0.0, 0.0, 0.0]
    greedy = sample(logits[:2], [Sampling(max_new_tokens=1, temperature=0)] * 2, [None, None])
    assert greedy.tokens == [0, 0] and greedy.sampling_logprobs == [0.0, 0.0]


def test_model_vocabulary_padded_past_the_tokenizer_does_not_fail_requests() -> None:
    model = random_model({**TINY_CONFIG, "vocab_size": 400}, seed=5)  # ids 100..399 undecodable

    async def go() -> list:
        engine = TorchEngine({"p": (model, CharTokenizer())})
        try:
            s = Sampling(max_new_tokens=60, temperature=2.0, seed=1, stop_strings=("zz",))
            return [await engine.generate("p", [5, 6, 7], s), engine.healthy]
        finally:
            await engine.close()

    gen, healthy = asyncio.run(asyncio.wait_for(go(), 30))
    assert healthy and max(gen.token_ids) >= 100
    assert gen.text == CharTokenizer().decode([t for t in gen.token_ids if t < 100])
