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

import pytest

from astra.clients.raas_check import CheckOptions, RaasChecker, summary
from astra.raas.scripted import ScriptedGenerator
from astra.servers.raas import start_raas
from astra.testing.fake_engines import FakeEngineServer

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = CheckOptions(result_timeout_s=10.0)


def run_checks(patch=None, backend=None) -> dict[str, tuple[str, str]]:
    """{check: (status, detail)} of the checker against an in-process RaaS, `patch`ed."""

    async def body() -> dict[str, tuple[str, str]]:
        server, servicer, _ = await start_raas(
            backend or ScriptedGenerator(delay_s=0.05), capacity=4
        )
        try:
            if patch is not None:
                patch(servicer)
            results = await RaasChecker(server.address, OPTIONS).run()
            return {r.name: (r.status, r.detail) for r in results}
        finally:
            await server.stop(0)

    return asyncio.run(asyncio.wait_for(body(), 90))


def test_astra_raas_passes_every_check() -> None:
    got = run_checks()
    assert len(got) == 20
    assert {name: status for name, (status, _) in got.items() if status != "pass"} == {}
    assert "as Dataflow reads them" in got["collect"][1]


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

    def admit_all(groups):
        capacity, store.capacity = store.capacity, 10**6
        try:
            return accept(groups)
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
    fake = None
    args = ["--model", "tiny"]
    if engine != "torch":
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
        ok = subprocess.run(check, capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "20 passed, 0 failed" in ok.stdout
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


def test_summary_counts() -> None:
    from astra.clients.raas_check import Check

    s = summary([Check("a", "pass", ""), Check("b", "warn", ""), Check("c", "skip", "")])
    assert s["ok"] and (s["pass"], s["warn"], s["skip"], s["fail"]) == (1, 1, 1, 0)
    assert not summary([Check("a", "fail", "x")])["ok"]
