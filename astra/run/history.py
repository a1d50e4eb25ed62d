"""What the supervisor keeps of one policy's metrics rows: its last step and its accuracies.

summary.json (astra.run.summary) reads each policy's last step, how many of its steps
had an accuracy, and the first and last few of those accuracies; the elastic schedule
(astra.run.elastic) reads the last step. That is all a run keeps in memory of its rows:
16 bytes per step with an accuracy (its step and its value), none per row otherwise,
where a row is ~1 KB. metrics.jsonl holds every row in full; nothing here writes it.

The steps of the kept rows rise strictly: a step recorded again (a restarted trainer runs
on from its checkpoint) first drops itself and every later step, as far back as the
checkpoint is (with checkpoint.every_steps 0 that is step 1). So every accuracy is kept,
not a window of them: the last ones after such a rerun are whichever came before it.
A resumed run reads its earlier starts' rows back from metrics.jsonl (`load_histories`), so
its figures cover the whole run; what this start recorded is its segment.
"""

from __future__ import annotations

import json
from array import array
from bisect import bisect_left
from pathlib import Path


class StepHistory:
    def __init__(self) -> None:
        self.last_step: int | None = None  # None: no step recorded yet
        self._accuracy_steps = array("q")  # rising, one per value below
        self._accuracy = array("d")
        self._segment = 0  # where this start's accuracies begin (a resumed run's earlier ones)
        self.segment_first_step: int | None = None

    def start_segment(self) -> None:
        """What is recorded from now on is this start's (the steps before came from the
        earlier starts of a resumed run, read back from metrics.jsonl)."""
        self._segment = len(self._accuracy)
        self.segment_first_step = None

    def add(self, step: int, accuracy: float | None) -> bool:
        """Records a step; True where it runs again a step recorded before (that step and
        every later one are dropped first)."""
        rerun = self.last_step is not None and self.last_step >= step
        if rerun:
            cut = bisect_left(self._accuracy_steps, step)
            del self._accuracy_steps[cut:]
            del self._accuracy[cut:]
            self._segment = min(self._segment, cut)
        if self.segment_first_step is None or step < self.segment_first_step:
            self.segment_first_step = step
        self.last_step = step
        if accuracy is not None:
            self._accuracy_steps.append(step)
            self._accuracy.append(accuracy)
        return rerun

    @property
    def accuracy_steps(self) -> int:
        """How many of the kept steps had an accuracy."""
        return len(self._accuracy)

    def first_accuracies(self, n: int) -> list[float]:
        return self._accuracy[:n].tolist()

    def last_accuracies(self, n: int) -> list[float]:
        return self._accuracy[-n:].tolist() if n > 0 else []

    def segment_accuracies(self) -> list[float]:
        """The accuracies of this start's steps (a rerun step counts as this start's)."""
        return self._accuracy[self._segment :].tolist()


def load_histories(path: Path, histories: dict[str, StepHistory]) -> int:
    """Replays the rows of metrics.jsonl (the earlier starts of a resumed run) into
    `histories`, then starts a segment in each; the rows read. Rows of other policies, and
    lines that are no row (a torn last line), are skipped."""
    rows = 0
    try:
        f = path.open("rb")
    except FileNotFoundError:
        f = None
    if f is not None:
        with f:
            for line in f:
                try:
                    row = json.loads(line)
                    h = histories.get(row["policy"])
                    step, acc = int(row["step"]), row.get("accuracy")
                except (ValueError, KeyError, TypeError):
                    continue
                if h is not None:
                    h.add(step, acc if isinstance(acc, (int, float)) else None)
                    rows += 1
    for h in histories.values():
        h.start_segment()
    return rows
