"""Prometheus metrics of Dataflow, read from its status at scrape time.

A collector on a private registry (astra.metrics: several Dataflows can live in
one process, as in tests) and an HTTP endpoint on `metrics_port`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from astra.metrics import Metrics


class StatusCollector(Collector):
    def __init__(self, status: Callable[[], dict]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        s = self._status()
        counters = CounterMetricFamily(
            "astra_dataflow_events", "Monotonic event counters of Dataflow", labels=["event"]
        )
        for name, value in sorted(s["counters"].items()):
            counters.add_metric([name], value)
        yield counters
        buffered = GaugeMetricFamily(
            "astra_dataflow_buffered_groups", "Groups in the buffer", labels=["policy"]
        )
        version = GaugeMetricFamily(
            "astra_dataflow_policy_version", "Current policy version", labels=["policy"]
        )
        leased = GaugeMetricFamily(
            "astra_dataflow_leased_groups", "Groups leased to trainers", labels=["policy"]
        )
        for p in s["policies"]:
            buffered.add_metric([p["policy_id"]], p["buffered_groups"])
            version.add_metric([p["policy_id"]], p["current_version"])
            leased.add_metric([p["policy_id"]], p["leased_groups"])
        yield from (buffered, version, leased)
        instances = GaugeMetricFamily(
            "astra_dataflow_instances", "RaaS instances by state", labels=["state"]
        )
        by_state: dict[str, int] = {}
        for i in s["instances"]:
            by_state[i["state"]] = by_state.get(i["state"], 0) + 1
        for state, n in sorted(by_state.items()):
            instances.add_metric([state], n)
        yield instances
        gate = s["gate"]
        mode = GaugeMetricFamily(
            "astra_dataflow_gate_mode", "1 for the current mode", labels=["mode"]
        )
        for m in ("GATE_MODE_ASYNC_RUNNING", "GATE_MODE_SYNC_BARRIER", "GATE_MODE_THROTTLED"):
            mode.add_metric([m], 1.0 if gate["mode"] == m else 0.0)
        yield mode
        yield GaugeMetricFamily(
            "astra_dataflow_staleness", "Smoothed staleness score", value=gate["staleness"]
        )
        yield GaugeMetricFamily(
            "astra_dataflow_in_flight_groups",
            "Groups dispatched, not received",
            value=gate["in_flight_groups"],
        )
        storage = s["storage"]
        yield GaugeMetricFamily(
            "astra_dataflow_storage_free_bytes",
            "Free bytes on the state directory's file system at the last check",
            value=storage["free_bytes"],
        )
        yield GaugeMetricFamily(
            "astra_dataflow_storage_paused",
            "1 while dispatch and ingest pause for lack of disk space",
            value=1.0 if storage["paused"] else 0.0,
        )


def serve_metrics(status: Callable[[], dict], host: str, port: int) -> tuple[Metrics, int]:
    """Starts the HTTP endpoint; returns (its Metrics, with shutdown(); bound port)."""
    metrics = Metrics(StatusCollector(status).collect)
    return metrics, metrics.serve(host, port)
