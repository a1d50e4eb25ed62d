"""The live vLLM swap's bookkeeping without a server: the worker extension's split and its
record of dropped requests (on a stand-in worker), and the adapter's per-token labels.

tests/test_vllm_real.py runs the same path on a real vLLM."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from astra.engine.http.base import token_versions
from astra.engine.http.vllm_ext import astra_vllm_ext as ext
from astra.engine.http.vllm_live import commit_body, engine_request_id, splits_of


class Runner:
    """What the extension reads of vLLM 0.32's V1 model runner."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.removed: list[str] = []
        self.model_config = SimpleNamespace(hf_text_config=SimpleNamespace())

    def _on_request_state_removed(self, req_id: str, req_state: Any) -> None:
        self.removed.append(req_id)

    def drop(self, req_id: str) -> None:  # as _update_states does for a finished request
        self._on_request_state_removed(req_id, self.requests.pop(req_id, None))

    def get_model(self) -> Any:
        return SimpleNamespace()  # no lm_head: nothing to repair


class Worker(ext.AstraWorkerExtension):
    def __init__(self, *, async_scheduling: bool = False) -> None:
        self.model_runner = Runner()
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
            max_concurrent_batches=1,
        )
        self.loaded: list[str] = []

    def reload_weights(self, weights_path: str) -> None:
        self.loaded.append(weights_path)


def state(tokens: int) -> Any:
    return SimpleNamespace(output_token_ids=[7] * tokens)


def test_the_commit_reports_running_and_dropped_requests_and_leaves_out_unseen_ones() -> None:
    worker = Worker()
    assert worker.astra_track_requests() == {"live": True, "why": None}
    runner = worker.model_runner
    runner.requests = {"cmpl-a-0-1a2b3c4d": state(5), "cmpl-b-0-99999999": state(3)}
    runner.drop("cmpl-b-0-99999999")  # finished before the copy: its final count is kept
    runner.drop("cmpl-z-0-00000000")  # aborted before it was scheduled: no state, no record
    assert runner.removed == ["cmpl-b-0-99999999", "cmpl-z-0-00000000"]  # vLLM's hook still runs
    runner.requests["cmpl-other-0-abcdefgh"] = state(9)  # not the adapter's
    wanted = json.dumps(["cmpl-a-0", "cmpl-b-0", "cmpl-c-0", "cmpl-z-0"])
    report = worker.astra_commit_live("/w", wanted)
    assert report["splits"] == {"cmpl-a-0": 5, "cmpl-b-0": 3}
    assert report["finished"] == ["cmpl-b-0"]
    assert worker.loaded == ["/w"] and report["staged"] is False
    assert worker.astra_track_requests()["live"]  # a second call keeps the one record
    runner.drop("cmpl-a-0-1a2b3c4d")
    assert worker.astra_commit_live("/w", json.dumps(["cmpl-a-0"]))["splits"] == {"cmpl-a-0": 5}


def test_a_worker_with_async_scheduling_says_it_cannot_swap_live() -> None:
    worker = Worker(async_scheduling=True)
    answer = worker.astra_track_requests()
    assert not answer["live"] and "async scheduling" in answer["why"]
    with pytest.raises(RuntimeError, match="astra_track_requests"):
        worker.astra_commit_live("/w", "[]")


def test_the_record_of_dropped_requests_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ext, "FINISHED_KEPT", 2)
    worker = Worker()
    worker.astra_track_requests()
    for i in range(3):
        worker.model_runner.requests[f"cmpl-{i}-0-0000000{i}"] = state(i)
        worker.model_runner.drop(f"cmpl-{i}-0-0000000{i}")
    splits = worker.astra_commit_live("/w", json.dumps([f"cmpl-{i}-0" for i in range(3)]))
    assert splits["splits"] == {"cmpl-1-0": 1, "cmpl-2-0": 2}


def test_vllms_internal_id_maps_back_to_the_external_one() -> None:
    assert ext.external_id("cmpl-astra-ab12-0-1a2b3c4d") == "cmpl-astra-ab12-0"
    assert ext.external_id("cmpl-astra-ab12-0") == "cmpl-astra-ab12-0"  # no random part
    assert engine_request_id("astra-ab12") == "cmpl-astra-ab12-0"


def test_splits_of_reads_the_workers_reports_by_the_adapters_ids() -> None:
    body = commit_body("/w", ["r1", "r2"])
    assert json.loads(body["kwargs"]["request_ids"]) == ["cmpl-r1-0", "cmpl-r2-0"]
    reports = [{"splits": {"cmpl-r1-0": 4, "cmpl-x-0": 1}}, {"splits": {"cmpl-r1-0": 3}}]
    assert splits_of(reports, ["r1", "r2"]) == {"r1": 3}
    with pytest.raises(ValueError, match="without splits"):
        splits_of([{"staged": True}], ["r1"])


def test_each_token_takes_the_version_of_the_last_split_at_or_before_it() -> None:
    assert token_versions([(0, 3)], 4) == [3, 3, 3, 3]
    assert token_versions([(0, 3), (2, 4)], 5) == [3, 3, 4, 4, 4]
    assert token_versions([(0, 3), (0, 4)], 2) == [4, 4]  # unseen at the copy: all new
    assert token_versions([(0, 3), (9, 4)], 3) == [3, 3, 3]  # finished before: all old
    assert token_versions([(0, 3), (1, 4), (2, 5)], 4) == [3, 4, 5, 5]  # two swaps
    assert token_versions([(0, 3), (2, 4)], 0) == []
