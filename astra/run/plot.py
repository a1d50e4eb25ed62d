"""<run>/plot.png: reward/accuracy and staleness over trainer steps, from metrics.jsonl.

Plots what metrics.jsonl holds and nothing else: every row, in file order, per
policy (after a --resume the steps redone since the last checkpoint appear
twice); past MAX_POINTS rows a series keeps every k-th point and its last (k a
power of two, said in the title), so a run of weeks reads in bounded memory. Top
panel: the row's `accuracy` and the trainer's `reward_mean` of that step (absent
where no trainer poll saw the step), and the held-out evaluations of
evals.jsonl beside it (mean reward at the version evaluated). Bottom panel: the Dataflow
gate's smoothed staleness score at the last poll before the step, the trainer's
staleness score of the batch, and (right axis) the trainer's mean version gap.
matplotlib's Agg canvas only (no pyplot, no display, no global backend change).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

Series = dict[str, dict[str, list[tuple[int, float]]]]  # policy -> name -> [(step, value)]
MAX_POINTS = 4096  # per series: more are thinned while read (see the module docstring)


class _Thinned:
    """A series read point by point, kept to at most 2 x MAX_POINTS: every `stride`-th."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []
        self.stride, self.seen = 1, 0
        self.last: tuple[int, float] | None = None

    def append(self, point: tuple[int, float]) -> None:
        if self.seen % self.stride == 0:
            self.points.append(point)
            if len(self.points) > 2 * MAX_POINTS:
                del self.points[1::2]
                self.stride *= 2
        self.seen += 1
        self.last = point

    def done(self) -> list[tuple[int, float]]:
        if self.last is not None and (not self.points or self.points[-1] is not self.last):
            self.points.append(self.last)
        return self.points


# name -> (where in a row, label)
SERIES: dict[str, tuple[tuple[str, ...], str]] = {
    "accuracy": (("accuracy",), "accuracy"),
    "reward_mean": (("trainer", "reward_mean"), "reward mean"),
    "gate_staleness": (("dataflow", "staleness"), "staleness score (Dataflow gate, smoothed)"),
    "trainer_staleness": (("trainer", "score"), "staleness score (trainer, batch)"),
    "version_gap": (("trainer", "version_gap_mean"), "mean version gap (right axis)"),
}


def _get(row: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = row
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def read_series(metrics: Path) -> tuple[Series, int]:
    """The plotted series of every row of `metrics` (thinned past MAX_POINTS), and the number
    of rows read."""
    series, rows, _ = _read(metrics)
    return series, rows


def _read(metrics: Path) -> tuple[Series, int, int]:
    """(series, rows read, the largest stride a series was thinned to)."""
    thinned: dict[str, dict[str, _Thinned]] = defaultdict(lambda: defaultdict(_Thinned))
    rows = 0
    if not metrics.is_file():
        return defaultdict(lambda: defaultdict(list)), 0, 1
    with metrics.open() as f:
        for line in f:
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill, or not a row
            rows += 1
            policy = str(row.get("policy", "policy"))
            for name, (path, _) in SERIES.items():
                if (v := _get(row, path)) is not None:
                    thinned[policy][name].append((step, v))
    series: Series = defaultdict(lambda: defaultdict(list))
    stride = 1
    for policy, by_name in thinned.items():
        for name, t in by_name.items():
            series[policy][name] = t.done()
            stride = max(stride, t.stride)
    return series, rows, stride


def read_evals(path: Path) -> dict[str, list[tuple[int, float]]]:
    """policy (with its evaluation stream, unless that is `eval`) -> [(version, mean reward)]
    of the finished evaluations in evals.jsonl."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            point = (int(row["version"]), float(row["mean_reward"]))
        except (ValueError, KeyError, TypeError):
            continue  # cut short by a kill, or nothing scored
        stream = str(row.get("stream", "eval"))
        label = str(row.get("policy", "policy")) + ("" if stream == "eval" else f" {stream}")
        out[label].append(point)
    return out


def write_plot(metrics: Path, out: Path, *, title: str = "") -> Path:
    """Draws the figure and writes it to `out` (atomically); returns `out`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series, rows, stride = _read(metrics)
    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    gap_axis = None
    multi = len(series) > 1
    for policy, by_name in sorted(series.items()):
        prefix = f"{policy}: " if multi else ""
        for name, points in sorted(by_name.items()):
            label = SERIES[name][1]
            kw: dict[str, Any] = {}
            if name == "version_gap":
                gap_axis = gap_axis or bottom.twinx()
                axis, kw = gap_axis, {"linestyle": ":", "color": "gray" if not multi else None}
            else:
                axis = top if name in ("accuracy", "reward_mean") else bottom
            steps, values = zip(*points, strict=True)
            marker = "." if len(points) <= 200 else None
            axis.plot(steps, values, marker=marker, label=prefix + label, linewidth=1.2, **kw)
    evals = read_evals(metrics.with_name("evals.jsonl"))
    for policy, points in sorted(evals.items()):
        prefix = f"{policy}: " if multi or len(evals) > 1 else ""
        versions, values = zip(*sorted(points), strict=True)
        label = prefix + "held-out mean reward (eval, x = version)"
        top.plot(versions, values, marker="o", linestyle="--", label=label, linewidth=1.2)
    top.set_ylabel("reward / accuracy")
    bottom.set_ylabel("staleness score")
    bottom.set_xlabel("trainer step")
    if gap_axis is not None:
        gap_axis.set_ylabel("versions")
    for axis, what in ((top, "accuracy or reward"), (bottom, "staleness")):
        handles, labels = axis.get_legend_handles_labels()
        if axis is bottom and gap_axis is not None:
            more = gap_axis.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        if handles:
            axis.legend(handles, labels, loc="best", fontsize="small")
        else:
            axis.text(
                0.5, 0.5, f"no {what} in metrics.jsonl", ha="center", va="center",
                transform=axis.transAxes, color="gray",
            )  # fmt: skip
        axis.grid(True, alpha=0.3)
    thinned = f"; every {stride}th point drawn" if stride > 1 else ""
    fig.suptitle(f"{title} ({rows} rows of {metrics.name}{thinned})".strip())
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("wb") as f:
        fig.savefig(f, format="png")
    tmp.replace(out)
    return out
