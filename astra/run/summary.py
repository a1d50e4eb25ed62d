"""summary.json: the figures of a finished (or stopped) run, and how each is computed.

Sources, read after every child has stopped:
- Dataflow's last GetStatus (taken after the trainers and the RaaS stopped): the
  run-level counters (durable across restarts) and each policy's current version.
- Dataflow's SQLite state (read-only): the work table (one row per group ever pulled:
  pending / leased / done, with its dispatch attempts) and the batches table (the
  group keys of every batch a trainer acknowledged; the newest 4096 are kept).
- What the observer kept of its metrics rows (trainer GetStatus per step): each policy's
  last step and its per-step accuracies (astra.run.history).
- The trainers' own last log line ("trainer stopped at step N").
`learned` reads the written summary back for the run's last line.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astra.dataflow import row_seals
from astra.dataflow.sealed import unseal
from astra.dataflow.store_schema import batch_groups
from astra.durable import write_durably

if TYPE_CHECKING:
    from astra.run.history import StepHistory

_STOPPED = re.compile(rb"trainer stopped at step (\d+), version (\d+)")
WINDOW = 10


def read_state(state_dir: Path) -> dict[str, Any]:
    """Dispatch and batch figures from Dataflow's SQLite file, opened read-only."""
    path = state_dir / "dataflow.sqlite"
    if not path.is_file():
        return {}
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        # From schema 8 every row is sealed: figures are counted only from rows that check
        # (a damaged one raises astra.damage.Damaged naming the file, table and row).
        if any(c[1] == "seal" for c in conn.execute("PRAGMA table_info(work)")):
            row_seals.verify_all(conn, path)
        # Counted by SQLite: the work table holds a row per group the run ever pulled.
        dispatched = dict(
            conn.execute(
                "SELECT state = 'done', COUNT(*) FROM work WHERE attempts >= 1 OR state = 'done' "
                "GROUP BY state = 'done'"
            ).fetchall()
        )
        try:  # the epochs folded into counts (astra.dataflow.folding): all done
            (folded,) = conn.execute("SELECT COALESCE(SUM(done), 0) FROM folded_work").fetchone()
        except sqlite3.OperationalError:  # a state directory of before schema 4
            folded = 0
        dispatched[1] = dispatched.get(1, 0) + folded
        row = conn.execute("SELECT value FROM kv WHERE key = 'counters'").fetchone()
        persisted = unseal(path, "counters", row[0]) if row is not None else {}
        try:
            batches = conn.execute(
                "SELECT batch_id, policy_id, policy_version, state, groups, untrained_reason"
                " FROM batches"
            ).fetchall()
        except sqlite3.OperationalError:  # a state directory of before schema 5
            batches = [
                (*r, "")
                for r in conn.execute(
                    "SELECT batch_id, policy_id, policy_version, state, groups FROM batches"
                )
            ]
    finally:
        conn.close()
    acked: Counter[tuple[str, str]] = Counter()
    trained: Counter[str] = Counter()
    discarded: Counter[str] = Counter()
    for batch_id, policy_id, version, state, groups, reason in batches:
        if state == "acked":
            # Entries are [group_id, replay] or, from schema 2, [group_id, replay, advantages];
            # sealed from schema 7 (a damaged row raises, never counted wrong).
            entries = batch_groups(batch_id, policy_id, version, groups)
            keys = [(policy_id, k[0]) for k in entries if not k[1]]
            acked.update(keys)
            if reason:
                discarded[reason.lower()] += len(keys)
            else:
                trained[policy_id] += len(keys)
    return {
        "dispatched": sum(dispatched.values()),
        "with_outcome": dispatched.get(1, 0),
        "unfinished": dispatched.get(0, 0),
        "acked_batches": sum(1 for b in batches if b[3] == "acked"),
        "trained_keys": sum(trained.values()),
        "trained_per_policy": dict(sorted(trained.items())),
        "discarded_keys": dict(sorted(discarded.items())),
        "duplicated": sum(n - 1 for n in acked.values() if n > 1),
        "counters": persisted if isinstance(persisted, dict) else {},
    }


def trainer_final_step(log_path: Path) -> int | None:
    """The step a trainer reported when it stopped (its last log line of that form)."""
    if not log_path.is_file():
        return None
    found = _STOPPED.findall(log_path.read_bytes()[-65536:])
    return int(found[-1][0]) if found else None


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _per_key(counters: dict[str, int], prefix: str) -> dict[str, int]:
    """Counters `<prefix>.<key>` by key."""
    return {k.split(".", 1)[1]: n for k, n in counters.items() if k.startswith(prefix + ".")}


def _trained_per_policy(state: dict[str, Any], counters: dict[str, int]) -> dict | None:
    """Fresh groups in each policy's trainer's weights: Dataflow counters
    `trained_groups.<policy>` less `discarded_groups.<policy>` (the steps a trainer restart
    lost); for a state directory from before them, the trained batches still in its table."""
    trained, discarded = (
        _per_key(counters, "trained_groups"),
        _per_key(counters, "discarded_groups"),
    )
    counted = {p: n - discarded.get(p, 0) for p, n in trained.items()}
    return dict(sorted(counted.items())) if counted else state.get("trained_per_policy")


def groups_discarded(counters: dict[str, int]) -> dict[str, int]:
    """Acknowledged fresh groups not in the trainers' weights, by reason (Dataflow counters
    `groups_discarded.<reason>`)."""
    return dict(sorted(_per_key(counters, "groups_discarded").items()))


SEGMENT_KEYS: tuple[str, ...] = ("status", "wall_seconds", "first_step", "steps")
SEGMENT_KEYS += ("accuracy_first10", "accuracy_last10")


def segments_before(previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The segments (one per start that wrote a summary) of the summary a resumed run found:
    its own list, or the summary itself as one segment (a failure summary: its `previous`
    first)."""
    if not isinstance(previous, dict) or not previous:
        return []
    if isinstance(previous.get("segments"), list):
        return list(previous["segments"])
    earlier = segments_before(previous.get("previous"))
    return [*earlier, {k: previous.get(k) for k in SEGMENT_KEYS}]


def this_segment(
    status: str, wall_seconds: float, history: dict[str, StepHistory], steps: int
) -> dict[str, Any]:
    """This start's part of the run: its steps and its accuracies only."""
    first = [a for h in history.values() for a in h.segment_accuracies()[:WINDOW]][:WINDOW]
    last = [a for h in history.values() for a in h.segment_accuracies()[-WINDOW:]][-WINDOW:]
    starts = [h.segment_first_step for h in history.values() if h.segment_first_step is not None]
    return {
        "status": status,
        "wall_seconds": round(wall_seconds, 2),
        "first_step": min(starts, default=None),
        "steps": steps,
        "accuracy_first10": _mean(first),
        "accuracy_last10": _mean(last),
    }


def build_summary(
    *,
    status: str,
    wall_seconds: float,
    dataflow: dict[str, Any],
    state: dict[str, Any],
    history: dict[str, StepHistory],
    final_steps: dict[str, int | None],
    baseline: dict[str, Any],
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    counters: dict[str, int] = dict(dataflow.get("counters", {}))
    # Dataflow's counters as it last wrote them (at its stop) may be newer than its last view
    # (taken before the RaaS stopped, or an older one when it was restarting then), while the
    # work table is read at the end: each counter only grows, so the larger of the two is the
    # later. Otherwise outcomes that came after the view would count as lost groups.
    for key, value in (state.get("counters") or {}).items():
        if isinstance(value, int) and value > counters.get(key, 0):
            counters[key] = value
    outcomes = sum(counters.get(k, 0) for k in ("completed_groups", "failed_groups"))
    outcomes += counters.get("malformed_results", 0) + counters.get("eval_groups", 0)
    # A group whose stored rollout was quarantined is dispatched again: its second outcome is
    # no new group; one that could not be dispatched again was never trained, so it is lost.
    outcomes -= counters.get("records_corrupt_redispatched", 0)
    outcomes -= counters.get("records_corrupt_lost", 0)
    policies = [*history, *(p for p in final_steps if p not in history)]
    steps = {
        p: max(final_steps.get(p) or 0, (h.last_step if (h := history.get(p)) else 0) or 0)
        for p in policies
    }
    # Over all policies, in the order of `history`: the first policy's accuracies come first.
    # A policy's first (last) WINDOW hold every one of its values among the first (last)
    # WINDOW of them all.
    first = [a for h in history.values() for a in h.first_accuracies(WINDOW)][:WINDOW]
    last = [a for h in history.values() for a in h.last_accuracies(WINDOW)][-WINDOW:]
    observed = sum(h.accuracy_steps for h in history.values())
    lost = None
    if state:
        lost = state["dispatched"] - outcomes - state["unfinished"]
    notes = []
    if not observed:
        notes.append(
            "accuracy_first10/last10 are null: the trainers report no per-step reward "
            "('accuracy' or 'reward_mean' in TrainerService GetStatus metrics)"
        )
    segments = [
        *segments_before(previous),
        this_segment(status, wall_seconds, history, min(steps.values(), default=0)),
    ]
    return {
        "status": status,
        "steps": min(steps.values(), default=0),
        "steps_per_policy": steps,
        "groups_trained_per_policy": _trained_per_policy(state, counters),
        "accuracy_per_policy": {
            p: {
                "first10": _mean(h.first_accuracies(WINDOW)),
                "last10": _mean(h.last_accuracies(WINDOW)),
            }
            for p, h in sorted(history.items())
        },
        "wall_seconds": round(wall_seconds, 2),
        "wall_seconds_total": round(sum(g.get("wall_seconds") or 0 for g in segments), 2),
        "segments": segments,
        "accuracy_first10": _mean(first),
        "accuracy_last10": _mean(last),
        "accuracy_steps_observed": observed,
        "random_baseline_accuracy": baseline.get("accuracy"),
        "random_baseline": baseline,
        "groups_dispatched": state.get("dispatched"),
        "groups_trained": counters.get("consumed_groups", 0)
        - counters.get("untrained_groups", 0)
        - counters.get("groups_discarded.trainer_restart", 0),
        "groups_untrained": counters.get("untrained_groups", 0),
        "groups_discarded": groups_discarded(counters),
        "groups_lost": lost,
        "groups_duplicated": state.get("duplicated"),
        "groups_unfinished_at_end": state.get("unfinished"),
        "groups_with_outcome": outcomes,
        "versions_published": sum(dataflow.get("versions", {}).values()),
        "versions_per_policy": dataflow.get("versions", {}),
        "counters": {
            k: counters.get(k, 0)
            for k in (
                "dispatched",
                "redispatched",
                "completed_groups",
                "failed_groups",
                "malformed_results",
                "eval_groups",
                "duplicates_dropped",
                "consumed_groups",
                "consumed_trajectories",
                "untrained_groups",
                "groups_untrained_at_resume",
                "batch_leases_expired",
                "leases_expired",
                "instances_confirmed_dead",
                "versions_announced",
            )
        },
        "how": {
            "steps": "each trainer's last step (its per-step and final log lines); the least "
            "over policies",
            "accuracy_first10": "mean of the per-step 'accuracy' (or 'reward_mean') trainer "
            "metric over the first 10 observed steps (all policies) of the whole run: a "
            "resumed run reads its earlier starts' steps back from metrics.jsonl",
            "wall_seconds": "this start's; wall_seconds_total: the sum over segments",
            "segments": "one per start that wrote a summary (a start whose supervisor was "
            "killed wrote none), oldest first; each with its own steps' accuracies, "
            "first_step the first step it recorded and steps the last",
            "accuracy_last10": "the same over the last 10 observed steps",
            "random_baseline_accuracy": baseline.get("method", ""),
            "groups_dispatched": "distinct groups handed to a RaaS at least once (work table)",
            "groups_trained": "Dataflow counters consumed_groups - untrained_groups - "
            "groups_discarded.trainer_restart: fresh groups of the acknowledged batches whose "
            "steps are in the trainers' weights (each such step was published)",
            "groups_untrained": "Dataflow counter untrained_groups: groups in batches the trainer "
            "acknowledged without a step (refused, non-finite loss; AckBatch untrained_reason)",
            "groups_discarded": "Dataflow counters groups_discarded.<reason>: acknowledged fresh "
            "groups not in the trainers' weights, by reason: trainer_restart (a step taken "
            "after the checkpoint a restarted trainer continued from), or the AckBatch "
            "untrained_reason in lower case; groups_trained + the sum = consumed_groups",
            "groups_trained_per_policy": "Dataflow counters trained_groups.<policy> - "
            "discarded_groups.<policy>: groups_trained of each policy",
            "accuracy_per_policy": "accuracy_first10/last10 over each policy's own steps",
            "groups_lost": "groups_dispatched - outcomes counted (completed + failed + malformed "
            "+ eval_groups counters, less the groups whose stored rollout was quarantined: "
            "records_corrupt_redispatched and records_corrupt_lost) - dispatched groups still "
            "pending or leased at the end (kept durably, dispatched again on --resume)",
            "groups_duplicated": "non-replay (policy, group) keys found in more than one "
            "acknowledged batch (batches table), counted once per extra batch",
            "versions_published": "sum over policies of the last version announced to Dataflow "
            "(version 0, the initial weights, not counted)",
        },
        "notes": notes,
    }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    write_durably(path, json.dumps(summary, indent=2, sort_keys=False) + "\n")


def write_failure_summary(path: Path, status: str, wall_seconds: float) -> None:
    """What a run whose own ending failed can still say: its status and how long it ran, no
    figure it did not measure. A summary of the run written before (a resumed run's) is
    kept under `previous`."""
    previous: dict[str, Any] | None = None
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        previous = None
    summary: dict[str, Any] = {"status": status, "wall_seconds": round(wall_seconds, 1)}
    summary["note"] = "the supervisor failed while ending the run: figures were not taken"
    if previous is not None:
        summary["previous"] = previous
    write_summary(path, summary)


def learned(path: Path) -> str:
    """What the run learned, for its last line: training accuracy over the first and last
    ten steps, and the held-out score before and after (from summary.json at `path`)."""
    try:
        s = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    parts = []
    first, last = s.get("accuracy_first10"), s.get("accuracy_last10")
    if first is not None and last is not None:
        parts.append(f"accuracy {first:.2f} -> {last:.2f}")
    results = (s.get("eval") or {}).get("results") or []
    if results and results[0].get("mean_reward") is not None and s["eval"].get("last") is not None:
        parts.append(f"held-out {results[0]['mean_reward']:.2f} -> {s['eval']['last']:.2f}")
    return f": {', '.join(parts)}" if parts else ""
