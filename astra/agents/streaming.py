"""A streamed answer's text, piece by piece as the engine samples it.

`TextDeltas` turns the tokens of a generation, told one at a time, into pieces of text that are
safe to send before the generation ends: the text decoded so far, less a trailing incomplete
character (U+FFFD until its last byte arrives), less everything from the first stop string
(the engine cuts the answer there) and from the first tool-call marker or any beginning of one
at the end (that text may become a call, not content). What is held back goes out with the
finished answer (`rest`). Pure: no engine, no HTTP, no asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextDeltas:
    def __init__(
        self, tokenizer: Any, stops: Sequence[str] = (), markers: Sequence[str] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stops, self.markers = tuple(stops), tuple(markers)
        self.tokens: list[int] = []
        self.sent = ""

    def _text(self) -> str:
        try:
            return self.tokenizer.decode(self.tokens)
        except (ValueError, IndexError, KeyError, TypeError, OverflowError):
            return ""  # an id the tokenizer cannot decode: held until the answer is done

    def _safe(self, text: str) -> int:
        """How much of `text` no later token can change or claim."""
        safe = len(text.rstrip("\ufffd"))
        for s in (*self.stops, *self.markers):
            at = text.find(s)
            if at >= 0:
                safe = min(safe, at)
        for m in self.markers:  # a marker's beginning at the end may yet complete it
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return safe

    def add(self, token: int) -> str:
        """The new piece of text this token makes safe to send ("" when none)."""
        self.tokens.append(int(token))
        text = self._text()
        safe = self._safe(text)
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece = text[len(self.sent) : safe]
        self.sent += piece
        return piece

    def rest(self, final: str) -> str:
        """What of the finished answer `final` is not sent yet."""
        return final[len(self.sent) :] if final.startswith(self.sent) else ""
