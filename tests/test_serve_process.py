"""`astra serve dataflow` as a real process: grpcurl sees it, SIGTERM drains and exits 0."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import start_dataflow

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


def grpcurl(*args: str) -> str:
    out = subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
@pytest.mark.skipif(not Path(GRPCURL).exists(), reason="grpcurl not installed")
def test_grpcurl_lists_describes_and_health_checks(config, tmp_path):
    proc = start_dataflow(config, tmp_path)
    try:
        services = grpcurl(proc.address, "list").split()
        assert "astra.dataflow.v1.DataflowService" in services
        assert "grpc.health.v1.Health" in services
        described = grpcurl(proc.address, "describe", "astra.dataflow.v1.DataflowService")
        assert "rpc FetchBatch" in described and "stream" in described
        # a method resolves, with the comment the proto gives it
        method = grpcurl(proc.address, "describe", "astra.dataflow.v1.DataflowService.FetchBatch")
        assert "is a method:" in method and "\n// " in method, method
        health = json.loads(
            grpcurl(
                "-d",
                '{"service": "astra.dataflow.v1.DataflowService"}',
                proc.address,
                "grpc.health.v1.Health/Check",
            )
        )
        assert health["status"] == "SERVING"
        status = json.loads(grpcurl(proc.address, "astra.dataflow.v1.DataflowService/GetStatus"))
        assert status.get("poolEmpty", status.get("pool_empty")) is True, status
        cli = subprocess.run(
            [sys.executable, "-m", "astra.cli", "status", "--dataflow", proc.address],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert cli.returncode == 0, cli.stderr
        shown = json.loads(cli.stdout)
        assert shown["pool_empty"] is True
        # int64 fields as numbers (proto3 JSON writes them as strings), by their declared type
        assert shown["counters"] and all(type(v) is int for v in shown["counters"].values())
        assert all(type(p["current_version"]) is int for p in shown["policies"])
        assert type(shown["storage"]["free_bytes"]) is int
        # --run-dir: the Dataflow run.json names
        record = {"supervisor": {"state": "running"}, "children": []}
        record["children"].append({"role": "dataflow", "address": proc.address})
        (tmp_path / "run.json").write_text(json.dumps(record))
        by_run = subprocess.run(
            [sys.executable, "-m", "astra.cli", "status", "--run-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert by_run.returncode == 0, by_run.stderr

        def counts(status: dict) -> dict:  # gate_ms.<MODE> grows with time: not a count
            return {k: v for k, v in status["counters"].items() if not k.startswith("gate_ms.")}

        assert counts(json.loads(by_run.stdout)) == counts(shown)
    finally:
        proc.signal(signal.SIGTERM)
        code = proc.wait(15)
        proc.close()
    assert code == 0, proc.log.read_text()[-2000:]


def test_unknown_config_key_exits_2_naming_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("policies: [{id: p}]\nstreams: []\nbogus_key: 1\n")
    out = subprocess.run(
        [sys.executable, "-m", "astra.cli", "serve", "dataflow", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "bogus_key" in out.stderr


def test_a_port_in_use_ends_the_service_in_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "astra.cli", "serve", "weights", "--store", str(tmp_path)]
        done = subprocess.run(
            [*cmd, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}: the port is in use" in lines[0], lines
