"""Prometheus figures of a trainer (rank 0): step, version, step time, publishing, last step.

Read from `Trainer.get_statistics()` at scrape time, plus a step-time
histogram observed after every step (`observe_step`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from astra.metrics import LATENCY_BUCKETS, Metrics, counter, gauge

if TYPE_CHECKING:
    from astra.trainer.loop import StepResult, Trainer


class TrainerMetrics(Metrics):
    def __init__(self, trainer: Trainer) -> None:
        super().__init__(self._snapshot)
        self.trainer = trainer
        self.step_seconds = self.histogram(
            "astra_trainer_step_seconds",
            "Wall time of a training iteration (fetch, compute, acknowledge, host copy)",
            LATENCY_BUCKETS,
        )
        self.phase_seconds = self.histogram(
            "astra_trainer_phase_seconds",
            "Seconds per iteration by phase (fetch, compute, publish_blocked; host_copy is "
            "the part of publish_blocked spent copying the new weights to host memory)",
            LATENCY_BUCKETS,
            labels=["phase"],
        )

    def observe_step(self, result: StepResult) -> None:
        self.step_seconds.observe(result.elapsed_ms / 1e3)
        for phase in ("fetch", "compute", "publish_blocked", "host_copy"):
            ms = result.metrics.get(f"{phase}_ms")
            if ms is not None:
                self.phase_seconds.labels(phase).observe(float(ms) / 1e3)

    def _snapshot(self) -> Iterator[Metric]:
        t = self.trainer
        stats = t.get_statistics()
        policy = stats["policy_id"]
        yield gauge(
            "astra_trainer_step", "Optimiser steps taken", {policy: stats["step"]}, "policy"
        )
        yield gauge(
            "astra_trainer_version", "Version of the weights", {policy: stats["version"]}, "policy"
        )
        yield gauge(
            "astra_trainer_paused", "1 while paused (TrainerService.Pause)", float(t.paused)
        )
        yield gauge(
            "astra_trainer_publish_blocked_fraction",
            "Fraction of step time spent waiting on weight publishing",
            stats["publish_blocked_fraction"],
        )
        yield counter("astra_trainer_events", "Trainer event counters", stats["counters"], "event")
        yield counter(
            "astra_trainer_seconds", "Seconds spent, by phase", stats["timings_s"], "phase"
        )
        last = {k: v for k, v in stats["last_step"].items() if math.isfinite(float(v))}
        yield gauge("astra_trainer_last_step", "Figures of the last step", last, "metric")
        publisher = stats.get("publisher")
        if publisher:
            yield counter(
                "astra_trainer_published_bytes",
                "Bytes of weights handed to the WeightService",
                publisher["bytes_published"],
            )
            yield counter(
                "astra_trainer_publish_seconds",
                "Seconds spent publishing (background)",
                publisher["publish_s"],
            )
            yield gauge(
                "astra_trainer_last_published_version",
                "Newest version the WeightService holds",
                publisher["last_published"],
            )
