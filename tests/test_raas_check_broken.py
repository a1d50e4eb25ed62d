"""`astra raas check` against a deliberately broken RaaS: one rule switched off at a time.

Every switch of astra.testing.broken_raas breaks one rule of rollout_service.proto;
the check named for it must fail with a detail saying what was wrong, and the
other checks must still run. Astra's RaaS with no switch passes every check. One
WeightService (holding version 3 of the policy) serves the whole module, from a
thread of its own.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from astra.clients.raas_check import CHECKS, CheckOptions, RaasChecker
from astra.clients.raas_rules import InstanceInUse
from astra.clients.weights_publish import publish_version
from astra.raas.registration_record import Recording
from astra.raas.scripted import VOCAB_SIZE
from astra.servers.raas_registration_check import start_checking_dataflow
from astra.servers.weights_serve import start_weights
from astra.testing.broken_raas import CATCHES, SWITCHES, start_broken_raas
from astra.testing.broken_registrar import start_registering
from astra.weights.store import StoreConfig

ROOT = Path(__file__).resolve().parent.parent

# What the failing check's detail says, per switch: the wrong thing named.
SAYS = {
    "never_serving": "not SERVING",
    "wrong_contract_major": "contract_version '2.0.0'",
    "free_slots_above_capacity": "free_slots 5",
    "accepts_empty_submit": "expected INVALID_ARGUMENT, got OK",
    "accepts_duplicate_ids": "expected INVALID_ARGUMENT, got OK",
    "accepts_unknown_policy": "expected INVALID_ARGUMENT, got OK",
    "accepts_unknown_workflow": "expected INVALID_ARGUMENT, got OK",
    "accepts_zero_max_new_tokens": "expected INVALID_ARGUMENT, got OK",
    "names_no_field": "not sampling_params.max_new_tokens",
    "no_error_info": "without a google.rpc.ErrorInfo",
    "ignores_capacity": "expected RESOURCE_EXHAUSTED",
    "no_retry_info": "without a google.rpc.RetryInfo",
    "accepts_long_wait": "expected INVALID_ARGUMENT, got OK",
    "accepted_ids_missing": "accepted [], expected",
    "refuses_resubmission": "resubmitting a held group: INVALID_ARGUMENT",
    "fails_every_group": "the group failed",
    "short_logprobs": "logprobs",
    "no_finish_reason": "finish_reason unset",
    "no_prompt_tokens": "prompt_length 0",
    "trains_on_the_prompt": "loss_mask: 1 on a prompt token",
    "unversioned_tokens": "< 0 on a trained token",
    "forgets_unacknowledged": "not sent again",
    "miscounts_ack": "acknowledged 0, expected 1",
    "keeps_acknowledged": "delivered again after AckResults",
    "ack_refuses_unknown_ids": "expected OK, got NOT_FOUND",
    "cancel_refuses_unknown_ids": "expected OK, got NOT_FOUND",
    "cancel_keeps_running": "a cancelled group produced a result",
    "load_accepts_empty": "expected INVALID_ARGUMENT, got OK",
    "load_accepts_unknown_policy": "expected INVALID_ARGUMENT, got OK",
    "load_is_ignored": "loaded_versions",
    "allows_regression": "expected FAILED_PRECONDITION",
    "reload_refused": "expected OK, got FAILED_PRECONDITION",
    "forgets_request_ids": "expected INVALID_ARGUMENT",
    "stamps_version_zero": "expected (3, 3)",
    "skips_verification": "do not match",
    "ids_past_vocab": "id 1048576 >= vocab_size 32000",
    "claims_unheld_version": "GetStatus says it holds",
    "registers_other_capacity": "registered capacity 7, GetStatus says 4",
    "claims_stale_versions": "a heartbeat claims",
    "ignores_not_found": "no RegisterInstance within",
    "new_incarnation_on_reregister": "the same process keeps both",
    "no_heartbeats": "0 heartbeat(s)",
    "loaded_by_counter_only": "yet GetStatus names 'v3'",
    "loses_a_slot": "free 3 of 4",
    "collect_accepts_zero_max_groups": "expected INVALID_ARGUMENT, got OK",
    "cancel_drops_finished": "a finished group counted cancelled (1)",
    "batch_accepts_zero_max_groups": "max_groups 0: expected INVALID_ARGUMENT, got OK",
    "batch_returns_at_once": "with none ready: a call waits",
    "batch_ignores_max_groups": "max_groups 1 answered",
    "batch_ignores_acks": "answered by the very call whose ack_group_ids name them",
    "batch_collects_before_acking": "the acknowledged are dropped first",
    "batch_forgets_unacknowledged": "was not answered again",
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Iterator[str]:
    """A WeightService holding version 3 ("v3") of "policy", on its own event loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = await start_weights(
            tmp_path_factory.mktemp("store"), config=StoreConfig(durable=False)
        )
        tensor = ("F32", [4], np.arange(4, dtype=np.float32).tobytes())
        config = {"config.json": json.dumps({"vocab_size": VOCAB_SIZE}).encode()}
        await publish_version(server.address, "policy", "v3", 3, {"w": tensor}, config)
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        yield server.address
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


async def check_switch(switch: str, weights: str) -> dict[str, tuple[str, str]]:
    """The checker's findings on a broken RaaS with `switch` on ("" for none), registering
    with the checker's own Dataflow."""
    # Serving faulty weights takes seconds of the engine's retries: only where it is asked.
    faulty = switch in ("", "skips_verification", "loaded_by_counter_only")
    recording = Recording(interval_s=0.2)  # what it registers with the checker's own Dataflow
    # A bound, not a wait: a result comes in well under a second, but a CI machine under load
    # once took over 5 s, and every check after `collect` was skipped.
    options = CheckOptions(
        result_timeout_s=20.0, weights=weights, version_id="v3", serve_weights=faulty,
        recording=recording, register_timeout_s=10.0,
    )  # fmt: skip
    dataflow = await start_checking_dataflow(recording)
    server, servicer = await start_broken_raas(switch)
    registrar = start_registering(servicer, server, dataflow.address)
    try:
        return {
            r.name: (r.status, r.detail) for r in await RaasChecker(server.address, options).run()
        }
    finally:
        await registrar.stop()
        await server.stop(0)
        await dataflow.stop(0)


@pytest.fixture(scope="module")
def every_switch(weights: str) -> dict[str, dict[str, tuple[str, str]] | BaseException]:
    """Each switch checked once, eight at a time: the checks mostly wait (to see that nothing
    comes twice, or for a result a broken instance never sends), so one after the other they
    took six minutes of CI. What failed is raised by that switch's test."""

    async def every() -> dict[str, dict[str, tuple[str, str]] | BaseException]:
        room = asyncio.Semaphore(8)

        async def one(switch: str) -> dict[str, tuple[str, str]] | BaseException:
            async with room:
                try:
                    return await asyncio.wait_for(check_switch(switch, weights), 90)
                except Exception as exc:  # raised by the switch's own test
                    return exc

        names = sorted(SWITCHES)
        return dict(zip(names, await asyncio.gather(*map(one, names)), strict=True))

    return asyncio.run(every())


@pytest.mark.slow
def test_astra_raas_with_no_switch_passes_every_check(weights: str) -> None:
    got = asyncio.run(asyncio.wait_for(check_switch("", weights), 60))
    assert list(got) == list(CHECKS)
    assert {n: s for n, (s, _) in got.items() if s != "pass"} == {}, got


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first one's share: every switch's check (every_switch)
@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_each_switch_fails_the_check_named_for_it(switch: str, every_switch) -> None:
    got = every_switch[switch]
    if isinstance(got, BaseException):
        raise got
    status, detail = got[CATCHES[switch]]
    assert status == "fail" and SAYS[switch] in detail, (switch, got[CATCHES[switch]])
    assert list(got) == list(CHECKS)  # every other check ran too
    if CATCHES[switch] != "health":
        assert got["health"][0] == "pass"
    if CATCHES[switch] not in ("settles", "status"):
        assert got["submit_rejects_empty"][0] in ("pass", "fail")


def test_every_switch_has_a_docstring_and_a_check_and_an_expected_detail() -> None:
    assert len(SWITCHES) >= 25
    assert set(CATCHES) == set(SWITCHES) == set(SAYS)
    assert set(CATCHES.values()) <= set(CHECKS)
    for name, switch in SWITCHES.items():
        assert switch.__doc__ and "rule" in switch.__doc__, name


def test_an_unknown_switch_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown switch 'nope'.*never_serving"):
        asyncio.run(start_broken_raas("nope"))


@pytest.mark.slow
def test_an_instance_with_groups_in_flight_is_refused_unless_allowed() -> None:
    """The checker never races a live Dataflow: groups it did not submit stop it at once."""

    async def body() -> tuple[str, int]:
        server, servicer = await start_broken_raas("")
        try:
            servicer.store.try_accept([("dataflow/1", 1)])  # a Dataflow's group, running
            with pytest.raises(InstanceInUse) as refused:
                await RaasChecker(server.address, CheckOptions(result_timeout_s=2.0)).run()
            options = CheckOptions(result_timeout_s=2.0, allow_busy=True)
            results = await RaasChecker(server.address, options).run()
            return str(refused.value), len(results)
        finally:
            await server.stop(0)

    message, ran = asyncio.run(body())
    assert "1 groups running" in message and "--allow-busy" in message
    assert ran == len(CHECKS)


def test_the_contract_page_names_every_check_and_every_switch() -> None:
    page = (ROOT / "docs" / "raas-contract.md").read_text()
    named = set(re.findall(r"`([a-z_]+)`", page))
    assert set(CHECKS) <= named, set(CHECKS) - named
    assert "astra raas check" in page and "--allow-busy" in page
