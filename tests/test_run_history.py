"""astra.run.history: what the observer keeps of its rows gives summary.json the figures that
every row would, through reruns of any depth, in a few bytes per step."""

from __future__ import annotations

import asyncio
import io
import json
import random
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from astra.run.elastic import Elastic
from astra.run.history import StepHistory
from astra.run.observe import Observer
from astra.run.summary import WINDOW, _mean, build_summary

POLICIES = ("b", "a")  # not sorted: the figures over all policies follow this order
ROW_FIGURES = (
    "steps",
    "steps_per_policy",
    "accuracy_per_policy",
    "accuracy_first10",
    "accuracy_last10",
    "accuracy_steps_observed",
    "notes",
)


def figures_of_every_row(rows: dict[str, list[dict]], final_steps: dict) -> dict[str, Any]:
    """The row figures of summary.json as computed when the observer kept every row."""
    steps = {
        p: max(final_steps.get(p) or 0, max((r["step"] for r in rs), default=0))
        for p, rs in rows.items()
    }
    accuracy = [r["accuracy"] for rs in rows.values() for r in rs if r["accuracy"] is not None]
    per_policy = {
        p: [r["accuracy"] for r in rs if r["accuracy"] is not None] for p, rs in rows.items()
    }
    return {
        "steps": min(steps.values(), default=0),
        "steps_per_policy": steps,
        "accuracy_per_policy": {
            p: {"first10": _mean(a[:WINDOW]), "last10": _mean(a[-WINDOW:])}
            for p, a in sorted(per_policy.items())
        },
        "accuracy_first10": _mean(accuracy[:WINDOW]),
        "accuracy_last10": _mean(accuracy[-WINDOW:]),
        "accuracy_steps_observed": len(accuracy),
        "notes": [] if accuracy else ["no accuracy"],
    }


def summary_figures(obs: Observer, final_steps: dict) -> dict[str, Any]:
    s = build_summary(
        status="completed",
        wall_seconds=1.0,
        dataflow={},
        state={},
        history=obs.history,
        final_steps=final_steps,
        baseline={},
    )
    got = {k: s[k] for k in ROW_FIGURES}
    got["notes"] = ["no accuracy"] if any("accuracy_first10" in n for n in s["notes"]) else []
    return got


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Equal as summary.json writes them: the same keys in the same order, the same floats."""
    return json.dumps(got) == json.dumps(want)


def make_observer(tmp_path: Path) -> Observer:
    return Observer(
        "127.0.0.1:1",
        {p: "127.0.0.1:1" for p in POLICIES},
        {p: (tmp_path / f"trainer-{p}.log", 0) for p in POLICIES},
        tmp_path / "metrics.jsonl",
        num_steps=10,
        out=io.StringIO(),
        live=False,
    )


def log_step(obs: Observer, tmp_path: Path, policy: str, step: int, accuracy: float | None):
    """One step line of the policy's trainer, seen by a poll with its accuracy (or none)."""
    with (tmp_path / f"trainer-{policy}.log").open("a") as f:
        f.write(f"x INFO astra.servers.trainer: step {step} version {step} loss 0.5\n")
    metrics = {"grad_norm": 1.0 + step / 7, "total_ms": 100.0 + step}
    if accuracy is not None:
        metrics["accuracy" if step % 2 else "reward_mean"] = accuracy
    obs.trainer_status[policy] = {"step": step, "version": step, "loss": 0.5, "metrics": metrics}
    obs.read_logs()
    obs.flush()


def test_the_summary_figures_are_those_of_every_row_through_reruns(tmp_path: Path) -> None:
    """Thousands of steps over two policies, some without an accuracy, with reruns from one
    step back to the very first step; after every rerun and every few steps the figures
    equal those of the rows metrics.jsonl holds (kept in full here, as the observer did)."""
    rng = random.Random(7)
    final_steps = {"a": None, "b": 3}

    async def go() -> int:
        obs = make_observer(tmp_path)
        rows: dict[str, list[dict]] = {p: [] for p in POLICIES}
        assert same(summary_figures(obs, final_steps), figures_of_every_row(rows, final_steps))
        checks = 0
        with (tmp_path / "metrics.jsonl").open("a+") as metrics:
            metrics.seek(0)
            for i in range(3000):
                policy = rng.choice(POLICIES)
                last = rows[policy][-1]["step"] if rows[policy] else 0
                rerun = last > 0 and rng.random() < 0.02
                if rerun:
                    step = rng.choice(
                        [1, last, last - 1, max(1, last - rng.randint(2, 30)), last // 2]
                    )
                else:
                    step = last + (2 if rng.random() < 0.05 else 1)  # a step without a line
                rate = 0.8 if policy == "a" else 0.15
                accuracy = round(rng.random(), 6) if rng.random() < rate else None
                log_step(obs, tmp_path, policy, step, accuracy)

                row = json.loads(metrics.readline())
                assert (row["step"], row["accuracy"]) == (step, accuracy)
                kept = rows[policy]
                assert row.get("rerun", False) == bool(kept and kept[-1]["step"] >= step)
                while kept and kept[-1]["step"] >= step:
                    kept.pop()
                kept.append(row)
                if rerun or i % 25 == 0 or i < 40:
                    want = figures_of_every_row(rows, final_steps)
                    assert same(summary_figures(obs, final_steps), want), (i, policy, step)
                    checks += 1
            assert metrics.readline() == ""  # every row went to metrics.jsonl
        assert same(summary_figures(obs, final_steps), figures_of_every_row(rows, final_steps))
        for p in POLICIES:
            assert obs.history[p].last_step == rows[p][-1]["step"]
        await obs.close()
        return checks

    assert asyncio.run(go()) > 150


def test_a_rerun_drops_the_step_it_runs_again_and_every_later_one() -> None:
    def acc(s: int) -> float | None:
        return 0.1 * s if s % 3 else None  # every third step without an accuracy

    h = StepHistory()
    assert not any(h.add(s, acc(s)) for s in range(1, 2001))
    assert h.last_step == 2000 and h.accuracy_steps == 2000 - 666
    # Back past every step a window of the newest rows would hold: the ones before it remain.
    before = [acc(s) for s in (1, 2, 4, 5, 7, 8, 10, 11)]
    assert h.add(12, None)
    assert h.last_step == 12 and h.accuracy_steps == 8
    assert h.first_accuracies(WINDOW) == h.last_accuracies(WINDOW) == before
    assert h.add(11, 0.5)  # 11 had an accuracy: the old one goes, the new one comes
    assert h.last_accuracies(3) == [*before[-3:-1], 0.5] and h.accuracy_steps == 8
    assert h.add(11, None) and h.last_accuracies(2) == before[-3:-1] and h.accuracy_steps == 7
    assert h.add(3, 0.25) and h.last_accuracies(WINDOW) == [*before[:2], 0.25]
    assert h.add(1, None) and h.accuracy_steps == 0 and h.last_accuracies(WINDOW) == []
    assert not h.add(2, 0.75) and h.last_step == 2 and h.first_accuracies(1) == [0.75]


def test_the_observer_keeps_a_few_bytes_per_step_not_the_rows(tmp_path: Path) -> None:
    """A row is ~1 KB with its trainer figures; what stays in memory per step is ~16 bytes."""

    async def go() -> int:
        obs = make_observer(tmp_path)
        for step in range(1, 201):  # files open, caches warm
            log_step(obs, tmp_path, "a", step, 0.5)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for step in range(201, 3201):
                log_step(obs, tmp_path, "a", step, step / 4000)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        await obs.close()
        return grown

    grown = asyncio.run(go())
    assert grown < 3000 * 64, f"{grown / 3000:.0f} bytes per step"


def test_the_elastic_schedule_reads_each_policy_s_last_step() -> None:
    """The last step recorded (after a rerun: the step run again), or Dataflow's version where
    that is further; the least over policies."""
    history = {"a": StepHistory(), "b": StepHistory()}
    for step in (1, 2, 3, 4, 5, 6, 7, 3):
        history["a"].add(step, None)
    observer = SimpleNamespace(history=history, last_dataflow={"versions": {"a": 2, "b": 5}})
    policies = [SimpleNamespace(id=p) for p in ("a", "b")]
    sup = SimpleNamespace(observer=observer, recipe=SimpleNamespace(policies=policies))
    assert Elastic(sup).step() == 3  # a at 3 (not 7), b at version 5
    history["a"].add(9, 0.5)
    assert Elastic(sup).step() == 5
    observer.last_dataflow = {}
    assert Elastic(sup).step() == 0  # b took no step
    sup.recipe.policies = [SimpleNamespace(id="a"), SimpleNamespace(id="c")]
    assert Elastic(sup).step() == 0  # no such policy in the history
    sup.recipe.policies = policies[:1]
    assert Elastic(sup).step() == 9


def test_groups_the_trainer_took_no_step_on_are_not_counted_trained() -> None:
    counters = {
        "consumed_groups": 10,
        "untrained_groups": 4,
        "untrained_groups.a": 3,
        "untrained_groups.b": 1,
        "trained_groups.b": 2,
        "trained_groups.a": 4,
    }
    state = {"dispatched": 10, "unfinished": 0, "trained_per_policy": {"a": 7, "b": 3}}

    def summary() -> dict:
        return build_summary(
            status="completed",
            wall_seconds=1.0,
            dataflow={"counters": counters},
            state=state,
            history={},
            final_steps={},
            baseline={},
        )

    s = summary()
    assert s["groups_trained"] == 6 and s["groups_untrained"] == 4
    assert s["groups_trained_per_policy"] == {"a": 4, "b": 2}
    del counters["trained_groups.a"], counters["trained_groups.b"]  # an older state directory
    assert summary()["groups_trained_per_policy"] == {"a": 7, "b": 3}
    assert s["counters"]["consumed_groups"] == 10 and s["counters"]["untrained_groups"] == 4


def test_a_quarantined_group_dispatched_again_is_neither_lost_nor_counted_twice() -> None:
    """Dataflow quarantined a group's stored rollout and dispatched it again: it completed
    twice (two outcomes for one work row); one that could not be dispatched again is lost."""

    def lost(**counters: int) -> int | None:
        state = {"dispatched": 10, "unfinished": 0, "duplicated": 0, "acked_batches": 1}
        base = {"completed_groups": 11, "failed_groups": 0}
        return build_summary(
            status="completed",
            wall_seconds=1.0,
            dataflow={"counters": {**base, **counters}},
            state=state,
            history={},
            final_steps={},
            baseline={},
        )["groups_lost"]

    assert lost(records_corrupt_redispatched=1) == 0
    assert lost(completed_groups=10, records_corrupt_lost=1) == 1


def test_a_resumed_runs_figures_cover_every_start_and_each_start_has_its_segment(
    tmp_path: Path,
) -> None:
    """Three starts on one metrics.jsonl (each resumed one reads the rows back), with reruns
    across a start's border: the whole-run figures are those of every row; each segment's are
    those of its own start's steps; the segments chain through the summaries written."""
    rng = random.Random(11)
    rows: dict[str, list[dict]] = {p: [] for p in POLICIES}
    previous: dict | None = None

    async def start(index: int, n: int) -> dict:
        obs = Observer(
            "127.0.0.1:1",
            {p: "127.0.0.1:1" for p in POLICIES},
            {p: (tmp_path / f"trainer-{p}-{index}.log", 0) for p in POLICIES},
            tmp_path / "metrics.jsonl",
            num_steps=10,
            out=io.StringIO(),
            live=False,
            resumed=index > 0,
        )
        mine: dict[str, list[float]] = {p: [] for p in POLICIES}
        for i in range(n):
            policy = rng.choice(POLICIES)
            last = rows[policy][-1]["step"] if rows[policy] else 0
            step = max(1, last - 3) if (i == 0 and last) else last + 1  # a resume reruns
            accuracy = round(rng.random(), 6) if rng.random() < 0.7 else None
            with (tmp_path / f"trainer-{policy}-{index}.log").open("a") as f:
                f.write(f"x INFO astra.servers.trainer: step {step} version {step} loss 0.5\n")
            metrics = {} if accuracy is None else {"accuracy": accuracy}
            obs.trainer_status[policy] = {"step": step, "version": step, "loss": 0.5,
                                          "metrics": metrics}  # fmt: skip
            obs.read_logs()
            obs.flush()
            while rows[policy] and rows[policy][-1]["step"] >= step:
                rows[policy].pop()
            rows[policy].append({"step": step, "accuracy": accuracy})
            if accuracy is not None:
                mine[policy].append(accuracy)
        s = build_summary(
            status=f"start {index}", wall_seconds=10.0 + index, dataflow={}, state={},
            history=obs.history, final_steps={}, baseline={}, previous=previous,
        )  # fmt: skip
        await obs.close()
        want = figures_of_every_row(rows, {})
        assert s["accuracy_first10"] == want["accuracy_first10"]
        assert s["accuracy_last10"] == want["accuracy_last10"]
        assert s["accuracy_steps_observed"] == want["accuracy_steps_observed"]
        seg = s["segments"][-1]
        ordered = [a for p in obs.history for a in mine[p][:WINDOW]][:WINDOW]
        assert seg["status"] == f"start {index}" and seg["accuracy_first10"] == _mean(ordered)
        return s

    for index, n in enumerate((60, 40, 30)):
        previous = asyncio.run(start(index, n))
        assert [g["status"] for g in previous["segments"]] == [
            f"start {i}" for i in range(index + 1)
        ]
    assert previous["wall_seconds_total"] == 10.0 + 11.0 + 12.0


def test_the_segments_of_a_summary_from_before_them_and_of_a_failure_summary() -> None:
    from astra.run.summary import segments_before

    old = {"status": "stopped: SIGTERM", "wall_seconds": 5.0, "steps": 7, "accuracy_first10": 0.5}
    failed = {"status": "failed: the supervisor", "wall_seconds": 2.0, "previous": old}
    got = segments_before(failed)
    assert [g["status"] for g in got] == ["stopped: SIGTERM", "failed: the supervisor"]
    assert got[0]["steps"] == 7 and got[1]["steps"] is None
    assert segments_before({"segments": got, "status": "x"}) == got
    assert segments_before(None) == [] and segments_before([1]) == []  # type: ignore[arg-type]
