"""`WeightsDir`, a policy's weights as a local Hugging Face directory, and `SwapClock`, the
timer of a swap's phases: what an HTTP engine is handed and what it reports for one swap.
Never imports gRPC or an HTTP client.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


class WeightsDir(Mapping[str, Any]):
    """A policy's weights as a local Hugging Face directory (config.json + safetensors).

    HTTP engines hand `path` to the server (update from disk). Read as a
    mapping (tensor name -> torch tensor) it loads the directory lazily on
    first access, so the built-in torch engine accepts the same object.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).resolve()
        self._tensors: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._tensors is None:
            from astra.engine.torch_weights import load_state

            self._tensors = load_state(self.path)
        return self._tensors

    def __getitem__(self, name: str) -> Any:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __repr__(self) -> str:
        return f"WeightsDir({str(self.path)!r})"


class SwapClock:
    """The phases of one swap: `mark(name)` records the seconds since the previous mark."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now
