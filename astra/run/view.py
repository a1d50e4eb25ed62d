"""Rendering of a run's live status with rich: one frame from one snapshot.

The snapshot is plain data (astra.run.poller.StatusPoller.snapshot):
    name, elapsed_s, num_steps, dataflow_address, error   (error: the last failed Dataflow poll)
    dataflow   astra.run.poller.dataflow_snapshot (gate, staleness, buffer, counters, ...)
    detail     astra.run.poller.dataflow_detail (per-policy buffer, per-instance pool, streams)
    trainers   policy -> {step, version, loss, metrics}
    rates      {groups_per_s, steps_per_s: {policy: rate}}
    evals      astra.run.poller.eval_results (held-out evaluations, finished and running)
This module only draws: `render` builds the renderable, `render_text` a plain-text
frame (no colour, ASCII boxes: `astra top --once`, tests), `LiveView` redraws a
frame in place on a terminal (`astra run` on a TTY, `astra top`).
"""

from __future__ import annotations

import io
import logging
import math
from collections import Counter
from typing import Any, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

MAX_INSTANCES = 12  # pool rows drawn; the rest are counted by state
MAX_STREAMS = 6
MAX_EVALS = 6  # finished evaluations shown, newest last
GATE_STYLE = {"ASYNC_RUNNING": "bold green", "SYNC_BARRIER": "bold yellow", "THROTTLED": "bold red"}
STATE_STYLE = {"ACTIVE": "green", "SUSPECT": "yellow", "DEAD": "red", "LEFT": "dim"}


# A policy's run of dropped groups is shown from this length on (shorter ones are routine:
# equal-reward groups filtered now and then).
DROPS_SHOWN = 32


def _num(value: Any, fmt: str = ".3g") -> str:
    if value is None or isinstance(value, bool):
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def _t(value: Any, style: str = "") -> Text:
    """Text, never markup: ids and reasons come from other processes."""
    return Text(str(value), style=style)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _table(plain: bool, *columns: str, title: str | None = None) -> Table:
    table = Table(
        *columns,
        box=box.ASCII if plain else box.SIMPLE_HEAD,
        title=title,
        title_justify="left",
        title_style="" if plain else "bold",
        show_edge=plain,
        pad_edge=False,
        expand=False,
    )
    return table


def _header(snap: dict[str, Any]) -> Text:
    text = Text()
    text.append(f"astra {snap.get('name') or 'run'}", style="bold")
    if (elapsed := snap.get("elapsed_s")) is not None:
        text.append(f"  elapsed {elapsed:.0f}s")
    if snap.get("dataflow_address"):
        text.append(f"  dataflow {snap['dataflow_address']}", style="dim")
    if snap.get("error"):
        text.append("\n")
        text.append(f"dataflow unreachable: {snap['error']}", style="bold red")
    return text


def _gate(snap: dict[str, Any]) -> Text:
    d, detail, rates = snap.get("dataflow") or {}, snap.get("detail") or {}, snap.get("rates") or {}
    text = Text()
    if not d:
        text.append("no Dataflow status yet", style="dim")
        return text
    gate = d.get("gate", "?")
    text.append("gate ")
    text.append(gate, style=GATE_STYLE.get(gate, "bold"))
    if d.get("gate_reason"):
        text.append(f" ({d['gate_reason']})")
    text.append(f"\nstaleness {_num(d.get('staleness'), '.3f')}")
    text.append(f"  buffer fill {_num(d.get('buffer_fill'), '.0%')}")
    text.append(f"  in flight {_num(d.get('in_flight'), 'd')}")
    if "gate_capacity" in detail:
        text.append(f"  admit capacity {_num(detail['gate_capacity'], 'd')}")
    if d.get("pool_empty"):
        text.append("  POOL EMPTY", style="bold red")
    c = d.get("counters") or {}
    text.append(
        f"\ngroups dispatched {c.get('dispatched', 0)}  done {c.get('groups_done', 0)}"
        f"  trained {c.get('consumed_groups', 0)}  failed {c.get('failed_groups', 0)}"
        f"  redispatched {c.get('redispatched', 0)}  duplicates {c.get('duplicates_dropped', 0)}"
    )
    text.append(f"\nthroughput {_rate(rates.get('groups_per_s'))} groups/s")
    steps = [r for r in (rates.get("steps_per_s") or {}).values() if r is not None]
    text.append(f"  {_rate(sum(steps) if steps else None)} steps/s")
    return text


def _policies(snap: dict[str, Any], plain: bool) -> Table | None:
    d, detail = snap.get("dataflow") or {}, snap.get("detail") or {}
    trainers: dict[str, Any] = snap.get("trainers") or {}
    rates = (snap.get("rates") or {}).get("steps_per_s") or {}
    policies = sorted({*trainers, *(d.get("versions") or {}), *(detail.get("policies") or {})})
    if not policies:
        return None
    table = _table(plain, "policy", "step", "version", "loss", "accuracy", "reward")
    for column in ("staleness", "gap", "buffer", "steps/s"):
        table.add_column(column)
    total = snap.get("num_steps")
    for p in policies:
        t = trainers.get(p) or {}
        m = t.get("metrics") or {}
        pd = (detail.get("policies") or {}).get(p) or {}
        step = "-" if "step" not in t else f"{t['step']}" + (f"/{total}" if total else "")
        version = _num((d.get("versions") or {}).get(p, t.get("version")), "d")
        if pd.get("target_version") not in (None, (d.get("versions") or {}).get(p)):
            version += f" (pool {pd['target_version']})"
        buffered = pd.get("buffered", (d.get("buffered") or {}).get(p))
        buffer = _num(buffered, "d")
        if pd.get("capacity"):
            buffer += f"/{pd['capacity']}"
        if pd.get("leased"):
            buffer += f" +{pd['leased']} leased"
        acc = m.get("accuracy")
        table.add_row(
            _t(p, "bold"),
            _t(step),
            _t(version),
            _t(_num(t.get("loss"), ".4g")),
            _t(_num(acc, ".2f")),
            _t(_num(m.get("reward_mean"), ".3f")),
            _t(_num(m.get("score"), ".3f")),
            _t(_num(m.get("version_gap_mean"), ".2f")),
            _t(buffer),
            _t(_rate(rates.get(p))),
        )
    return table


def _pool(snap: dict[str, Any], plain: bool) -> Table | None:
    detail = snap.get("detail") or {}
    instances: list[dict[str, Any]] = detail.get("instances") or []
    if not instances:
        states = (snap.get("dataflow") or {}).get("raas_states") or {}
        instances = [{"id": i, "state": s} for i, s in states.items()]
    if not instances:
        return None
    counts = Counter(i.get("state", "?") for i in instances)
    title = "RaaS pool: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    table = _table(plain, "instance", "state", "in flight", "free/capacity", "versions", "fails")
    table.title = title
    for inst in instances[:MAX_INSTANCES]:
        state = inst.get("state", "?")
        versions = " ".join(f"{p}:v{v}" for p, v in sorted((inst.get("versions") or {}).items()))
        free = f"{_num(inst.get('free'), 'd')}/{_num(inst.get('capacity'), 'd')}"
        table.add_row(
            _t(inst.get("id", "?")),
            _t(state, STATE_STYLE.get(state, "")),
            _t(_num(inst.get("in_flight"), "d")),
            _t(free),
            _t(versions or "-"),
            _t(_num(inst.get("failures"), "d")),
        )
    if len(instances) > MAX_INSTANCES:
        rest = Counter(i.get("state", "?") for i in instances[MAX_INSTANCES:])
        more = ", ".join(f"{n} {s}" for s, n in sorted(rest.items()))
        table.add_row(_t(f"... {len(instances) - MAX_INSTANCES} more ({more})", "dim"))
    return table


def _evals(snap: dict[str, Any]) -> Text | None:
    evals = snap.get("evals") or []
    if not evals:
        return None
    several = len({(e.get("stream"), e.get("policy_id")) for e in evals}) > 1

    def who(e: dict[str, Any]) -> str:  # which evaluation, where a run has several
        return f"{e.get('policy_id')}/{e.get('stream')} " if several else ""

    done = [e for e in evals if e.get("complete")][-MAX_EVALS:]
    parts = [f"{who(e)}v{e.get('version')} {_num(e.get('mean_reward'), '.2f')}" for e in done]
    parts += [
        f"{who(e)}v{e.get('version')} running {e.get('groups_done', 0)}/{e.get('groups', 0)}"
        for e in evals
        if not e.get("complete")
    ]
    text = Text("held-out eval (mean reward) ")
    text.append(" | ".join(parts))
    return text


def _drops(snap: dict[str, Any]) -> Text | None:
    """Policies whose finished groups have all been dropped for a while: no batch forms."""
    policies = (snap.get("detail") or {}).get("policies") or {}
    long = {
        p: d for p, d in sorted(policies.items()) if d.get("dropped_in_a_row", 0) >= DROPS_SHOWN
    }
    if not long:
        return None
    text = Text()
    for p, d in long.items():
        if text:
            text.append("\n")
        text.append(
            f"{p}: the last {d['dropped_in_a_row']} finished groups were dropped "
            f"({d.get('last_drop') or '?'}); no batch forms until one is kept",
            style="bold yellow",
        )
    return text


def _streams(snap: dict[str, Any]) -> Text | None:
    evaluating = {e.get("stream") for e in snap.get("evals") or []}
    streams = [
        s
        for s in (snap.get("detail") or {}).get("streams") or []
        if s.get("name") not in evaluating
    ]
    if not streams:
        return None
    text = Text("dataset ")
    parts = []
    for s in streams[:MAX_STREAMS]:
        epochs = s.get("num_epochs") or "inf"
        done = " (exhausted)" if s.get("exhausted") else ""
        parts.append(
            f"{s.get('name')}: epoch {s.get('epoch', 0) + 1}/{epochs} "
            f"record {s.get('position', 0)}/{s.get('size', 0)}{done}"
        )
    if len(streams) > MAX_STREAMS:
        parts.append(f"... {len(streams) - MAX_STREAMS} more")
    text.append("; ".join(parts))
    return text


def render(snap: dict[str, Any], *, plain: bool = False) -> RenderableType:
    """One frame. `plain`: ASCII boxes (styles are dropped by a console without colour)."""
    parts: list[RenderableType] = [_header(snap), _gate(snap)]
    for part in (
        _streams(snap),
        _evals(snap),
        _drops(snap),
        _policies(snap, plain),
        _pool(snap, plain),
    ):
        if part is not None:
            parts.append(part)
    return Group(*parts)


def render_text(snap: dict[str, Any], *, width: int = 110) -> str:
    """A frame as plain text: no colour, no control sequences, ASCII boxes."""
    buf = io.StringIO()
    console = Console(
        file=buf, width=width, color_system=None, force_terminal=False, no_color=True,
        highlight=False, emoji=False, legacy_windows=False,
    )  # fmt: skip
    console.print(render(snap, plain=True))
    return buf.getvalue()


class _LogProxy(io.TextIOBase):
    """Where the terminal's log handlers write while a live frame is shown: above it."""

    def __init__(self, live: Live) -> None:
        self.live, self.partial = live, ""

    def write(self, s: str) -> int:
        *lines, self.partial = (self.partial + s).split("\n")
        for line in lines:
            self.live.console.print(Text(line), soft_wrap=True)
        return len(s)

    def flush(self) -> None:
        pass


class LiveView:
    """A frame redrawn in place on `out` (a terminal). Log records that the root logger's
    stream handlers would write to `out` are printed above the frame meanwhile."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.console = Console(file=out, highlight=False)
        self.live = Live(
            console=self.console, auto_refresh=False, transient=False,
            redirect_stdout=False, redirect_stderr=False,
        )  # fmt: skip
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        self.started = False

    def start(self) -> None:
        self.live.start()
        self.started = True
        proxy = _LogProxy(self.live)
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler and handler.stream is self.out:
                self._handlers.append((handler, handler.setStream(proxy)))  # type: ignore[arg-type]

    def update(self, snap: dict[str, Any]) -> None:
        if not self.started:
            self.start()
        self.live.update(render(snap), refresh=True)

    def stop(self) -> None:
        if not self.started:
            return
        self.started = False
        try:
            self.live.stop()
        finally:
            for handler, stream in self._handlers:
                handler.setStream(stream)
            self._handlers.clear()
