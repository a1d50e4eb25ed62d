"""Prometheus figures of a RaaS: slots, groups, versions in service, rollout latency, weight sync.

Read from the RolloutService servicer's state at scrape time (capacity, free
slots, running and pending groups, versions held, event counters) plus
histograms the servicer observes: seconds per group (submit to result: the
rollout latency), seconds and bytes per weight load.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from astra.metrics import LATENCY_BUCKETS, Metrics, counter, gauge

BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 41, 3))  # 1 KiB .. 1 TiB


class RaasMetrics(Metrics):
    def __init__(self, servicer: Any) -> None:
        super().__init__(self._snapshot)
        self.servicer = servicer
        self.group_seconds = self.histogram(
            "astra_raas_group_seconds",
            "Rollout latency: seconds from accepting a group to its result (failed included)",
            LATENCY_BUCKETS,
            labels=["workflow", "outcome"],
        )
        self.load_seconds = self.histogram(
            "astra_raas_weight_load_seconds",
            "Seconds per LoadWeights that fetched something (fetch, verify, swap)",
            LATENCY_BUCKETS,
        )
        self.load_bytes = self.histogram(
            "astra_raas_weight_load_bytes", "Bytes received per weight load", BYTES_BUCKETS
        )

    def observe_group(self, workflow: str, seconds: float, failed: bool) -> None:
        self.group_seconds.labels(workflow, "failed" if failed else "ok").observe(seconds)

    def observe_load(self, seconds: float, fetched_bytes: int) -> None:
        if fetched_bytes:
            self.load_seconds.observe(seconds)
            self.load_bytes.observe(fetched_bytes)

    def _snapshot(self) -> Iterator[Metric]:
        s = self.servicer
        store = s.store
        yield gauge("astra_raas_capacity", "Samples this RaaS runs at once", s.capacity)
        yield gauge("astra_raas_free_slots", "Samples it can still accept", store.free_slots)
        yield gauge("astra_raas_running_groups", "Groups being generated", store.running)
        yield gauge(
            "astra_raas_pending_results", "Finished groups not acknowledged yet", store.pending
        )
        versions = s.loaded_versions
        yield gauge("astra_raas_policy_version", "Version in service", versions, "policy")
        yield counter(
            "astra_raas_events", "RaaS event counters", {**store.counters, **s.counters}, "event"
        )
