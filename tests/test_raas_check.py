"""`astra raas check`: the RaaS contract checker passes Astra's own RaaS and fails broken ones.

Each broken RaaS breaks one rule of rollout_service.proto (patched into the real servicer),
and the check for that rule must fail while the server keeps answering the rest.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from astra.clients.raas_check import CheckOptions, RaasChecker
from astra.clients.raas_rules import summary
from astra.clients.weights_publish import publish_version
from astra.raas.scripted import ScriptedGenerator
from astra.servers.raas import start_raas
from astra.servers.weights import start_weights
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
                await publish_version(weights.address, "policy", "v3", 3, {"w": tensor})
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


WEIGHT_CHECKS = {
    "load_weights",
    "load_weights_is_idempotent",
    "load_weights_refuses_regression",
    "load_weights_refuses_reused_request_id",
    "tokens_carry_the_loaded_version",
}


def test_astra_raas_passes_every_check() -> None:
    got = run_checks()
    assert len(got) == 28
    not_passed = {name: status for name, (status, _) in got.items() if status != "pass"}
    # no --weights, no --serve-weights given
    assert not_passed == dict.fromkeys(
        {*WEIGHT_CHECKS, "load_weights_refuses_corrupt_data"}, "skip"
    )
    assert "as Dataflow reads them" in got["collect"][1]


def test_the_load_weights_checks_pass_with_a_weight_service(tmp_path: Path) -> None:
    got = run_checks(store=tmp_path / "store")
    assert {name: got[name][0] for name in WEIGHT_CHECKS} == dict.fromkeys(WEIGHT_CHECKS, "pass")
    assert "version 3" in got["load_weights"][1] and got["settles"][0] == "pass"


class StampsVersionZero(ScriptedGenerator):
    """Loads new versions but stamps every token with version 0: staleness would be wrong."""

    async def generate(self, spec, versions):
        return await super().generate(spec, dict.fromkeys(versions, 0))


def allows_regression(servicer) -> None:
    """Swaps to any version asked, older ones included."""
    load = servicer._load

    async def reset_then_load(wanted, address):
        servicer._versions = {p: replace(v, version=-1) for p, v in servicer._versions.items()}
        return await load(wanted, address)

    servicer._load = reset_then_load


@pytest.mark.parametrize(
    ("backend", "patch", "check", "says"),
    [
        (StampsVersionZero, None, "tokens_carry_the_loaded_version", "expected (3, 3)"),
        (
            ScriptedGenerator,
            allows_regression,
            "load_weights_refuses_regression",
            "expected FAILED",
        ),
    ],
)
def test_a_broken_load_rule_fails_its_check(tmp_path, backend, patch, check, says) -> None:
    got = run_checks(patch, backend(delay_s=0.05), store=tmp_path / "store")
    status, detail = got[check]
    assert status == "fail" and says in detail, (check, got[check])


def forgets_unacknowledged(servicer) -> None:
    """Drops a result once it was collected, before AckResults: a lost response loses it."""
    store, collect = servicer.store, servicer.store.collect

    async def once(max_groups: int, max_wait_s: float) -> list:
        out = await collect(max_groups, max_wait_s)
        store.ack([gid for gid, payload in list(store._finished.items()) if payload in out])
        return out

    store.collect = once


def keeps_acknowledged(servicer) -> None:
    """Answers AckResults but keeps the results: Dataflow would be sent them forever."""
    store = servicer.store
    store.ack = lambda ids: (sum(g in store._finished for g in ids), 0)


def ignores_capacity(servicer) -> None:
    """Reports its capacity but admits whatever comes."""
    store, accept = servicer.store, servicer.store.try_accept

    def admit_all(groups, **kw):
        capacity, store.capacity = store.capacity, 10**6
        try:
            return accept(groups, **kw)
        finally:
            store.capacity = capacity

    store.try_accept = admit_all


@pytest.mark.parametrize(
    ("patch", "check", "says"),
    [
        (forgets_unacknowledged, "collect_repeats_until_ack", "not sent again"),
        (keeps_acknowledged, "ack_removes_the_result", "delivered again after AckResults"),
        (ignores_capacity, "submit_refuses_over_capacity", "expected RESOURCE_EXHAUSTED"),
    ],
)
def test_a_broken_rule_fails_its_check(patch, check: str, says: str) -> None:
    got = run_checks(patch)
    status, detail = got[check]
    assert status == "fail" and says in detail, (check, got[check])
    assert got["health"][0] == got["submit"][0] == "pass"  # the rest still ran


class TruncatedLogprobs(ScriptedGenerator):
    """Every sequence one log-prob short of its tokens: a result Dataflow refuses."""

    async def generate(self, spec, versions):
        out = await super().generate(spec, versions)
        return [
            replace(t, sequences=[replace(s, logprobs=s.logprobs[:-1]) for s in t.sequences])
            for t in out
        ]


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
    fake = weights = None
    args, weight_args = ["--model", "tiny"], []
    if engine == "torch":  # the LoadWeights checks too, with version 1 of a WeightService
        weights = subprocess.Popen(
            [sys.executable, "-m", "astra.cli", "serve", "weights", "--store",
             str(tmp_path / "store"), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        )  # fmt: skip
        address = json.loads(weights.stdout.readline())["address"]
        asyncio.run(publish_version(address, "policy", "v1", 1, perturbed_tiny()))
        weight_args = ["--weights", address, "--version", "v1"]
    else:
        fake = FakeEngineServer(engine).start()
        args = ["--engine", engine, "--engine-url", fake.url, "--served-model-name", "FAKE-tiny"]
    raas = subprocess.Popen(
        [sys.executable, "-m", "astra.cli", "serve", "raas", *args, "--capacity", "4",
         "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        address = json.loads(raas.stdout.readline())["address"]
        check = [sys.executable, "-m", "astra.cli", "raas", "check", address]
        ok = subprocess.run([*check, *weight_args], capture_output=True, text=True, timeout=180)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        if weights is not None:
            assert "27 passed, 0 failed, 0 warnings, 1 skipped" in ok.stdout, ok.stdout
            assert "every generated token: version 1" in ok.stdout
        else:
            assert "22 passed, 0 failed, 0 warnings, 6 skipped" in ok.stdout, ok.stdout
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
        if fake is not None:
            fake.stop()
        if weights is not None:
            weights.terminate()
            weights.wait(30)


def test_summary_counts() -> None:
    from astra.clients.raas_rules import Check

    s = summary([Check("a", "pass", ""), Check("b", "warn", ""), Check("c", "skip", "")])
    assert s["ok"] and (s["pass"], s["warn"], s["skip"], s["fail"]) == (1, 1, 1, 0)
    assert not summary([Check("a", "fail", "x")])["ok"]
