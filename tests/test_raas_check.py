"""`astra raas check`: the RaaS contract checker passes Astra's own RaaS and fails broken ones.

Here: Astra's RaaS passes, results Dataflow would refuse fail `collect`, a RaaS without the
optional CollectResultBatch has its checks skipped, and the CLI on each engine. One broken rule
per check (52 switches of astra.testing.broken_raas, each caught by the check named for it):
tests/test_raas_check_broken.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest

from astra.clients.raas_check import CHECKS, CheckOptions, RaasChecker
from astra.clients.raas_rules import summary
from astra.clients.weights_publish import publish_version
from astra.engine.tiny import TINY_CONFIG
from astra.raas.scripted import VOCAB_SIZE, ScriptedGenerator
from astra.servers.raas import RolloutServicer
from astra.servers.raas_serve import start_raas
from astra.servers.weights_serve import start_weights
from astra.testing.fake_engines import FakeEngineServer
from astra.weights.store import StoreConfig
from tests.test_e2e_raas import perturbed_tiny

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = CheckOptions(result_timeout_s=10.0)


def run_checks(patch=None, backend=None, store: Path | None = None) -> dict[str, tuple[str, str]]:
    """{check: (status, detail)} of the checker against an in-process RaaS, `patch`ed; with
    `store`, a WeightService there holding version 3 ("v3") of the policy as well."""

    async def body() -> dict[str, tuple[str, str]]:
        server, servicer, _ = await start_raas(
            backend or ScriptedGenerator(delay_s=0.05), capacity=4
        )
        weights, options = None, OPTIONS
        try:
            if store is not None:
                weights = await start_weights(store, config=StoreConfig(durable=False))
                tensor = ("F32", [4], np.arange(4, dtype=np.float32).tobytes())
                config = {"config.json": json.dumps({"vocab_size": VOCAB_SIZE}).encode()}
                await publish_version(weights.address, "policy", "v3", 3, {"w": tensor}, config)
                options = replace(OPTIONS, weights=weights.address, version_id="v3")
            if patch is not None:
                patch(servicer)
            results = await RaasChecker(server.address, options).run()
            return {r.name: (r.status, r.detail) for r in results}
        finally:
            await server.stop(0)
            if weights is not None:
                await weights.stop(0)

    return asyncio.run(asyncio.wait_for(body(), 90))


REGISTRATION_CHECKS = {
    "registers",
    "registration_matches_status",
    "heartbeats",
    "claims_loaded_version",
    "reregisters_on_not_found",
}
WEIGHT_CHECKS = {
    "load_weights",
    "load_weights_is_idempotent",
    "load_weights_refuses_regression",
    "load_weights_refuses_reused_request_id",
    "tokens_carry_the_loaded_version",
    "tokens_within_the_vocabulary",
}


@pytest.mark.slow
def test_astra_raas_passes_every_check() -> None:
    got = run_checks()
    assert len(got) == 43
    not_passed = {name: status for name, (status, _) in got.items() if status != "pass"}
    # no --weights, no --serve-weights, no --as-dataflow given
    assert not_passed == dict.fromkeys(
        {*WEIGHT_CHECKS, "load_weights_matches_by_identity", "load_weights_refuses_corrupt_data",
         *REGISTRATION_CHECKS},
        "skip",
    )  # fmt: skip
    assert "as Dataflow reads them" in got["collect"][1]


@pytest.mark.slow
def test_the_load_weights_checks_pass_with_a_weight_service(tmp_path: Path) -> None:
    got = run_checks(store=tmp_path / "store")
    assert {name: got[name][0] for name in WEIGHT_CHECKS} == dict.fromkeys(WEIGHT_CHECKS, "pass")
    assert "version 3" in got["load_weights"][1] and got["settles"][0] == "pass"


# One broken rule per check: tests/test_raas_check_broken.py (astra.testing.broken_raas).

BATCH_CHECKS = {name for name in CHECKS if name.startswith("batch_")}


@pytest.mark.slow
def test_a_raas_without_collect_result_batch_has_its_checks_skipped_not_failed(monkeypatch):
    """CollectResultBatch is optional: answered UNIMPLEMENTED (as gRPC answers a method not
    served), its checks are skipped saying so, and every other check still passes."""

    async def unimplemented(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(RolloutServicer, "CollectResultBatch", unimplemented)
    got = run_checks()
    assert len(BATCH_CHECKS) == 6
    assert {n: got[n][0] for n in BATCH_CHECKS} == dict.fromkeys(BATCH_CHECKS, "skip")
    assert all("UNIMPLEMENTED: optional" in got[n][1] for n in BATCH_CHECKS), got
    assert {n for n, (s, _) in got.items() if s == "fail"} == set()
    assert got["settles"][0] == "pass"  # no group submitted for the checks that were skipped


class TruncatedLogprobs(ScriptedGenerator):
    """Every sequence one log-prob short of its tokens: a result Dataflow refuses."""

    async def generate(self, spec, versions):
        out = await super().generate(spec, versions)
        return [
            replace(t, sequences=[replace(s, logprobs=s.logprobs[:-1]) for s in t.sequences])
            for t in out
        ]


@pytest.mark.slow
def test_a_result_dataflow_would_refuse_fails_collect() -> None:
    got = run_checks(backend=TruncatedLogprobs(delay_s=0.05))
    status, detail = got["collect"]
    assert status == "fail" and "Dataflow would refuse the result" in detail
    assert "logprobs" in detail  # the field named, as Dataflow names it


class EveryoneFails(ScriptedGenerator):
    """Every sample failed (a misconfigured engine: say, the wrong served model name)."""

    async def generate(self, spec, versions):
        out = await super().generate(spec, versions)
        return [replace(t, sequences=[], error="HTTP 404: no model 'policy'") for t in out]


@pytest.mark.slow
def test_samples_that_failed_fail_collect_with_the_engines_message() -> None:
    status, detail = run_checks(backend=EveryoneFails(delay_s=0.05))["collect"]
    assert status == "fail" and "2 of 2 samples failed" in detail and "HTTP 404" in detail


def test_checks_that_need_a_failed_one_are_skipped() -> None:
    def no_policies(servicer) -> None:
        servicer.policy_ids = []

    got = run_checks(no_policies)
    assert got["status"][0] == "fail" and "policy_ids []" in got["status"][1]
    assert got["submit"][0] == got["collect"][0] == "skip"
    assert got["submit_rejects_empty"][0] == "pass"  # needs nothing from status


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "vllm", "sglang"])
def test_cli_checks_astra_raas_on_each_engine(tmp_path: Path, engine: str) -> None:
    """`astra raas check` against `astra serve raas`: the built-in engine on the tiny model, and
    the vLLM and SGLang adapters on their FAKE servers; exit 0. Told to run a workflow the
    instance does not serve, exit 1 naming the check."""
    fake = weights = checker = None
    args, weight_args = ["--model", "tiny"], []
    if engine == "torch":  # the LoadWeights checks too, with version 1 of a WeightService
        weights = subprocess.Popen(
            [sys.executable, "-m", "astra.cli", "serve", "weights", "--store",
             str(tmp_path / "store"), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        )  # fmt: skip
        address = json.loads(weights.stdout.readline())["address"]
        tiny = {"config.json": json.dumps(TINY_CONFIG).encode()}
        asyncio.run(publish_version(address, "policy", "v1", 1, perturbed_tiny(), tiny))
        weight_args = ["--weights", address, "--version", "v1", "--serve-weights"]
    else:
        fake = FakeEngineServer(engine).start()
        args = ["--engine", engine, "--engine-url", fake.url, "--served-model-name", "FAKE-tiny"]
    check = [sys.executable, "-m", "astra.cli", "raas", "check"]
    if weights is not None:  # truncated weights are refused when the fetch deadline passes
        args += ["--fetch-timeout", "8"]
        # and the registration rules: the checker is the Dataflow the RaaS registers with
        dataflow = f"127.0.0.1:{free_port()}"
        checker = subprocess.Popen(
            [*check, "--as-dataflow", dataflow, *weight_args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        args += ["--dataflow", dataflow]
    raas = subprocess.Popen(
        [sys.executable, "-m", "astra.cli", "serve", "raas", *args, "--capacity", "4",
         "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        address = json.loads(raas.stdout.readline())["address"]
        check.append(address)
        if checker is not None:  # the instance's address taken from its registration
            out, err = checker.communicate(timeout=240)
            ok = subprocess.CompletedProcess(checker.args, checker.returncode, out, err)
        else:
            ok = subprocess.run(check, capture_output=True, text=True, timeout=180)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        if weights is not None:
            assert "43 passed, 0 failed, 0 warnings, 0 skipped" in ok.stdout, ok.stdout
            assert f"every id below vocab_size {TINY_CONFIG['vocab_size']}" in ok.stdout
            assert "registered again" in ok.stdout and "same incarnation" in ok.stdout
            assert "every generated token: version 1" in ok.stdout
            # its own version offered as the delta's base: the wrong base found, refused
            assert "wrong-base: DATA_LOSS CHECKSUM_MISMATCH" in ok.stdout, ok.stdout
            assert "truncated: DEADLINE_EXCEEDED" in ok.stdout, ok.stdout
        else:
            assert "30 passed, 0 failed, 0 warnings, 13 skipped" in ok.stdout, ok.stdout
        bad = subprocess.run(
            [*check, "--workflow", "no_such", "--json"], capture_output=True, text=True, timeout=60
        )
        assert bad.returncode == 1
        report = json.loads(bad.stdout)
        assert not report["ok"] and report["fail"] == 1
        (status,) = [c for c in report["checks"] if c["name"] == "status"]
        assert status["status"] == "fail" and "no_such" in status["detail"]
    finally:
        raas.terminate()
        raas.wait(30)
        if checker is not None and checker.poll() is None:
            checker.kill()
            checker.wait(30)
        if fake is not None:
            fake.stop()
        if weights is not None:
            weights.terminate()
            weights.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_summary_counts() -> None:
    from astra.clients.raas_rules import Check

    s = summary([Check("a", "pass", ""), Check("b", "warn", ""), Check("c", "skip", "")])
    assert s["ok"] and (s["pass"], s["warn"], s["skip"], s["fail"]) == (1, 1, 1, 0)
    assert not summary([Check("a", "fail", "x")])["ok"]
