"""Live observation of a run: GetStatus polling, metrics.jsonl, and a compact status line.

Every `poll_interval_s` the observer asks Dataflow for its status; every quarter
of that it asks each trainer (TrainerService.GetStatus) and reads the new lines
of each trainer's log. Every step becomes one row of metrics.jsonl: step,
version, loss, skip reason and accuracy from the trainer's per-step log line
("step N version V loss X [SKIPPED] [accuracy|reward_mean=A]",
astra.servers.trainer), so every row has its step's accuracy; the trainer's other
figures of that step from GetStatus (grad norm, staleness, timings) when a poll
saw that step (else `trainer` is null: GetStatus holds only the last step, and
tiny-model steps can be much shorter than a poll); and the latest Dataflow
snapshot (gate, buffer, pool, counters).

metrics.jsonl is the only complete record of the rows: in memory the observer keeps
of each policy's rows only what summary.json and the elastic schedule read, a few
bytes per step (astra.run.history's `StepHistory`).

Each row also goes to TensorBoard event files (astra.run.tboard) and, at the end,
metrics.jsonl is drawn to plot.png (astra.run.plot). On a terminal the status is a
live frame redrawn in place (astra.run.view); elsewhere (CI, pipes) a compact line
every `status_every_s`. None of these outputs may stop a run: an error in one is
logged once and that output is turned off.

The polling itself and the snapshot the view draws are astra.run.poller's
`StatusPoller` (without the run's files; `astra top` uses it on its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from astra.dataflow.status import DATA_EXHAUSTED
from astra.run.history import StepHistory, load_histories
from astra.run.logrotate import (
    HEAD_BYTES,
    copy_ids,
    missed_after,
    missed_before_truncation,
    missed_since_start,
)
from astra.run.poller import StatusPoller
from astra.run.progress import ProgressWatch

if TYPE_CHECKING:
    from astra.run.evals import EvalLog
    from astra.run.tboard import TensorBoardSink
    from astra.run.view import LiveView

log = logging.getLogger("astra.run.observe")
ACCURACY_KEYS = ("accuracy", "reward_mean")  # binary rewards: the mean is the accuracy
# The trainer's per-step log line, as text or as a JSON log record (astra.logs).
STEP_LINE = re.compile(
    rb'astra\.servers\.trainer(?::|", "msg":) "?step (\d+) version (-?\d+) loss ([^\s"]+) ?([^\s"]*)'
    rb'(?: +(?:accuracy|reward_mean)=([^\s"]+))?'
)


class Observer(StatusPoller):
    def __init__(
        self,
        dataflow: str,
        trainers: dict[str, str],
        trainer_logs: dict[str, tuple[Path, int] | tuple[Path, int, frozenset[Any]]],
        metrics_path: Path,
        *,
        num_steps: int,
        poll_interval_s: float = 1.0,
        status_every_s: float = 5.0,
        name: str = "run",
        out: TextIO = sys.stderr,
        tensorboard: Path | None = None,
        plot: Path | None = None,
        live: bool | None = None,
        evals: EvalLog | None = None,
        max_dropped_in_a_row: int = 0,
        max_refused_in_a_row: int = 0,
        max_load_failures_in_a_row: int = 0,
        resumed: bool = False,
        batch_groups: dict[str, int] | None = None,
        on_stall: Callable[[str], None] | None = None,
        progress_warn_s: float = 300.0,
        max_idle_s: float = 0.0,
    ) -> None:
        super().__init__(dataflow, trainers, name=name, num_steps=num_steps)
        self.progress = ProgressWatch(
            trainers, warn_after_s=progress_warn_s, fail_after_s=max_idle_s, num_steps=num_steps
        )
        self.max_dropped_in_a_row, self.on_stall = max_dropped_in_a_row, on_stall
        self.max_refused_in_a_row = max_refused_in_a_row
        self.max_load_failures_in_a_row = max_load_failures_in_a_row
        # Per policy, the run of drops that does not count against this run: 0 in a new run;
        # in a resumed one (Dataflow keeps the run of drops durably, and the resume's overrides
        # may have fixed its cause) what the first poll finds.
        self._resumed = resumed
        self._drops_before: dict[str, int] = {}
        self.batch_groups = batch_groups or {}
        self._short_since: dict[str, tuple[int, float]] = {}  # policy -> (step, since): no batch
        self.metrics_path, self.out = metrics_path, out
        self.poll_interval_s, self.status_every_s = poll_interval_s, status_every_s
        self.history = {p: StepHistory() for p in trainers}  # in the order of `trainers`
        if resumed:  # summary.json covers the whole run: the earlier starts' steps first
            with _failing_output("metrics.jsonl, read back"):
                load_histories(metrics_path, self.history)
        # policy -> [log path, offset read up to, partial last line, the file's first bytes,
        # the first bytes of the generation before it while it is still empty (else b""),
        # until the first look the ids of the copies there were when the trainer started
        # (astra.run.logrotate.copy_ids; given, or those there are now), then None]
        self.logs: dict[str, list[Any]] = {
            p: [w[0], w[1], b"", b"", b"", w[2] if len(w) > 2 else copy_ids(w[0])]
            for p, w in trainer_logs.items()
        }
        # step lines not yet rows: policy, step, version, loss, skipped, logged accuracy
        self.pending: list[tuple[str, int, int, float, str, float | None]] = []
        self.tty = out.isatty()
        self._last_print = 0.0
        self.plot_path = plot
        self.evals = evals
        self.tensorboard: TensorBoardSink | None = None
        if tensorboard is not None:
            from astra.run.tboard import TensorBoardSink

            self.tensorboard = TensorBoardSink(tensorboard)
        self.live: LiveView | None = None
        if self.tty if live is None else live:
            with _failing_output("the live view"):
                from astra.run.view import LiveView

                self.live = LiveView(out)

    def read_logs(self) -> None:
        """Reads the trainers' new per-step log lines (rows once the next poll has been seen)."""
        for policy, entry in self.logs.items():
            path, offset, partial, head, _, known = entry
            if not path.exists():
                continue
            if known is not None:  # the first look: rotated since the trainer started?
                first = missed_since_start(path, offset, known)
                if first is None:
                    continue  # a copy is being made: look again next time
                if first[1]:  # it was: the copies first, then the file from its top
                    partial, offset, entry[4] = first[0], 0, first[1]
                entry[5] = None
            with path.open("rb") as f:
                size = f.seek(0, os.SEEK_END)
                # Truncated (astra.run.logrotate), and maybe written past `offset` again since,
                # which its first bytes tell: what came after `offset` before it is in the
                # copy, unless that is gone too.
                if size < offset or (head and os.pread(f.fileno(), len(head), 0) != head):
                    missed = missed_before_truncation(path, offset, head)
                    # Without the copy, lines were lost: a half line read before is no start
                    # of what comes now.
                    partial = b"" if missed is None else partial + missed
                    offset, entry[3] = 0, b""  # a new file: its own first bytes, below
                    entry[4] = head  # what it follows, while it has no first bytes to tell
                elif not head and entry[4] and size:
                    # The file was empty when last seen: it may have been written and rotated
                    # since (fast writers, a child's own rotation). The generations after the
                    # one it follows that are copies already come first, whole.
                    missed = missed_after(path, entry[4])
                    partial = b"" if missed is None else partial + missed
                if size:
                    entry[4] = b""
                if len(entry[3]) < HEAD_BYTES:  # until it is whole: the same file, read on
                    entry[3] = os.pread(f.fileno(), HEAD_BYTES, 0)
                head = entry[3]
                f.seek(offset)
                chunk = f.read()
                if head and os.pread(f.fileno(), len(head), 0) != head:
                    # Truncated while it was read (a child's own rotation, under Ray): what was
                    # read may be the new file's. Read nothing now; the next call takes the
                    # rest of this generation from its copy.
                    entry[1], entry[2] = offset, partial
                    continue
                data = partial + chunk
                entry[1] = offset + len(chunk)
            *lines, entry[2] = data.split(b"\n")
            for line in lines:
                if m := STEP_LINE.search(line):
                    step, version, loss, skipped, acc = m.groups()
                    self.pending.append(
                        (
                            policy,
                            int(step),
                            int(version),
                            _number(loss),  # "None": a refused batch's step logs no loss
                            skipped.decode(),
                            None if acc is None else _number(acc),
                        )
                    )
                    self.progress.stepped(policy)

    def set_trainer(self, policy: str, address: str) -> None:
        super().set_trainer(policy, address)
        self.progress.stepped(policy)  # restarted: its wait for a step starts now

    def flush(self) -> None:
        """Writes the pending steps as rows, with the trainer figures a poll saw for that step."""
        pending, self.pending = self.pending, []
        for item in pending:  # a row that fails to write is not tried again
            self._record(*item)

    def _record(
        self,
        policy: str,
        step: int,
        version: int,
        loss: float,
        skipped: str,
        logged_accuracy: float | None = None,
    ) -> None:
        status = self.trainer_status.get(policy, {})
        metrics = status.get("metrics") if status.get("step") == step else None
        accuracy = (
            next((metrics[k] for k in ACCURACY_KEYS if k in metrics), None) if metrics else None
        )
        if accuracy is None and logged_accuracy is not None and math.isfinite(logged_accuracy):
            accuracy = logged_accuracy  # the step's own line: no poll saw that step
        row = {
            "time": round(time.time(), 3),
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "policy": policy,
            "step": step,
            "version": version,
            "loss": loss if math.isfinite(loss) else None,  # NaN is not JSON
            "skipped": skipped or None,
            "accuracy": accuracy,
            "trainer": metrics,
            "dataflow": self.last_dataflow,
        }
        if self.history[policy].add(step, accuracy):  # a restarted trainer runs again
            row["rerun"] = True  # from its checkpoint: the later steps are dropped
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tensorboard is not None:
            with _failing_output("TensorBoard event files") as failed:
                self.tensorboard.write_row(row)
            if failed:
                self.tensorboard = None

    def record_evals(self) -> None:
        """The evaluations finished since the last poll, into evals.jsonl and TensorBoard."""
        if self.evals is not None:
            with _failing_output("evals.jsonl"):
                self.evals.update(self.last_evals, self.tensorboard)

    async def run(self) -> None:
        """Polls until cancelled."""
        tick, failures = 0, 0
        while True:
            try:
                if tick % 4 == 0:
                    await self.poll_dataflow()
                    self.record_evals()
                    why = (
                        self.refused()
                        or self.loads_failing()
                        or self.stalled()
                        or self.exhausted()
                        or self.progress.check(
                            self.trainer_status,
                            self.last_dataflow,
                            self.error,
                            refusal=refusal(self.last_detail),
                        )
                    )
                    if self.on_stall is not None and why is not None:
                        log.error("%s", why)
                        self.on_stall(why)
                        self.on_stall = None  # said once; the run is ending
                # Lines first, then the poll: the poll sees at least the last step read (its
                # line is written once the step's figures are in), and that step's row gets
                # them unless the trainer stepped again in between.
                self.read_logs()
                await asyncio.gather(*(self.poll_trainer(p) for p in self.trainers))
                self.flush()
                self.print_status()
            except (Exception, asyncio.CancelledError) as exc:
                task = asyncio.current_task()
                if isinstance(exc, asyncio.CancelledError) and (task is None or task.cancelling()):
                    raise  # this task itself is cancelled: the run is ending
                failures += 1  # observing must not end the run: the next tick tries again
                if failures == 1 or failures % 100 == 0:
                    log.warning("observer tick failed (%d so far)", failures, exc_info=True)
            tick += 1
            await asyncio.sleep(self.poll_interval_s / 4)

    def refused(self) -> str | None:
        """Why the run cannot go on: every active RaaS refused the groups Dataflow sent it
        (say, a reward it cannot import) max_refused_in_a_row times in a row, accepting none."""
        limit = self.max_refused_in_a_row
        active = [i for i in self.last_detail.get("instances") or [] if i.get("state") == "ACTIVE"]
        if not limit or not active or any(i.get("refused_in_a_row", 0) < limit for i in active):
            return None
        return (
            f"failed: every RaaS refuses the groups it is sent ({', '.join(i['id'] for i in active)}"
            f", {limit} submits in a row or more; the newest: {refusal(self.last_detail)}) "
            f"(supervision.max_refused_in_a_row: {limit})"
        )

    def loads_failing(self) -> str | None:
        """Why the run cannot go on: every active RaaS failed to load the new weights
        max_load_failures_in_a_row times in a row (Dataflow's `weight_load_failing.<id>`
        counters), say a version refused as VERSION_BAD: with the version barrier nothing is
        generated, and the trainer waits for a batch."""
        limit = self.max_load_failures_in_a_row
        counters = self.last_dataflow.get("counters") or {}
        active = [
            i["id"] for i in self.last_detail.get("instances") or [] if i.get("state") == "ACTIVE"
        ]
        failing = {i: counters.get(f"weight_load_failing.{i}", 0) for i in active}
        if not limit or not active or any(n < limit for n in failing.values()):
            return None
        reason = str(self.last_dataflow.get("gate_reason", ""))
        why = reason.partition("weight loads failing on ")[2] or reason
        return (
            f"failed: every RaaS fails to load the new weights ({why[:600]}) "
            f"(supervision.max_load_failures_in_a_row: {limit})"
        )

    def stalled(self) -> str | None:
        """Why the run cannot go on: a policy's run of dropped groups reached the bound (in a
        resumed run: grew by it since the resume) and its buffer holds less than a batch (a
        full buffer can still serve batches)."""
        limit = self.max_dropped_in_a_row
        for policy, d in sorted((self.last_detail.get("policies") or {}).items()):
            n = d.get("dropped_in_a_row", 0)
            floor = self._drops_before.setdefault(policy, n if self._resumed else 0)
            if n < floor:  # a group was kept since: a new run of drops
                floor = self._drops_before[policy] = 0
            grown = n - floor
            if limit and grown >= limit and d.get("buffered", 0) < self.batch_groups.get(policy, 1):
                return (
                    f"stalled: policy {policy}: the last {n} finished groups were all dropped "
                    f"(the newest: {d.get('last_drop') or 'unknown'}), so no batch can form "
                    f"(supervision.max_dropped_in_a_row: {limit})"
                )
        return None

    def exhausted(self) -> str | None:
        """Why the run cannot go on: its training data is used up (every training stream ran
        its num_epochs, no group in flight) and a policy whose trainer has steps left holds
        less than a batch, none of it leased (a leased batch may still be trained)."""
        if not str(self.last_dataflow.get("gate_reason", "")).startswith(DATA_EXHAUSTED):
            self._short_since.clear()
            return None
        now = time.monotonic()
        for policy, d in sorted((self.last_detail.get("policies") or {}).items()):
            t = self.trainer_status.get(policy)
            if t is None or (self.num_steps and t.get("step", 0) >= self.num_steps):
                continue  # not heard from yet, or done
            need = self.batch_groups.get(policy, 1)
            if d.get("buffered", 0) >= need or d.get("leased", 0):
                self._short_since.pop(policy, None)
                continue
            # Held for a few polls at the same step: a trainer that just took its last step
            # (its status polled a moment before Dataflow's) is not taken as stuck.
            step, since = self._short_since.setdefault(policy, (t.get("step", 0), now))
            if step != t.get("step", 0):
                self._short_since[policy] = (t.get("step", 0), now)
                continue
            if now - since >= max(2.0, 3 * self.poll_interval_s):
                return (
                    f"stalled: {DATA_EXHAUSTED}: every training stream ran its num_epochs; "
                    f"policy {policy} is at step {t.get('step', 0)} of {self.num_steps} with "
                    f"{d.get('buffered', 0)} groups buffered, less than a batch of {need} "
                    "(raise dataset.num_epochs or lower trainer.num_steps)"
                )
        return None

    def status_line(self) -> str:
        elapsed = time.monotonic() - self.started
        parts = [f"{self.name} {elapsed:6.0f}s"]
        for policy, s in sorted(self.trainer_status.items()):
            acc = next((s["metrics"][k] for k in ACCURACY_KEYS if k in s["metrics"]), None)
            acc_s = "-" if acc is None else f"{acc:.2f}"
            parts.append(
                f"{policy} step {s['step']}/{self.num_steps} v{s['version']} "
                f"loss {s['loss']:.4g} acc {acc_s}"
            )
        d = self.last_dataflow
        if d:
            c = d["counters"]
            parts.append(f"gate {d['gate']} stale {d['staleness']:.2f}")
            parts.append(f"buf {sum(d['buffered'].values())} fill {d['buffer_fill']:.2f}")
            parts.append(
                f"raas {d['raas_active']}/{len(d['raas_states'])} inflight {d['in_flight']}"
            )
            parts.append(
                f"groups disp {c.get('dispatched', 0)} done {c.get('groups_done', 0)} "
                f"trained {c.get('consumed_groups', 0)}"
            )
            if (rate := self.throughput.rate("groups")) is not None:
                parts.append(f"{rate:.2f} groups/s")
        done = [e for e in self.last_evals if e["complete"]]
        if self.evals is not None:  # the evaluation summary.json leads with, where several run
            lead = self.evals.lead()
            done = [e for e in done if (e["stream"], e["policy_id"]) == lead] or done
        if done:
            parts.append(f"eval v{done[-1]['version']} {done[-1]['mean_reward']:.2f}")
        return " | ".join(parts)

    def print_status(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.live is not None:
            if force or now - self._last_print >= min(1.0, self.poll_interval_s / 2):
                self._last_print = now
                with _failing_output("the live view") as failed:
                    self.live.update(self.snapshot())
                if failed:
                    self._stop_live()
            return
        if self.tty:
            self.out.write("\r\x1b[2K" + self.status_line()[:250])
            self.out.flush()
        elif force or now - self._last_print >= self.status_every_s:
            self._last_print = now
            print(self.status_line(), file=self.out, flush=True)

    def _stop_live(self) -> None:
        live, self.live = self.live, None
        if live is not None:
            with _failing_output("the live view"):
                live.stop()

    def end_line(self) -> None:
        if self.live is not None:
            self._stop_live()
        elif self.tty:
            self.out.write("\n")
            self.out.flush()

    async def close(self) -> None:
        self._stop_live()
        await super().close()

    async def finish(self) -> None:
        """After the last row: closes the event files, draws metrics.jsonl to the plot."""
        if self.tensorboard is not None:
            with _failing_output("TensorBoard event files"):
                self.tensorboard.close()
        if self.plot_path is not None and self.metrics_path.is_file():
            from astra.run.plot import write_plot

            with _failing_output("plot.png"):
                await asyncio.to_thread(
                    write_plot, self.metrics_path, self.plot_path, title=self.name
                )


class _Failed:
    def __init__(self) -> None:
        self.failed = False

    def __bool__(self) -> bool:
        return self.failed


@contextlib.contextmanager
def _failing_output(what: str) -> Iterator[_Failed]:
    """An output of the observer that fails is logged and must not stop the run."""
    result = _Failed()
    try:
        yield result
    except Exception:
        result.failed = True
        log.warning("%s failed; the run goes on without it", what, exc_info=True)


def refusal(detail: dict[str, Any]) -> str:
    """The newest refusal of a RaaS still refusing, as `<id>: <reason>`; empty when none."""
    for i in detail.get("instances") or []:
        if i.get("refused_in_a_row") and i.get("last_refusal"):
            return f"{i['id']}: {i['last_refusal']}"
    return ""


def _number(text: bytes) -> float:
    """A figure of a step line; NaN (null in metrics.jsonl) for what is no number."""
    try:
        return float(text)
    except ValueError:
        return math.nan
