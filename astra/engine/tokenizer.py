"""Tokenizers from local files only: the built-in character tokenizer, or a model's tokenizer.json.

`CharTokenizer` needs nothing: ids 0-3 are pad, bos, eos, unk; ids 4-99 are
"\\n" then the printable ASCII characters " " to "~" in code-point order. The
ids never change, so every process and every saved tiny model agree.

A Hugging Face directory's `tokenizer.json` is read with the `tokenizers`
package (`pip install tokenizers`; transformers is not needed). This module
never imports it unless such a directory is loaded, and never fetches
anything over the network. A directory with only a sentencepiece model (no
tokenizer.json) is refused: convert it once with transformers elsewhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from astra.errors import FailedPrecondition

CHAR_TOKENIZER = "char"  # config.json "astra_tokenizer" value naming the built-in tokenizer


class CharTokenizer:
    """Character-level tokenizer over newline + printable ASCII; encode adds no specials."""

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3
    chat_template = None
    specials = ("<pad>", "<bos>", "<eos>", "<unk>")
    chars = "\n" + "".join(chr(c) for c in range(32, 127))
    vocab_size = len(specials) + len(chars)  # 100

    def __init__(self) -> None:
        self._ids = {ch: i + len(self.specials) for i, ch in enumerate(self.chars)}

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(ch, self.unk_id) for ch in text]

    def decode(self, ids: list[int]) -> str:
        """Text of the ids; pad/bos/eos decode to nothing, unk to U+FFFD."""
        out = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the vocabulary of {self.vocab_size}")
            if i >= len(self.specials):
                out.append(self.chars[i - len(self.specials)])
            elif i == self.unk_id:
                out.append("\ufffd")
        return "".join(out)


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json behind the api.Tokenizer protocol."""

    def __init__(self, tokenizer: Any, eos_id: int, chat_template: Any = None) -> None:
        self._tok = tokenizer
        self.eos_id = eos_id
        self.chat_template = chat_template  # astra.engine.chat.ChatTemplate, or None
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _eos_id(directory: Path, tokenizer: Any) -> int:
    """eos from tokenizer_config.json's eos_token, else config.json's (first) eos_token_id."""
    token = _read_json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
        return int(tokenizer.token_to_id(token))
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(directory / name).get("eos_token_id")
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if isinstance(eos, int):
            return eos
    raise FailedPrecondition(
        f"{directory}: no eos token in tokenizer_config.json or config.json",
        reason="NO_EOS_TOKEN",
        metadata={"path": str(directory)},
    )


def load_tokenizer(path: str | os.PathLike[str]) -> CharTokenizer | HFTokenizer:
    """`tiny`, a directory whose config.json names the char tokenizer, or one with tokenizer.json."""
    if str(path) == "tiny":
        return CharTokenizer()
    directory = Path(path)
    if _read_json(directory / "config.json").get("astra_tokenizer") == CHAR_TOKENIZER:
        return CharTokenizer()
    if not (directory / "tokenizer.json").is_file():
        raise FailedPrecondition(
            f"{directory}: no tokenizer.json (sentencepiece-only tokenizers are not supported)",
            reason="NO_TOKENIZER",
            metadata={"path": str(directory)},
        )
    try:
        import tokenizers
    except ImportError as exc:
        raise FailedPrecondition(
            f"{directory}/tokenizer.json needs the tokenizers package: pip install tokenizers",
            reason="TOKENIZERS_NOT_INSTALLED",
            metadata={"path": str(directory)},
        ) from exc
    from astra.engine.chat import load_chat_template

    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises a bare Exception for a damaged file
        raise FailedPrecondition(
            f"{directory}/tokenizer.json cannot be read: {exc}",
            reason="BAD_TOKENIZER",
            metadata={"path": str(directory)},
        ) from None
    return HFTokenizer(tokenizer, _eos_id(directory, tokenizer), load_chat_template(directory))
