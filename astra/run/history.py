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
"""

from __future__ import annotations

from array import array
from bisect import bisect_left


class StepHistory:
    def __init__(self) -> None:
        self.last_step: int | None = None  # None: no step recorded yet
        self._accuracy_steps = array("q")  # rising, one per value below
        self._accuracy = array("d")

    def add(self, step: int, accuracy: float | None) -> bool:
        """Records a step; True where it runs again a step recorded before (that step and
        every later one are dropped first)."""
        rerun = self.last_step is not None and self.last_step >= step
        if rerun:
            cut = bisect_left(self._accuracy_steps, step)
            del self._accuracy_steps[cut:]
            del self._accuracy[cut:]
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
