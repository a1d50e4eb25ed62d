"""Prometheus figures of a WeightService: versions, receivers, streams, bytes sent.

Read from the store and the servicer at scrape time (the newest version and the
number of versions per policy, registered receivers, active fetches, the
store's counters: versions published, fetch plans full or delta, tensors and
bytes sent, fetches completed, composed deltas, collected versions), plus a
histogram of seconds per publish and per fetch stream by outcome, observed by
the servicer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from astra.metrics import LATENCY_BUCKETS, Metrics, counter, gauge


class WeightMetrics(Metrics):
    def __init__(self, servicer: Any) -> None:
        super().__init__(self._snapshot)
        self.servicer = servicer
        self.stream_seconds = self.histogram(
            "astra_weights_stream_seconds",
            "Seconds per PublishVersion / FetchVersion stream, by outcome",
            LATENCY_BUCKETS,
            labels=["kind", "outcome"],
        )

    def observe_stream(self, kind: str, seconds: float, outcome: str) -> None:
        self.stream_seconds.labels(kind, outcome).observe(seconds)

    def _snapshot(self) -> Iterator[Metric]:
        store = self.servicer.store
        heads, stored = {}, {}
        for policy in store.policies():
            head = store.chain(policy).head
            if head is not None:
                heads[policy] = head.version
            stored[policy] = len(store.list_versions(policy))
        yield gauge("astra_weights_head_version", "Newest version", heads, "policy")
        yield gauge("astra_weights_versions_stored", "Versions in the store", stored, "policy")
        receivers = {p: len(r) for p, r in store.receivers.snapshot().items()}
        yield gauge("astra_weights_receivers", "Registered receivers", receivers, "policy")
        yield gauge(
            "astra_weights_active_fetches", "Fetch streams open", self.servicer.active_fetches
        )
        yield counter(
            "astra_weights_events", "WeightService counters", dict(store.counters), "event"
        )
