"""Prometheus endpoints: scraped over real HTTP on loopback, figures match the service."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from astra.metrics import Metrics, counter, gauge
from astra.servers.trainer import _train
from astra.servers.trainer_serve import start_trainer
from astra.tls_certs import init_ca, issue
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
            assert phases == {"fetch", "compute", "publish_blocked", "host_copy"}
            last = {s.labels["metric"]: s.value for s in samples["astra_trainer_last_step"]}
            assert "loss" in last and "grad_norm" in last
            assert samples["astra_trainer_published_bytes_total"][0].value > 0
            assert samples["astra_trainer_paused"][0].value == 0
        finally:
            metrics.shutdown()
            await trainer.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_raas_metrics_follow_groups_and_weight_loads():
    from astra.clients.raas import RolloutClient
    from astra.common.v1 import rollout_pb2, version_pb2
    from astra.raas.engine_backend import EngineBackend
    from astra.raas.metrics import RaasMetrics
    from astra.raas.v1 import rollout_service_pb2 as rpb
    from astra.servers.raas_serve import start_raas
    from tests.test_engine_backend import FakeLoader
    from tests.test_workflows import ScriptedTestEngine

    async def body() -> None:
        engine = ScriptedTestEngine(lambda *a: "2", ("policy",))
        backend = EngineBackend(engine, ["single_turn"], FakeLoader())
        server, servicer, _ = await start_raas(backend, capacity=8, grace_s=0.2)
        metrics = servicer.metrics = RaasMetrics(servicer)
        port = metrics.serve("127.0.0.1", 0)
        client = RolloutClient(server.address, timeout_s=5.0)
        try:
            group = rollout_pb2.PromptGroup(
                group_id="g1",
                workflow="single_turn",
                policy_ids=["policy"],
                prompt=rollout_pb2.Prompt(text="1+1="),
                num_samples=2,
                sampling_params=rollout_pb2.SamplingParams(max_new_tokens=4),
            )
            await client.submit_groups([group])
            for _ in range(100):
                if servicer.store.pending:
                    break
                await asyncio.sleep(0.05)
            await client.stub.LoadWeights(
                rpb.LoadWeightsRequest(
                    request_id="load-1",
                    weights_address="127.0.0.1:1",
                    versions=[version_pb2.PolicyVersion(policy_id="policy", version=3)],
                ),
                timeout=5,
            )
            samples = await asyncio.to_thread(scrape, port)
            done = samples["astra_raas_group_seconds_count"]
            assert [(s.labels, s.value) for s in done] == [
                ({"workflow": "single_turn", "outcome": "ok"}, 1.0)
            ]
            assert samples["astra_raas_capacity"][0].value == 8
            assert samples["astra_raas_pending_results"][0].value == 1
            version = samples["astra_raas_policy_version"][0]
            assert version.labels == {"policy": "policy"} and version.value == 3
            assert samples["astra_raas_weight_load_seconds_count"][0].value == 1
            assert samples["astra_raas_weight_load_bytes_sum"][0].value == 100
        finally:
            metrics.shutdown()
            await client.close()
            await server.stop(0)
            await servicer.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_weight_service_metrics_follow_publishes_and_fetches(tmp_path):
    from astra.clients.weights_stream import Receiver, publish_version
    from astra.servers.weights_serve import start_weights
    from astra.weights.metrics import WeightMetrics
    from astra.weights.store import StoreConfig
    from tests.test_weights_store import chain_of

    models = chain_of(3, seed=5)

    async def body() -> None:
        store = StoreConfig(durable=False, full_every=2)
        server = await start_weights(tmp_path / "store", config=store)
        metrics = server.servicer.metrics = WeightMetrics(server.servicer)
        port = metrics.serve("127.0.0.1", 0)
        try:
            receiver = Receiver(server.address, "p", tmp_path / "rx", durable=False)
            for i, model in enumerate(models):
                await publish_version(server.address, "p", f"v{i}", i, model)
                await receiver.fetch()
            samples = await asyncio.to_thread(scrape, port)
            assert samples["astra_weights_head_version"][0].value == 2
            assert samples["astra_weights_versions_stored"][0].value == 3
            assert samples["astra_weights_receivers"][0].value == 1
            assert samples["astra_weights_active_fetches"][0].value == 0
            streams = {
                (s.labels["kind"], s.labels["outcome"]): s.value
                for s in samples["astra_weights_stream_seconds_count"]
            }
            assert streams == {("publish", "ok"): 3, ("fetch", "ok"): 3}
            events = {s.labels["event"]: s.value for s in samples["astra_weights_events_total"]}
            assert events["versions_published"] == 3 and events["fetch_bytes_sent"] > 0
        finally:
            metrics.shutdown()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_metrics_are_https_with_client_certificates_under_mutual_tls(tmp_path, monkeypatch):
    """The run's TLS covers /metrics too: plain HTTP and a client without a certificate of the
    run's CA get nothing; a scraper holding one reads the figures."""
    ca = tmp_path / "tls"
    init_ca(ca)
    issue(ca, ca, ["127.0.0.1"])
    stranger = tmp_path / "stranger"
    init_ca(stranger)
    issue(stranger, stranger, ["127.0.0.1"])
    monkeypatch.setenv("ASTRA_TLS_DIR", str(ca))
    metrics = Metrics(lambda: [gauge("astra_test_ok", "fine", 1.0)])
    port = metrics.serve("127.0.0.1", 0)
    url = f"https://127.0.0.1:{port}/metrics"

    def get(client=None) -> bytes:
        ctx = ssl.create_default_context(cafile=str(ca / "ca.pem"))
        if client is not None:
            ctx.load_cert_chain(str(client / "cert.pem"), str(client / "key.pem"))
        with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
            return resp.read()

    import socket
    import time

    try:
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)  # connects, says nothing
        started = time.monotonic()
        assert b"astra_test_ok 1.0" in get(ca)  # not held up by the silent one
        assert time.monotonic() - started < 5
        silent.close()
        for who in (None, stranger):  # no certificate; another CA's
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError, OSError)):
                get(who)
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            scrape(port)  # plain HTTP
        assert b"astra_test_ok 1.0" in get(ca)  # still serving
    finally:
        metrics.shutdown()


def test_metrics_over_tls_take_renewed_certificates_without_a_restart(tmp_path, monkeypatch):
    import socket

    from cryptography import x509

    from astra import tls

    ca = tmp_path / "tls"
    init_ca(ca)
    issue(ca, ca, ["127.0.0.1"])
    monkeypatch.setenv("ASTRA_TLS_DIR", str(ca))
    monkeypatch.setattr(tls, "RECHECK_S", 0.0)
    metrics = Metrics(lambda: [gauge("astra_test_ok", "fine", 1.0)])
    port = metrics.serve("127.0.0.1", 0)

    def shown_serial() -> int:
        ctx = ssl.create_default_context(cafile=str(ca / "ca.pem"))
        ctx.load_cert_chain(str(ca / "cert.pem"), str(ca / "key.pem"))
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
            ctx.wrap_socket(sock, server_hostname="127.0.0.1") as conn,
        ):
            der = conn.getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number

    def serial_on_disk() -> int:
        return x509.load_pem_x509_certificate((ca / "cert.pem").read_bytes()).serial_number

    try:
        first = shown_serial()
        assert first == serial_on_disk()
        issue(ca, ca, ["127.0.0.1"])  # renewed in place
        assert shown_serial() == serial_on_disk() != first
    finally:
        metrics.shutdown()
