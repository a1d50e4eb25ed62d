"""Prometheus endpoints of the services: a private registry per server, read at scrape time.

Each service describes its figures as a `Snapshot` (a callable returning metric
families, built from its own status) plus, where a distribution matters,
prometheus_client histograms on the same private registry (so several servers
can live in one process, as in tests). `serve_metrics` starts the HTTP endpoint
(`/metrics`) on its own thread; scrapes never block the service's event loop
for longer than building one snapshot.

Helpers turn plain values into families: `gauge`, `counter` (name, help, value or
{label value: value}).

With the process's mutual TLS on (astra.tls), /metrics is HTTPS and asks for a client
certificate of the run's CA too, like every gRPC port: scrape it with Prometheus's
`tls_config` (ca_file, cert_file, key_file). Its files are read again once renewed (astra.tls);
each connection's handshake runs on that connection's own thread, with a timeout. A client
whose certificate the CA's revocation list names is closed on after the handshake.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
Snapshot = Callable[[], Iterable[Metric]]


class SnapshotCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._snapshot()
        except Exception:  # a scrape must never take the service down
            log.exception("metrics snapshot failed")


def _family(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    doc: str,
    value: float | Mapping[str, float],
    label: str,
) -> Metric:
    if isinstance(value, Mapping):
        family = kind(name, doc, labels=[label])
        for key, v in sorted(value.items()):
            family.add_metric([str(key)], float(v))
        return family
    return kind(name, doc, value=float(value))


def gauge(name: str, doc: str, value: float | Mapping[str, float], label: str = "name") -> Metric:
    return _family(GaugeMetricFamily, name, doc, value, label)


def counter(name: str, doc: str, value: float | Mapping[str, float], label: str = "name") -> Metric:
    return _family(CounterMetricFamily, name, doc, value, label)


class Metrics:
    """A private registry: one snapshot collector plus any histograms the service observes."""

    def __init__(self, snapshot: Snapshot | None = None) -> None:
        self.registry = CollectorRegistry()
        if snapshot is not None:
            self.registry.register(SnapshotCollector(snapshot))
        self._server: object | None = None
        self.port: int | None = None

    def also(self, snapshot: Snapshot) -> None:
        """Adds another snapshot to this registry (the server's own figures, beside the
        service's: astra.servers.authz's refused calls)."""
        self.registry.register(SnapshotCollector(snapshot))

    def histogram(
        self, name: str, doc: str, buckets: Iterable[float], labels: Iterable[str] = ()
    ) -> Histogram:
        return Histogram(name, doc, list(labels), registry=self.registry, buckets=list(buckets))

    def serve(self, host: str, port: int) -> int:
        """Starts /metrics on (host, port) (0 picks a port); returns the bound port. HTTPS
        with client certificates required when this process runs with mutual TLS."""
        from astra.tls import current_tls
        from astra.tls_material import tls_paths

        if current_tls() is None:  # checked: a wrong setting fails here, naming the file
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        else:
            paths = tls_paths()
            assert paths is not None
            server = _https_server(host, port, self.registry, paths)
            log.info("/metrics on %s:%d over mutual TLS", host, server.server_port)
        self._server, self.port = server, server.server_port
        return server.server_port

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server = None


HANDSHAKE_TIMEOUT_S = 10.0  # a client that connects and says nothing holds only its own thread


def _https_server(host: str, port: int, registry: CollectorRegistry, paths: Mapping[str, Any]):
    """/metrics over mutual TLS on its own thread. The handshake runs in each connection's
    thread with a timeout, not in the accepting one (where prometheus_client's own TLS does
    it), so a client that connects and sends nothing cannot stop the scrapes of others."""
    import ssl
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from astra.tls import tls_files

    def context() -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(paths["cert"]), str(paths["key"]))
        ctx.load_verify_locations(cafile=str(paths["ca"]))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    files = tls_files()
    lock = threading.Lock()
    state: dict[str, Any] = {"ctx": context(), "from": files.material if files else None}

    def current() -> ssl.SSLContext:
        """The context of the files now: made again once they were renewed (astra.tls)."""
        now = files.refresh() if files is not None else None
        with lock:
            if now is not None and now is not state["from"]:
                try:
                    state["ctx"] = context()
                except (ssl.SSLError, OSError) as exc:  # changed again meanwhile: next time
                    log.warning("/metrics: renewed TLS files not loaded yet: %s", exc)
                else:
                    state["from"] = now
            return state["ctx"]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # scrapes are not worth a log line each

    def _revoked(conn: ssl.SSLSocket) -> bool:
        material = files.material if files is not None else None
        if material is None or not material.revoked:
            return False
        from cryptography import x509

        der = conn.getpeercert(binary_form=True)
        return der is not None and x509.load_der_x509_certificate(der).serial_number in (
            material.revoked
        )

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def finish_request(self, request, client_address) -> None:  # the connection's thread
            request.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                conn = current().wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                return  # no certificate of the run's CA, plaintext, or silence: refused
            if _revoked(conn):  # listed by the CA's revocation list (astra.tls_crl)
                conn.close()
                return
            try:
                Handler(conn, client_address, self)
            except OSError:
                pass
            finally:
                conn.close()

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-https", daemon=True).start()
    return server


# Seconds: from sub-millisecond (tiny models, control RPCs) to minutes (long rollouts).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
