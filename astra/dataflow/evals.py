"""Evaluation streams: a held-out dataset run in full at every N-th version, scored, never trained.

A stream with `eval_every_versions: N` (N > 0) is an evaluation stream. When
its first policy's current version reaches a multiple of N (version 0
included) that has not been evaluated yet, every record of its dataset
becomes one group with the id `<stream>/<version>/<index>` (the version takes
the place of the epoch), dispatched like any work (leases, re-dispatch,
de-duplication by id) but only to instances that hold at least that version.
The results go to tallies here instead of a buffer, one per policy of the
stream (a multi-agent group scores each agent's samples): per version, groups
and samples seen, failed samples, mean reward, the share of groups with a
sample at reward >= 1 (`solved`), and the range of token versions that
produced them. Versions passed over while an evaluation runs are skipped (counted),
so evaluation never falls behind training. The tallies and the evaluated
versions are part of Dataflow's durable state (`state`/`restore`, written in
the transaction that takes each result), so a restart neither loses nor
counts a result twice. No gRPC here.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from astra.dataflow.records import TrajectoryRecord

KEEP_RESULTS = 64  # finished evaluations per stream kept in the status (all are in the store)


@dataclass(slots=True)
class Tally:
    """One evaluation (stream, version): what its results so far add up to."""

    stream: str
    policy_id: str
    version: int
    groups: int
    groups_done: int = 0
    samples: int = 0
    failed_samples: int = 0
    reward_sum: float = 0.0
    solved_groups: int = 0
    min_token_version: int = -1
    max_token_version: int = -1
    started: float = field(default_factory=time.time)
    completed: float = 0.0

    @property
    def complete(self) -> bool:
        return self.groups_done >= self.groups

    def add(self, trajectories: list[TrajectoryRecord]) -> None:
        self.groups_done += 1
        scored = [t for t in trajectories if not t.failed]
        self.failed_samples += len(trajectories) - len(scored)
        self.samples += len(scored)
        self.reward_sum += sum(t.reward for t in scored)
        self.solved_groups += any(t.reward >= 1.0 for t in scored)
        versions = [t.min_version for t in scored if t.min_version >= 0]
        versions += [t.max_version for t in scored if t.max_version >= 0]
        if versions:
            lo, hi = min(versions), max(versions)
            old = self.min_token_version
            self.min_token_version = lo if old < 0 else min(old, lo)
            self.max_token_version = max(self.max_token_version, hi)
        if self.complete:
            self.completed = time.time()

    def result(self) -> dict[str, Any]:
        """Shaped like astra.dataflow.v1.EvalResult (snake_case)."""
        return {
            "stream": self.stream,
            "policy_id": self.policy_id,
            "version": self.version,
            "groups": self.groups,
            "groups_done": self.groups_done,
            "samples": self.samples,
            "failed_samples": self.failed_samples,
            "mean_reward": self.reward_sum / self.samples if self.samples else 0.0,
            "solved_groups": self.solved_groups,
            "min_token_version": self.min_token_version,
            "max_token_version": self.max_token_version,
            "complete": self.complete,
        }


class EvalDesk:
    """The evaluation streams of one Dataflow: when each is due, and what it found."""

    def __init__(self, every: dict[str, int], policies_of: dict[str, list[str]]) -> None:
        """policies_of: stream -> its policies, the first the one whose versions it follows."""
        self.every = {s: n for s, n in every.items() if n > 0}
        self.policies_of = {s: list(p) for s, p in policies_of.items()}
        self.last: dict[str, int] = {}  # stream -> newest version scheduled
        # (stream, version) -> policy -> its tally; the tallies of one evaluation advance
        # together (every group result counts once for each policy).
        self.running: dict[tuple[str, int], dict[str, Tally]] = {}
        self.finished: dict[str, list[Tally]] = {s: [] for s in self.every}
        self.skipped = 0
        # Saved state of streams this configuration does not evaluate, kept as is.
        self._unconfigured: dict[str, Any] = {"last": {}, "running": [], "finished": {}}

    def is_eval(self, stream: str) -> bool:
        return stream in self.every

    def due(self, stream: str, current: int) -> int | None:
        """The version to evaluate now for `stream`, if any: the newest multiple of N at or
        below `current` not yet scheduled, once the stream's previous evaluation is done."""
        n = self.every[stream]
        target = current // n * n
        last = self.last.get(stream)
        if last is not None and target <= last:
            return None
        if any(s == stream for s, _ in self.running):
            return None  # one at a time: what is passed over meanwhile is skipped
        return target

    def schedule(self, stream: str, version: int, groups: int) -> None:
        last = self.last.get(stream)
        if last is not None:
            self.skipped += max(0, (version - last) // self.every[stream] - 1)
        self.last[stream] = version
        tallies = {p: Tally(stream, p, version, groups) for p in self.policies_of[stream]}
        if groups == 0:  # nothing to run (every group already done): finished at once
            for tally in tallies.values():
                self._finish(tally)
        else:
            self.running[(stream, version)] = tallies

    def floor(self, stream: str) -> int | None:
        """The version an instance must hold to run the stream's pending groups."""
        versions = [v for s, v in self.running if s == stream]
        return min(versions) if versions else None

    def take(self, stream: str, epoch: int, per_policy: dict[str, list[TrajectoryRecord]]) -> str:
        """Counts one group's results, each policy's samples in its tally (a policy without
        any: a group done with no sample); returns the group's outcome for the work table."""
        tallies = self.running.get((stream, epoch))
        if tallies is None:  # its evaluation is unknown (should not happen: ids carry it)
            return "eval: unknown evaluation"
        for policy_id, tally in tallies.items():
            tally.add(per_policy.get(policy_id, []))
        if all(t.complete for t in tallies.values()):
            del self.running[(stream, epoch)]
            for tally in tallies.values():
                self._finish(tally)
        return f"eval:{epoch}"

    def _finish(self, tally: Tally) -> None:
        tally.completed = tally.completed or time.time()
        done = self.finished[tally.stream]
        done.append(tally)
        del done[: -KEEP_RESULTS * len(self.policies_of.get(tally.stream, [1]))]

    def results(self) -> list[dict[str, Any]]:
        """Finished evaluations (the newest KEEP_RESULTS per stream, a result per policy),
        then those still running."""
        done = [t.result() for s in sorted(self.finished) for t in self.finished[s]]
        return done + [t.result() for ts in self.running.values() for t in ts.values()]

    def state(self) -> dict[str, Any]:
        other = self._unconfigured
        running = [asdict(t) for ts in self.running.values() for t in ts.values()]
        finished = {s: [asdict(t) for t in ts] for s, ts in self.finished.items()}
        return {
            "last": other["last"] | self.last,
            "running": other["running"] + running,
            "finished": other["finished"] | finished,
            "skipped": self.skipped,
        }

    def restore(self, state: dict[str, Any]) -> None:
        last = state.get("last", {})
        self.last = {s: v for s, v in last.items() if s in self.every}
        self._unconfigured = {
            "last": {s: v for s, v in last.items() if s not in self.every},
            "running": [r for r in state.get("running", []) if r["stream"] not in self.every],
            "finished": {
                s: ts for s, ts in state.get("finished", {}).items() if s not in self.every
            },
        }
        for raw in state.get("running", []):
            if raw["stream"] in self.every:
                t = Tally(**raw)
                self.running.setdefault((t.stream, t.version), {})[t.policy_id] = t
        # A state written before per-policy tallies has the first policy's only: the others
        # start from the groups it had done (their earlier samples were never kept).
        for (stream, version), tallies in self.running.items():
            first = next(iter(tallies.values()))
            for p in self.policies_of.get(stream, []):
                if p not in tallies:
                    tallies[p] = Tally(stream, p, version, first.groups, first.groups_done)
        for s, ts in state.get("finished", {}).items():
            if s in self.every:
                self.finished[s] = [Tally(**raw) for raw in ts]
        self.skipped = int(state.get("skipped", 0))
