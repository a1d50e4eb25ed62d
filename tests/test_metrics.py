"""Prometheus endpoints: scraped over real HTTP on loopback, figures match the service."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from astra.metrics import Metrics, counter, gauge
from astra.servers.trainer import _train, start_trainer
from astra.trainer.config import TrainerConfig
from astra.trainer.metrics import TrainerMetrics
from astra.trainer.synthetic import MemorySink, SyntheticSource


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_a_failing_snapshot_does_not_break_the_scrape_of_the_rest():
    def broken():
        yield gauge("astra_test_ok", "fine", 1.0)
        raise RuntimeError("boom")

    metrics = Metrics(broken)
    hist = metrics.histogram("astra_test_seconds", "h", (0.1, 1.0))
    hist.observe(0.5)
    port = metrics.serve("127.0.0.1", 0)
    try:
        samples = scrape(port)
        assert samples["astra_test_ok"][0].value == 1.0
        assert samples["astra_test_seconds_count"][0].value == 1.0
    finally:
        metrics.shutdown()


def test_labelled_families():
    fam = counter("astra_x", "x", {"b": 2, "a": 1}, "event")
    assert [(s.labels["event"], s.value) for s in fam.samples] == [("a", 1.0), ("b", 2.0)]


def test_trainer_metrics_follow_the_steps():
    async def body() -> None:
        cfg = TrainerConfig.model_validate(
            {"policy_id": "p", "port": None, "batch": {"num_groups": 2}}
        )
        source = SyntheticSource("p", vocab_size=100)
        _, trainer = await start_trainer(cfg, source=source, sink=MemorySink(), grace_s=0)
        metrics = TrainerMetrics(trainer)
        port = metrics.serve("127.0.0.1", 0)
        try:
            await _train(trainer, 3, metrics)
            samples = await asyncio.to_thread(scrape, port)
            assert samples["astra_trainer_step"][0].value == 3
            assert samples["astra_trainer_step"][0].labels == {"policy": "p"}
            assert samples["astra_trainer_step_seconds_count"][0].value == 3
            phases = {s.labels["phase"] for s in samples["astra_trainer_phase_seconds_count"]}
            assert phases == {"fetch", "compute", "publish_blocked"}
            last = {s.labels["metric"]: s.value for s in samples["astra_trainer_last_step"]}
            assert "loss" in last and "grad_norm" in last
            assert samples["astra_trainer_published_bytes_total"][0].value > 0
            assert samples["astra_trainer_paused"][0].value == 0
        finally:
            metrics.shutdown()
            await trainer.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))
