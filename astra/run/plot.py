"""<run>/plot.png: reward/accuracy and staleness over trainer steps, from metrics.jsonl.

Plots what metrics.jsonl holds and nothing else: every row, in file order, per
policy (after a --resume the steps redone since the last checkpoint appear
twice). Top panel: the row's `accuracy` and the trainer's `reward_mean` of that
step (absent where no trainer poll saw the step), and the held-out evaluations of
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
    """The plotted series of every row of `metrics`, and the number of rows read."""
    series: Series = defaultdict(lambda: defaultdict(list))
    rows = 0
    if not metrics.is_file():
        return series, 0
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
                    series[policy][name].append((step, v))
    return series, rows


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

    series, rows = read_series(metrics)
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
    fig.suptitle(f"{title} ({rows} rows of {metrics.name})".strip())
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("wb") as f:
        fig.savefig(f, format="png")
    tmp.replace(out)
    return out
