"""The built-in character tokenizer written as Hugging Face tokenizer files.

A model directory whose config.json says `"astra_tokenizer": "char"` is read by
Astra's own engine with `CharTokenizer`. vLLM and transformers read
`tokenizer.json` instead, so every such directory also carries:

- `tokenizer.json`: a `tokenizers` BPE model with no merges whose vocabulary is
  exactly `CharTokenizer`'s (ids 0-3 `<pad>` `<bos>` `<eos>` `<unk>`, then one id
  per character), no normaliser, no pre-tokeniser, no post-processor (encoding
  adds no BOS or EOS, as `CharTokenizer.encode` does), decoded by `Fuse`
  (characters joined with nothing between them);
- `tokenizer_config.json` (`PreTrainedTokenizerFast`, the four special tokens);
- `special_tokens_map.json` and `generation_config.json` (the config's bos, eos and pad ids:
  1, 2 and 0 for tiny; one the config sets to null is left out).

The files are plain JSON built here, so writing them needs no `tokenizers` or
`transformers`; tests/test_char_hf.py loads them with both (where installed)
and checks ids, EOS and decoding against `CharTokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from astra.engine.tokenizer import CharTokenizer

MAX_LENGTH = 2048  # the tiny model's max_position_embeddings


def _added_tokens() -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(CharTokenizer.specials)
    ]


def tokenizer_json() -> dict[str, Any]:
    """The `tokenizers` serialisation of `CharTokenizer` (see the module docstring)."""
    vocab = {token: i for i, token in enumerate(CharTokenizer.specials)}
    base = len(CharTokenizer.specials)
    vocab.update({ch: base + i for i, ch in enumerate(CharTokenizer.chars)})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(),
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def tokenizer_config() -> dict[str, Any]:
    pad, bos, eos, unk = CharTokenizer.specials
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": pad,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_LENGTH,
        "added_tokens_decoder": {
            str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in _added_tokens()
        },
    }


def generation_config(config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """bos, eos and pad ids as the model's config.json names them (the tokenizer's when no
    config is given); an id the config sets to null is left out, so that nothing stops at
    an eos the model does not have."""
    ids = {
        "bos_token_id": CharTokenizer.bos_id,
        "eos_token_id": CharTokenizer.eos_id,
        "pad_token_id": CharTokenizer.pad_id,
    }
    if config is not None:
        ids = {k: config.get(k, v) for k, v in ids.items()}
    return {k: v for k, v in ids.items() if v is not None}


def char_tokenizer_files(config: Mapping[str, Any] | None = None) -> dict[str, bytes]:
    """File name -> bytes of every tokenizer file a char-tokenizer model directory carries
    (`config`: the model's config.json, for generation_config.json's ids)."""
    pad, bos, eos, unk = CharTokenizer.specials
    specials = {"pad_token": pad, "bos_token": bos, "eos_token": eos, "unk_token": unk}
    docs = {
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": tokenizer_config(),
        "special_tokens_map.json": specials,
        "generation_config.json": generation_config(config),
    }
    return {name: (json.dumps(doc, indent=2) + "\n").encode() for name, doc in docs.items()}
