"""A RaaS in another language joins Astra: tools/raas-node, JavaScript on @grpc/grpc-js, built
from the .proto files alone (no Astra code), against the real Dataflow and WeightService.

It passes every check of `astra raas check`, LoadWeights and CollectResultBatch included (a
real fetch from a WeightService, Adler-32 verified in JavaScript); Dataflow drains it through
CollectResultBatch, each round's acknowledgements riding on the next call; a fetch broken on the way resumes after the
tensors it verified; in a run with real processes, where one of its instances is SIGKILLed and
Dataflow itself is killed and restarted, every prompt group reaches the trainer exactly once;
SIGTERM deregisters it and exits 0. Under mutual TLS it follows the CA's revocation list as
the Python nodes do: listed callers refused at the call level, listed servers at the handshake.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from astra.clients.raas import RolloutClient
from astra.clients.raas_check import CheckOptions, RaasChecker
from astra.clients.raas_rules import summary
from astra.clients.weights_publish import publish_version
from astra.common.v1 import version_pb2
from astra.dataflow.v1 import dataflow_service_pb2 as df_pb
from astra.raas.registration_record import Recording
from astra.raas.v1 import rollout_service_pb2 as rs_pb
from astra.raas.v1 import rollout_service_pb2_grpc as rs_grpc
from astra.servers.raas_registration_check import start_checking_dataflow
from astra.servers.weights_serve import start_weights
from astra.tls_certs import init_ca, issue
from astra.tls_crl import revoke, serial_of
from astra.weights.store import StoreConfig
from astra.weights.store_fetch import FetchSource
from tests import test_dataflow_invariants as invariants
from tests.conftest import error_info, free_port, make_config, running_dataflow
from tests.procs import Proc, start_dataflow
from tests.test_faults import (
    NUM_PROMPTS,
    Trainer,
    assert_exactly_once,
    big_dataset,  # noqa: F401 (a fixture)
    fault_config,
    run_then_close,
)
from tests.test_tls import run_ca  # noqa: F401 (a fixture)
from tests.test_tls_roles import channel as tls_channel

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "tools" / "raas-node"
LEFT = df_pb.INSTANCE_STATE_LEFT


def _missing() -> str:
    if shutil.which("node") is None:
        return "node is not installed"
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return "tools/raas-node has no node_modules: `make test` installs them (npm ci)"
    return ""


# Skipped where Node.js is missing, never in CI, which installs it (`make test` runs npm ci).
if (why := _missing()) and os.environ.get("CI") == "true":
    raise RuntimeError(f"tests/test_raas_node.py cannot run in CI: {why}")
pytestmark = pytest.mark.skipif(bool(why), reason=why)


def start_node_raas(tmp: Path, name: str, *extra: str, dataflow: str = "") -> Proc:
    args = ["node", str(NODE_DIR / "raas.js"), "--port", "0", "--instance-id", name, *extra]
    if dataflow:
        args += ["--dataflow", dataflow]
    return Proc(args, log=tmp / f"{name}.log")


def test_node_raas_passes_every_contract_check(tmp_path):
    # the checker is also the Dataflow it registers with (astra raas check --as-dataflow)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    node = start_node_raas(
        tmp_path, "node-check", "--capacity", "4", "--delay-ms", "50",
        dataflow=f"127.0.0.1:{port}",
    )  # fmt: skip
    recording = Recording(interval_s=0.5)

    async def body():
        weights = await start_weights(tmp_path / "store", config=StoreConfig(durable=False))
        dataflow = await start_checking_dataflow(recording, port=port)
        try:
            tensors = {
                "w": ("F32", [4096], np.arange(4096, dtype=np.float32).tobytes()),
                "b": ("BF16", [3], bytes(6)),
                "empty": ("F32", [0], b""),
            }
            config = {"config.json": json.dumps({"vocab_size": 256}).encode()}  # raas.js's
            await publish_version(weights.address, "policy", "v3", 3, tensors, config)
            options = replace(
                CheckOptions(result_timeout_s=10.0), weights=weights.address, version_id="v3",
                recording=recording, register_timeout_s=30.0,
            )  # fmt: skip
            results = await RaasChecker(node.address, options).run()
            # The next version, a few elements changed: the store keeps it as a delta, and the
            # JavaScript receiver, naming v3 as held, gets xor+zstd frames to decode against it.
            w = np.arange(4096, dtype=np.float32)
            w[::512] += 1.0
            await publish_version(
                weights.address, "policy", "v4", 4, {**tensors, "w": ("F32", [4096], w.tobytes())}
            )
            async with RolloutClient(node.address, timeout_s=10.0) as client:
                want = version_pb2.PolicyVersion(policy_id="policy", version=4, version_id="v4")
                loaded = await client.load_weights([want], weights.address, "next")
                status = await client.get_status()
            return results, loaded, status
        finally:
            await weights.stop(0)
            await dataflow.stop(0)

    results, loaded, status = run_then_close(asyncio.wait_for(body(), 150), [node])
    report = summary(results)
    failed = {r.name: r.status for r in results if r.status != "pass"}
    # Every check passes but the two that run only with --serve-weights.
    serve_weights_only = ("load_weights_matches_by_identity", "load_weights_refuses_corrupt_data")
    assert failed == dict.fromkeys(serve_weights_only, "skip"), failed
    assert report["pass"] == len(results) - 2
    load = next(r for r in results if r.name == "load_weights")
    assert "16,390 bytes fetched" in load.detail  # 4096 x 4 + 3 x 2 + 0: the whole version
    assert 0 < loaded.fetched_bytes < 1000  # one frame of w's change, not 16,390 bytes
    assert [(v.version, v.version_id) for v in status.loaded_versions] == [(4, "v4")]
    assert "policy@v4 (delta against v3)" in node.log.read_text()


def test_dataflow_drains_a_node_raas_through_collect_result_batch(tmp_path):
    """The JavaScript RaaS serves CollectResultBatch, so Dataflow collects with it (no
    fallback to CollectResults) and acknowledges each round's results on its next call: every
    group of the epoch is trained once, none arrives twice, and the node is left holding
    nothing, every result acknowledged."""
    n = 12
    config = invariants.dataflow_config(tmp_path, n)
    node: Proc | None = None

    async def body():
        nonlocal node
        async with running_dataflow(config) as (server, df, client):
            flags = ("--capacity", "16", "--delay-ms", "20")
            node = await asyncio.to_thread(
                start_node_raas, tmp_path, "node-batch", *flags, dataflow=server.address
            )
            await invariants.registered(df, "node-batch", timeout_s=15)
            trainer = invariants.Trainer(client)
            await trainer.drain(df, timeout_s=60)
            async with RolloutClient(node.address, timeout_s=5.0) as raas:
                deadline = time.monotonic() + 10
                while (status := await raas.get_status()).pending_results:
                    assert time.monotonic() < deadline, "results left unacknowledged"
                    await asyncio.sleep(0.1)
            return trainer.consumed, df.status(), df.pool.instances["node-batch"].port, status

    try:
        consumed, df_status, port, node_status = asyncio.run(asyncio.wait_for(body(), 90))
    finally:
        if node is not None:
            node.close()
    assert port.batched is True  # CollectResultBatch answered: no fallback
    invariants.assert_epoch_trained_once(consumed, n)
    c = df_status["counters"]
    assert c["consumed_groups"] == c["completed_groups"] == n
    assert c.get("duplicates_dropped", 0) == 0
    work = dict(node_status.counters)
    assert work["groups_accepted"] == work["groups_finished"] == n, work
    assert work["results_acknowledged"] == n, work  # each acknowledged once, by a batch call


def test_node_results_are_cut_at_the_byte_limit_but_keep_the_first():
    """results.js, as CollectResultBatch uses it: the oldest results whose sizes fit the
    limit, at most max_groups, one at least however large (as astra.servers.raas_convert's
    `within`); results answered stay held until acknowledged."""
    script = """
    const { Results } = require('./results');
    const r = new Results();
    r.add('a', { id: 'a' }, 40); r.add('b', { id: 'b' }, 40); r.add('c', { id: 'c' }, 100);
    const ids = (list) => list.map((x) => x.id);
    const out = [ids(r.oldest(10, 80)), ids(r.oldest(10, 79)), ids(r.oldest(2)), ids(r.oldest(10, 1))];
    out.push([String(r.acknowledge(['a', 'zz'])), ...ids(r.oldest(10, 1000))]);
    console.log(JSON.stringify(out));
    """
    js = subprocess.run(
        ["node", "-e", script], cwd=NODE_DIR, capture_output=True, text=True, timeout=30, check=True
    )
    assert json.loads(js.stdout) == [["a", "b"], ["a"], ["a", "b"], ["a"], ["1", "b", "c"]]


def test_node_raas_resumes_a_fetch_after_the_tensors_it_verified(tmp_path, monkeypatch):
    """A chunk damaged on the way, then a stream that breaks: each time the JavaScript receiver
    opens a new stream naming the tensors it verified, and the service sends only the rest."""
    node = start_node_raas(tmp_path, "node-resume")
    size = 64 << 10
    rng = np.random.default_rng(3)

    def model() -> dict:
        return {n: ("U8", [size], rng.bytes(size)) for n in ("a", "b", "c", "d")}

    original = FetchSource.chunks
    faults: dict[str, str] = {}  # tensor -> what happens to its next stream, once

    def faulty(self, name, chunk_bytes, start=0):
        fault = faults.pop(name, None)
        if fault == "break":
            raise ConnectionResetError(f"injected: the stream breaks before {name}")
        for piece in original(self, name, chunk_bytes, start):
            if fault == "flip":
                damaged = bytearray(piece)
                damaged[len(damaged) // 2] ^= 0x01
                piece, fault = memoryview(bytes(damaged)), None
            yield piece

    monkeypatch.setattr(FetchSource, "chunks", faulty)

    async def body():
        weights = await start_weights(tmp_path / "store", config=StoreConfig(durable=False))
        counters = weights.store.counters
        try:
            out = []
            async with RolloutClient(node.address, timeout_s=30.0) as client:
                for version, fault in ((1, ("b", "flip")), (2, ("c", "break"))):
                    await publish_version(
                        weights.address, "policy", f"v{version}", version, model()
                    )
                    faults.update([fault])
                    before = counters["fetch_tensors_resumed"]
                    want = version_pb2.PolicyVersion(
                        policy_id="policy", version=version, version_id=f"v{version}"
                    )
                    loaded = await client.load_weights([want], weights.address, f"load-{version}")
                    out.append((loaded.fetched_bytes, counters["fetch_tensors_resumed"] - before))
                status = await client.get_status()
            return out, status
        finally:
            await weights.stop(0)

    (first, second), status = run_then_close(asyncio.wait_for(body(), 60), [node])
    assert not faults, "both faults happened"
    # v1, a full copy: a and the damaged b, then b, c and d again; never a a second time.
    assert first == (5 * size, 1)
    assert second[1] == 2, "the second stream skipped a and b"
    assert [(v.version, v.version_id) for v in status.loaded_versions] == [(2, "v2")]
    log = node.log.read_text()
    assert "policy@v1: fetch attempt 1 failed" in log and "resuming after 1 verified" in log
    assert "policy@v2: fetch attempt 1 failed" in log and "resuming after 2 verified" in log


@pytest.mark.slow
def test_node_raas_in_a_run_with_kills_delivers_every_group_once(big_dataset, tmp_path):  # noqa: F811
    port = free_port()
    config = fault_config(big_dataset, tmp_path, port=port)
    df = start_dataflow(config, tmp_path, "dataflow-a")
    flags = ("--delay-ms", "200", "--capacity", "8", "--label", "lang=javascript")
    node = [start_node_raas(tmp_path, f"node-{i}", *flags, dataflow=df.address) for i in range(2)]
    procs = [*node, df]

    def states(status) -> dict[str, int]:
        return {i.instance_id: i.state for i in status.instances}

    async def body():
        nonlocal df
        async with Trainer(df.address) as trainer:
            status = await trainer.wait_status(lambda s: len(states(s)) == 2, 15, 0.1)
            assert all(dict(i.labels) == {"lang": "javascript"} for i in status.instances)
            await trainer.run_until(4, 30)
            node[0].kill()  # with groups in flight
            await trainer.run_until(8, 30)
            df.kill()  # the node RaaS keep their results and register again by themselves
            df = start_dataflow(config, tmp_path, "dataflow-b")
            procs.append(df)
            procs.append(
                start_node_raas(tmp_path, "node-2", "--delay-ms", "50", dataflow=df.address)
            )
            await trainer.run_until(NUM_PROMPTS, 60)
            status = await trainer.wait_status(
                lambda s: {"node-1", "node-2"} <= set(states(s)), 15, 0.2
            )
            # A clean stop: the instance deregisters and exits 0.
            node[1].signal(signal.SIGTERM)
            code = await asyncio.to_thread(node[1].wait, 10)
            left = await trainer.wait_status(lambda s: states(s)["node-1"] == LEFT, 10, 0.1)
        return trainer.consumed, status, code, left

    consumed, status, code, left = run_then_close(body(), procs)
    assert_exactly_once(consumed)
    assert {"node-1", "node-2"} <= set(states(status))
    assert code == 0
    assert states(left)["node-1"] == LEFT


def test_node_raas_over_mutual_tls(dataset, tmp_path, run_ca, monkeypatch):  # noqa: F811
    """Under ASTRA_TLS_DIR the node RaaS serves and dials with the run's certificates: it
    registers with a TLS Dataflow, its groups reach a trainer, and it passes the contract
    checks over TLS; a client without a certificate of the run CA is refused."""
    monkeypatch.setenv("ASTRA_TLS_DIR", str(run_ca))
    df = start_dataflow(make_config(dataset, tmp_path / "state"), tmp_path)
    node = start_node_raas(tmp_path, "node-tls", dataflow=df.address)
    alone = start_node_raas(tmp_path, "node-tls-alone")  # checked: no Dataflow dispatches to it

    async def body():
        async with Trainer(df.address) as trainer:
            await trainer.run_until(2, 30)
        checks = await RaasChecker(alone.address, CheckOptions(result_timeout_s=10.0)).run()
        monkeypatch.delenv("ASTRA_TLS_DIR")
        async with RolloutClient(node.address, timeout_s=2.0) as plain:
            try:
                await plain.get_status()
                refused = None
            except grpc.aio.AioRpcError as exc:
                refused = exc.code()
        return trainer.consumed, checks, refused

    consumed, checks, refused = run_then_close(body(), [node, alone, df])
    assert len(consumed) >= 2 and len(set(consumed)) == len(consumed)
    assert {r.status for r in checks} <= {"pass", "skip"}, [r for r in checks if r.status == "fail"]
    assert refused is grpc.StatusCode.UNAVAILABLE
    assert "mutual TLS" in node.log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_astra_run_supervises_an_external_raas_from_its_command(runs) -> None:
    """A recipe's `raas:` entry with `command:` puts the JavaScript RaaS in an `astra run` in
    place of the built-in one: started with its placeholders filled in, registered under the
    run's instance id, loading the trainer's versions, SIGKILLed and restarted by the
    supervisor, and every group trained exactly once."""
    command = [
        "node", str(NODE_DIR / "raas.js"), "--dataflow", "{dataflow}",
        "--instance-id", "{instance_id}", "--capacity", "{capacity}", "--policy", "{policy}",
        "--workflow", "{workflow}", "--reward", "exact_match", "--delay-ms", "5", "--vocab", "100",
        "--label", "engine=js",
    ]  # fmt: skip
    spec = {"name": "js", "capacity": 8, "labels": {"engine": "js"}, "command": command}
    run = runs(
        str(ROOT / "configs" / "recipes" / "smoke.yaml"),
        *("--set", "warmup.steps=0", "--set", "eval.every_steps=0"),
        *("--set", "trainer.num_steps=6", "--set", f"raas=[{json.dumps(spec)}]"),
        *("--set", "on_raas_death=restart"),
    )
    children = run.wait_for_children({"raas", "trainer"}, 120)
    js = next(c for c in children if c["name"] == "js")
    assert js["command"][:2] == ["node", str(NODE_DIR / "raas.js")]
    filled = dict(zip(js["command"][2::2], js["command"][3::2], strict=False))
    assert filled["--instance-id"] == "js" and filled["--capacity"] == "8"
    assert filled["--dataflow"].startswith("127.0.0.1:") and "{" not in " ".join(js["command"])
    metrics, deadline = run.run_dir / "metrics.jsonl", time.monotonic() + 90
    while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text()):
        time.sleep(0.2)
    assert metrics.is_file(), f"no step within 90 s: {run.output()}\n{run.log_tails()}"
    os.kill(js["pid"], signal.SIGKILL)  # the supervisor restarts it (supervision.max_restarts)
    assert run.wait(180) == 0, f"{run.output()}\n{run.log_tails()}"

    s = run.summary()
    assert s["steps"] == 6 and s["groups_lost"] == 0 and s["groups_duplicated"] == 0, s
    # The only RaaS of the run: every group trained came from it. Its `work` is the last
    # incarnation's GetStatus, which may have finished nothing (the buffer held enough).
    assert list(s["raas"]) == ["js"] and isinstance(s["raas"]["js"]["work"], dict), s["raas"]
    assert s["raas"]["js"]["labels"] == {"engine": "js"}
    assert [e["child"] for e in s["restarts"]] == ["js"], s["restarts"]
    log = (run.run_dir / "logs" / "js.log").read_text(errors="replace")
    loaded = [int(v) for v in re.findall(r"loaded policy@(\d+)", log)]
    assert loaded and max(loaded) >= 1, log[-2000:]  # the trainer's versions reached it


async def _get_status(address: str, credential: Path) -> grpc.aio.AioRpcError | None:
    """How one GetStatus with `credential` ends: its error, or None when it is served."""
    async with tls_channel(address, credential) as channel:
        try:
            await rs_grpc.RolloutServiceStub(channel).GetStatus(rs_pb.GetStatusRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


def _assert_revoked(exc: grpc.aio.AioRpcError | None, cert: Path, method: str) -> None:
    assert exc is not None and exc.code() is grpc.StatusCode.UNAUTHENTICATED, exc
    info, _ = error_info(exc)
    serial = f"{serial_of(cert.read_bytes()):x}"
    assert info is not None and info.reason == "CERTIFICATE_REVOKED", exc
    assert info.domain == "astra.raas.v1"
    assert dict(info.metadata) == {"serial": serial, "method": method}
    assert serial in exc.details()


async def _logged(node: Proc, line: str, timeout_s: float = 15.0) -> None:
    """Returns once the node's log holds `line` (it looks at its list once a second)."""
    deadline = time.monotonic() + timeout_s
    while line not in node.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"not logged: {line!r}"
        await asyncio.sleep(0.2)


def _credential(ca: Path, out: Path) -> Path:
    return issue(ca, out, ["127.0.0.1"])


def test_node_raas_refuses_revoked_callers_at_the_call_level(tmp_path, run_ca, monkeypatch):  # noqa: F811
    """Under mutual TLS with the CA's revocation list, a listed client's calls end
    UNAUTHENTICATED (CERTIFICATE_REVOKED, naming the serial) while others are served; health
    checking stays open to it; a certificate revoked while the node runs is refused within a
    few seconds, and stays so when the list is replaced by an older one or removed."""
    monkeypatch.setenv("ASTRA_TLS_DIR", str(run_ca))
    revoked, kept, later = (_credential(run_ca, tmp_path / n) for n in ("revoked", "kept", "later"))
    revoke(run_ca, certs=[revoked / "cert.pem"])
    first = (run_ca / "crl.pem").read_bytes()
    node = start_node_raas(tmp_path, "node-crl")

    async def body():
        status = "/astra.raas.v1.RolloutService/GetStatus"
        _assert_revoked(await _get_status(node.address, revoked), revoked / "cert.pem", status)
        async with tls_channel(node.address, revoked) as channel:
            try:
                await rs_grpc.RolloutServiceStub(channel).GetCapabilities(
                    rs_pb.GetCapabilitiesRequest(), timeout=5
                )
                caps = None
            except grpc.aio.AioRpcError as exc:
                caps = exc
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        method = "/astra.raas.v1.RolloutService/GetCapabilities"
        _assert_revoked(caps, revoked / "cert.pem", method)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert await _get_status(node.address, kept) is None
        assert await _get_status(node.address, later) is None
        # Revoked while the node runs: refused within a few seconds, no restart.
        revoke(run_ca, certs=[later / "cert.pem"])
        deadline = time.monotonic() + 10
        while (exc := await _get_status(node.address, later)) is None:
            assert time.monotonic() < deadline, "a certificate revoked meanwhile is still served"
            await asyncio.sleep(0.2)
        _assert_revoked(exc, later / "cert.pem", status)
        assert await _get_status(node.address, kept) is None
        # An older list, then none: the revocations the node holds stay.
        (run_ca / "crl.pem").write_bytes(first)
        await _logged(node, "is an older list (number 1 < 2)")
        _assert_revoked(await _get_status(node.address, later), later / "cert.pem", status)
        (run_ca / "crl.pem").unlink()
        await _logged(node, "was removed: its revocations stay")
        _assert_revoked(await _get_status(node.address, later), later / "cert.pem", status)
        assert await _get_status(node.address, kept) is None

    run_then_close(asyncio.wait_for(body(), 60), [node])
    assert "(1 revoked)" in node.log.read_text()


def test_node_raas_does_not_start_on_an_unusable_list_or_its_own_revoked_certificate(
    tmp_path,
    run_ca,  # noqa: F811
    monkeypatch,
):
    """A list bearing the CA's name that another key signed stops the node at start, naming
    the file; so does a list naming the node's own certificate. The list of a CA that ca.pem
    does not hold is not used, and the log says so."""
    ca_name = x509.load_pem_x509_certificate((run_ca / "ca.pem").read_bytes()).subject
    forger, other = tmp_path / "forger", tmp_path / "other"
    init_ca(forger, name=ca_name.rfc4514_string().removeprefix("CN="))
    init_ca(other)
    revoke(forger, serials=[7])
    revoke(other, serials=[7])
    monkeypatch.setenv("ASTRA_TLS_DIR", str(run_ca))
    crl = run_ca / "crl.pem"
    shutil.copy(forger / "crl.pem", crl)
    with pytest.raises(RuntimeError, match=f"{re.escape(str(crl))}: not signed by the CA"):
        start_node_raas(tmp_path, "node-forged")
    shutil.copy(other / "crl.pem", crl)
    node = start_node_raas(tmp_path, "node-other")
    node.close()
    assert "a CA ca.pem does not trust: not used" in node.log.read_text()
    # Its own certificate listed: the node does not start.
    own = _credential(run_ca, tmp_path / "own")
    crl.unlink()
    revoke(run_ca, certs=[own / "cert.pem"])
    shutil.copy(crl, own / "crl.pem")
    monkeypatch.setenv("ASTRA_TLS_DIR", str(own))
    with pytest.raises(RuntimeError, match=r"is revoked by .*crl\.pem"):
        start_node_raas(tmp_path, "node-own")
    # ASTRA_TLS_CRL names a list that is not there.
    monkeypatch.setenv("ASTRA_TLS_DIR", str(run_ca))
    monkeypatch.setenv("ASTRA_TLS_CRL", str(tmp_path / "none.pem"))
    with pytest.raises(RuntimeError, match="ASTRA_TLS_CRL: no revocation list"):
        start_node_raas(tmp_path, "node-missing")


def test_node_raas_refuses_a_server_whose_certificate_is_revoked(tmp_path, run_ca, monkeypatch):  # noqa: F811
    """The node's channels check their server's certificate against the list too: a
    LoadWeights from a WeightService address whose certificate is listed fails, naming the
    serial, and nothing is loaded."""
    monkeypatch.setenv("ASTRA_TLS_DIR", str(run_ca))
    listed = _credential(run_ca, tmp_path / "listed")
    revoke(run_ca, certs=[listed / "cert.pem"])
    serial = f"{serial_of((listed / 'cert.pem').read_bytes()):x}"
    node = start_node_raas(tmp_path, "node-dials")

    async def body():
        # A bare TLS server with the listed certificate (an Astra server would not start on
        # it): the node's handshake refuses it before any call is sent.
        server = grpc.aio.server()
        creds = grpc.ssl_server_credentials(
            [((listed / "key.pem").read_bytes(), (listed / "cert.pem").read_bytes())],
            (run_ca / "ca.pem").read_bytes(),
            True,
        )
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        want = version_pb2.PolicyVersion(policy_id="policy", version=1, version_id="v1")
        request = rs_pb.LoadWeightsRequest(
            request_id="r1", versions=[want], weights_address=f"127.0.0.1:{port}"
        )
        try:
            async with tls_channel(node.address, run_ca) as channel:
                stub = rs_grpc.RolloutServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.LoadWeights(request, timeout=20)
                status = await stub.GetStatus(rs_pb.GetStatusRequest(), timeout=5)
        finally:
            await server.stop(0)
        return refused.value, status

    refused, status = run_then_close(asyncio.wait_for(body(), 60), [node])
    assert refused.code() is grpc.StatusCode.UNAVAILABLE, refused
    assert f"(serial {serial}) is revoked" in refused.details()
    assert list(status.loaded_versions) == []


def test_node_raas_warns_of_a_list_past_its_next_update_and_still_revokes(
    tmp_path,
    run_ca,  # noqa: F811
    monkeypatch,
):
    """A list whose nextUpdate has passed (its CA promised a newer one by then) still
    revokes, and the node warns of it."""
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization

    listed = _credential(run_ca, tmp_path / "listed")
    ca = x509.load_pem_x509_certificate((run_ca / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((run_ca / "ca.key").read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    entry = (
        x509.RevokedCertificateBuilder()
        .serial_number(serial_of((listed / "cert.pem").read_bytes()))
        .revocation_date(now - datetime.timedelta(days=2))
        .build()
    )
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.subject)
        .last_update(now - datetime.timedelta(days=2))
        .next_update(now - datetime.timedelta(days=1))
        .add_revoked_certificate(entry)
        .sign(key, hashes.SHA256())  # type: ignore[arg-type]
    )
    (run_ca / "crl.pem").write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    monkeypatch.setenv("ASTRA_TLS_DIR", str(run_ca))
    node = start_node_raas(tmp_path, "node-due")

    async def body():
        return await _get_status(node.address, listed)

    exc = run_then_close(asyncio.wait_for(body(), 30), [node])
    _assert_revoked(exc, listed / "cert.pem", "/astra.raas.v1.RolloutService/GetStatus")
    assert "is past its nextUpdate" in node.log.read_text()


def test_node_raas_permits_calls_by_the_roles_of_the_callers_certificate(
    tmp_path,
    run_ca,  # noqa: F811
    monkeypatch,
):
    """The roles a caller's certificate names decide its calls as in the Python servers
    (astra.authz): a trainer's SubmitGroups ends PERMISSION_DENIED (ROLE_NOT_PERMITTED, naming
    the method and the roles), its GetStatus and health checks are served; Dataflow's,
    admin's and a role-less certificate's SubmitGroups reach the handler. The JavaScript table
    is astra.authz's, method for method."""
    from astra.authz import PERMITTED

    js = subprocess.run(
        ["node", "-e", "console.log(JSON.stringify(require('./roles').PERMITTED))"],
        cwd=ROOT / "tools" / "raas-node",
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    raas = {m: sorted(r) for m, r in PERMITTED.items() if m.startswith("/astra.raas.v1.")}
    assert {m: sorted(r) for m, r in json.loads(js.stdout).items()} == raas

    monkeypatch.setenv("ASTRA_TLS_DIR", str(run_ca))
    creds = {
        role: issue(
            run_ca, tmp_path / (role or "none"), ["127.0.0.1"], roles=[role] if role else []
        )
        for role in ("trainer", "dataflow", "admin", "")
    }
    node = start_node_raas(tmp_path, "node-roles")
    submit = "/astra.raas.v1.RolloutService/SubmitGroups"

    async def outcome(credential: Path) -> grpc.aio.AioRpcError | None:
        async with tls_channel(node.address, credential) as channel:
            stub = rs_grpc.RolloutServiceStub(channel)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            await stub.GetStatus(rs_pb.GetStatusRequest(), timeout=5)  # open to all
            try:
                await stub.SubmitGroups(rs_pb.SubmitGroupsRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc
        return None

    async def body():
        return {role: await outcome(c) for role, c in creds.items()}

    ends = run_then_close(asyncio.wait_for(body(), 60), [node])
    denied = ends["trainer"]
    assert denied is not None and denied.code() is grpc.StatusCode.PERMISSION_DENIED, denied
    info, _ = error_info(denied)
    assert info.reason == "ROLE_NOT_PERMITTED" and info.domain == "astra.raas.v1"
    assert dict(info.metadata) == {
        "method": submit,
        "roles": "trainer",
        "permitted": "dataflow, admin",
    }
    for role in ("dataflow", "admin", ""):  # reached the handler: refused for the empty request
        exc = ends[role]
        assert exc is None or exc.code() is not grpc.StatusCode.PERMISSION_DENIED, (role, exc)
        assert exc is None or error_info(exc)[0].reason != "ROLE_NOT_PERMITTED", (role, exc)
