"""A toy Hugging Face model directory made here, with nothing downloaded: for trying `hf_cpu`.

`python -m astra.testing.toy_hf DIR [--family qwen3|llama]` writes a seeded,
randomly initialised decoder (2 layers, hidden 64) as safetensors with its
config.json, and a byte-level BPE tokenizer TRAINED here with the `tokenizers`
package on a small corpus of arithmetic and chat text: tokenizer.json,
tokenizer_config.json (eos `<|im_end|>`, pad `<|endoftext|>`, a ChatML chat
template) and generation_config.json. It is shaped like a real Qwen3 (or Llama)
checkpoint, so everything that reads a model directory reads it the same way; it
has learned nothing, so it answers at random.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from astra.engine.tiny import random_model, save_model

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = [
    "the",
    "answer",
    "is",
    "what",
    "sum",
    "of",
    "and",
    "plus",
    "minus",
    "times",
    "number",
    "reverse",
    "word",
    "letters",
    "please",
]


def corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Lines of sums, answers, words and chat turns: what the tokenizer is trained on."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 199), rng.randint(0, 199)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        lines.append(f"{a}+{b}={a + b}")
        lines.append(f"<|im_start|>user\n{words} {a}+{b}=<|im_end|>\n")
        lines.append(f"<|im_start|>assistant\n{a + b}<|im_end|>\n")
    return lines


def train_tokenizer(vocab_size: int = 512, seed: int = 0) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus()` (specials first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer)
    return tok


def model_config(family: str, vocab_size: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """config.json of a 2-layer decoder of `family` ("qwen3" or "llama")."""
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[family]
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }
    if family == "qwen3":
        config |= {"head_dim": 32, "use_sliding_window": False}
    return config


def make_toy_model(directory: str | Path, family: str = "qwen3", seed: int = 0) -> Path:
    """Writes the toy model into `directory` (which must not exist yet); returns it."""
    directory = Path(directory)
    tok = train_tokenizer(seed=seed)
    eos_id, pad_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = model_config(family, tok.get_vocab_size(with_added_tokens=True), eos_id, pad_id)
    save_model(directory, random_model(config, seed), config)
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML,
    }
    generation = {"eos_token_id": eos_id, "pad_token_id": pad_id}
    for name, doc in (
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation),
    ):
        (directory / name).write_text(json.dumps(doc, indent=2) + "\n")
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write it (must not exist yet)")
    parser.add_argument("--family", choices=("qwen3", "llama"), default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if Path(args.directory).exists():
        parser.error(f"{args.directory} exists already; give a new directory")
    print(make_toy_model(args.directory, args.family, args.seed))


if __name__ == "__main__":
    main()
