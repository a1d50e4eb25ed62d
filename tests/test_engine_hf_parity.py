"""Our Qwen3/Llama decoder against transformers' own classes on the same files (skipped when
transformers is not installed; run it where it is)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from astra.engine.tiny import TINY_CONFIG, load_model, random_model, save_model  # noqa: E402

LLAMA = {
    **{k: v for k, v in TINY_CONFIG.items() if k != "head_dim"},
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "tie_word_embeddings": False,
    "attention_bias": True,
    "mlp_bias": True,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("config", [TINY_CONFIG, LLAMA], ids=["qwen3", "llama"])
def test_logits_equal_transformers(tmp_path: Path, config: dict) -> None:
    save_model(tmp_path / "m", random_model(config, seed=4), config)
    ours, _ = load_model(tmp_path / "m", dtype="float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    ids = torch.randint(0, 100, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.forward_full(ids) - theirs.eval()(ids).logits).abs().max()
    assert diff < 1e-4
