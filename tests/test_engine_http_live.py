"""The live vLLM swap's bookkeeping without a server: the worker extension's split and its
record of dropped requests (on a stand-in worker), and the adapter's per-token labels.

tests/test_vllm_real.py runs the same path on a real vLLM."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from astra.engine.api import Generation, Sampling
from astra.engine.http import WeightsDir
from astra.engine.http.base import HTTPEngine
from astra.engine.http.result import Segment
from astra.engine.http.swap import token_versions
from astra.engine.http.vllm_ext import astra_vllm_ext as ext
from astra.engine.http.vllm_live import commit_body, engine_request_id, splits_of
from astra.engine.tokenizer import CharTokenizer


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


class StubClient:
    """Answers each segment when the test says so (by the order segments were sent)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, asyncio.Future[dict[str, Any]]]] = []

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.sent.append((body["rid"], answer))
        return await answer

    def answer(self, i: int, n: int) -> None:
        self.sent[i][1].set_result({"ids": [40] * n})

    async def close(self) -> None:
        pass


class LiveStub(HTTPEngine):
    """The live swap's adapter half, with the server's half in the test's hands."""

    swappable = True

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9", "p", CharTokenizer())
        self.client = StubClient()  # type: ignore[assignment]
        self.release = asyncio.Event()
        self.splits: dict[int, int] = {}  # segment index -> tokens before the copy

    def _segment_request(
        self, context: list[int], sampling: Sampling, max_new: int, rid: str
    ) -> tuple[str, dict[str, Any]]:
        return "/generate", {"rid": rid}

    def _parse_segment(self, answer: Any, sampling: Sampling) -> Segment:
        return Segment(answer["ids"], [0.0] * len(answer["ids"]), "length")

    def _live(self, path: Path) -> bool:
        return True

    async def _commit_live(self, path: Path, version: int, rids: list[str]) -> dict[str, int]:
        await self.release.wait()
        order = [rid for rid, _ in self.client.sent]  # type: ignore[attr-defined]
        return {order[i]: k for i, k in self.splits.items() if order[i] in rids}


def test_a_live_swap_labels_each_segment_at_its_split_and_holds_new_ones_back(
    tmp_path: Path,
) -> None:
    """Segment 0 is split at 4; segment 1 the server never saw (all new); segment 2 answers
    while the commit is under way and is labelled only once the split is known (it had
    finished: all old); a request made during the commit waits at the gate, then is all
    new; the gate-closed span is what swap_pause_s counts."""

    async def body() -> tuple[list[Generation], LiveStub]:
        engine = LiveStub()
        client: StubClient = engine.client  # type: ignore[assignment]
        sampling = Sampling(max_new_tokens=10)
        running = [asyncio.create_task(engine.generate("p", [40], sampling)) for _ in range(3)]
        await asyncio.sleep(0.01)
        engine.splits = {0: 4, 2: 10}
        swap = asyncio.create_task(engine.swap_weights({"p": 1}, {"p": WeightsDir(tmp_path)}))
        await asyncio.sleep(0.01)
        late = asyncio.create_task(engine.generate("p", [40], sampling))
        client.answer(2, 10)  # back during the commit
        await asyncio.sleep(0.01)
        assert engine.stats()["waiting"] == 1 and len(client.sent) == 3
        assert not running[2].done()  # its labels wait for the split
        engine.release.set()
        await swap
        await asyncio.sleep(0.01)
        client.answer(0, 10)
        client.answer(1, 10)
        client.answer(3, 10)
        gens = [*(await asyncio.gather(*running)), await late]
        assert engine.last_swap.keys() == {"stage", "commit"} and engine.swap_pause_s > 0
        return gens, engine

    gens, engine = asyncio.run(asyncio.wait_for(body(), 10))
    assert gens[0].versions == [0] * 4 + [1] * 6
    assert gens[1].versions == [1] * 10
    assert gens[2].versions == [0] * 10
    assert gens[3].versions == [1] * 10
    assert all(g.meta["segments"] == 1 for g in gens) and engine.version("p") == 1
