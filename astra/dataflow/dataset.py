"""The prompt source of Dataflow: a local dataset turned into a reproducible stream of WorkItems.

`load_records` reads a local JSONL or Parquet file into plain dicts. `PromptSource` walks those
records epoch by epoch in a seeded order and wraps each one in a `WorkItem` whose `group_id` is
the stable work id `"{policy_set}/{epoch}/{index}"` (see INVARIANTS.md, "Work identity and
delivery"). Its position is durable state: `state()` / `restore()` let a restarted Dataflow
continue exactly where it stopped, and `item_for()` rebuilds any already-dispatched item.

This module never touches the network, gRPC or protobuf, never writes files, and never decides
what happens to results: it only says which prompt comes next.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from astra.dataflow.config import DatasetSettings
from astra.dataflow.records import WorkItem


class DatasetError(Exception):
    """The dataset cannot be read, is invalid, or is not the one a saved state refers to."""


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_records(path: str | Path) -> list[dict]:
    """Read a local `.jsonl` (one JSON object per line) or `.parquet` file into a list of dicts."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset file not found: {p}")
    records: list[dict] = []
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            records = pq.read_table(p).to_pylist()
        except Exception as e:  # pyarrow raises several unrelated types for bad files
            raise DatasetError(f"{p}: cannot read parquet: {e}") from e
    else:
        with p.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{p}:{lineno}: malformed JSON: {e.msg}") from e
                if not isinstance(obj, dict):
                    kind = type(obj).__name__
                    raise DatasetError(f"{p}:{lineno}: expected a JSON object, got {kind}")
                records.append(obj)
    if not records:
        raise DatasetError(f"{p}: dataset is empty")
    return records


class PromptSource:
    """Yields one `WorkItem` per (epoch, record) in a seeded, restart-reproducible order.

    The order of epoch `e` is a permutation derived only from `(seed, e, size)`, so a restarted
    process recomputes the same order and `restore()` needs nothing but `(epoch, position)`.
    `group_id` uses the record's index in the file, not its position in the shuffled order:
    the id of a prompt is then a fact about the dataset, stable whatever the shuffling, seed or
    position bookkeeping, which is what makes re-dispatch and de-duplication by id safe.
    """

    def __init__(
        self,
        config: DatasetSettings,
        policy_ids: tuple[str, ...],
        workflow: str,
        num_samples: int,
        policy_set: str,
    ) -> None:
        if config.num_epochs < 0:
            raise ValueError(f"num_epochs must be >= 0, got {config.num_epochs}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not policy_ids:
            raise ValueError("policy_ids must not be empty")
        if not policy_set:
            raise ValueError("policy_set must not be empty")
        self._config = config
        self._policy_ids = tuple(policy_ids)
        self._workflow = workflow
        self._num_samples = num_samples
        self._policy_set = policy_set
        self._records = load_records(config.path)
        for i, rec in enumerate(self._records):
            prompt = rec.get(config.prompt_field)
            if not isinstance(prompt, str) or not prompt:
                raise DatasetError(
                    f"{config.path}: record {i} has no non-empty string field "
                    f"{config.prompt_field!r}"
                )
        self._fingerprint = _file_sha256(Path(config.path))
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def size(self) -> int:
        return len(self._records)

    @property
    def num_epochs(self) -> int:
        return self._config.num_epochs

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """How many items of the current epoch have been handed out."""
        return self._position

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def exhausted(self) -> bool:
        return self.num_epochs > 0 and self._epoch >= self.num_epochs

    def order(self, epoch: int) -> list[int]:
        """Record indices of `epoch` in dispatch order."""
        if not self._config.shuffle:
            return list(range(self.size))
        rng = np.random.default_rng((self._config.seed, epoch))
        return [int(i) for i in rng.permutation(self.size)]

    def next(self) -> WorkItem | None:
        """The next item, or None once every epoch has been handed out."""
        if self.exhausted:
            return None
        if self._order_epoch != self._epoch:
            self._order, self._order_epoch = self.order(self._epoch), self._epoch
        item = self._make(self._epoch, self._order[self._position])
        self._position += 1
        if self._position >= self.size:
            self._epoch, self._position = self._epoch + 1, 0
        return item

    def __iter__(self) -> Iterator[WorkItem]:
        while (item := self.next()) is not None:
            yield item

    def item_for(self, group_id: str) -> WorkItem:
        """Rebuild the WorkItem of `group_id`; ValueError if it is malformed or not ours."""
        prefix, sep, rest = group_id.rpartition("/")
        policy_set, sep2, epoch_s = prefix.rpartition("/")
        if not (sep and sep2) or policy_set != self._policy_set:
            raise ValueError(f"not a work id of policy set {self._policy_set!r}: {group_id!r}")
        epoch, index = _parse_index(epoch_s, group_id), _parse_index(rest, group_id)
        if index >= self.size or (self.num_epochs > 0 and epoch >= self.num_epochs):
            raise ValueError(f"work id out of range for this dataset: {group_id!r}")
        return self._make(epoch, index)

    def epoch_items(self, epoch: int) -> list[WorkItem]:
        """Every record as a group of `epoch`, in file order (an evaluation's groups)."""
        return [self._make(epoch, i) for i in range(self.size)]

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position, enough for `restore` in a fresh process."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "size": self.size,
            "fingerprint": self._fingerprint,
            "seed": self._config.seed,
            "shuffle": self._config.shuffle,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a saved `state`; DatasetError if it refers to a different dataset/order."""
        if state.get("fingerprint") != self._fingerprint or state.get("size") != self.size:
            raise DatasetError(
                f"{self._config.path}: dataset changed since the state was saved "
                f"(fingerprint {state.get('fingerprint')!r}, size {state.get('size')!r}); "
                "refusing to continue"
            )
        for key in ("seed", "shuffle"):
            if key in state and state[key] != getattr(self._config, key):
                raise DatasetError(f"saved {key}={state[key]!r} differs from the config")
        epoch, position = state.get("epoch"), state.get("position")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, position)):
            raise DatasetError(f"malformed dataset state: {state!r}")
        assert isinstance(epoch, int) and isinstance(position, int)  # (for the type checker)
        if epoch < 0 or not 0 <= position <= self.size:
            raise DatasetError(f"dataset state out of range: {state!r}")
        if position == self.size:
            epoch, position = epoch + 1, 0
        self._epoch, self._position = epoch, position

    def _make(self, epoch: int, index: int) -> WorkItem:
        return WorkItem(
            group_id=f"{self._policy_set}/{epoch}/{index}",
            policy_ids=self._policy_ids,
            workflow=self._workflow,
            record=dict(self._records[index]),
            num_samples=self._num_samples,
            epoch=epoch,
            index=index,
        )


def _parse_index(text: str, group_id: str) -> int:
    if not text.isdigit() or not text.isascii() or (len(text) > 1 and text[0] == "0"):
        raise ValueError(f"malformed work id: {group_id!r}")
    return int(text)
