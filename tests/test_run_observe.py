"""`astra run`'s outputs beside metrics.jsonl: the live view (astra.run.view), TensorBoard event
files (astra.run.tboard), plot.png (astra.run.plot), and `astra top` against a real Dataflow."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import logging
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from astra.run import observe, plot, tboard, view
from astra.run.observe import Observer
from astra.run.poller import Throughput
from astra.servers.runtime import GrpcServer
from astra.servers.trainer import SERVICE_NAME as TRAINER_SERVICE
from astra.trainer.v1 import trainer_service_pb2 as trainer_pb
from astra.trainer.v1 import trainer_service_pb2_grpc as trainer_grpc
from tests.conftest import free_port, make_config
from tests.procs import start_dataflow, start_scripted_raas

PNG = b"\x89PNG\r\n\x1a\n"


def snapshot(instances: int = 3) -> dict:
    states = ["ACTIVE", "SUSPECT", "DEAD", "LEFT"]
    return {
        "name": "demo",
        "elapsed_s": 12.3,
        "num_steps": 50,
        "dataflow_address": "127.0.0.1:5555",
        "error": None,
        "dataflow": {
            "gate": "SYNC_BARRIER",
            "gate_reason": "staleness 0.42 > 0.30",
            "staleness": 0.4213,
            "in_flight": 5,
            "buffer_fill": 0.35,
            "buffered": {"policy": 6},
            "versions": {"policy": 7},
            "raas_active": 1,
            "raas_states": {f"raas-{i}": states[i % 4] for i in range(instances)},
            "pool_empty": False,
            "counters": {"dispatched": 40, "groups_done": 33, "consumed_groups": 28},
        },
        "detail": {
            "gate_capacity": 3,
            "policies": {
                "policy": {
                    "buffered": 6,
                    "capacity": 64,
                    "replay": 0,
                    "leased": 4,
                    "target_version": 6,
                    "dropped_in_a_row": 40,
                    "last_drop": "filtered_equal_reward",
                }
            },
            "instances": [
                {
                    "id": f"raas-{i}",
                    "state": states[i % 4],
                    "capacity": 8,
                    "free": 3,
                    "in_flight": 2,
                    "failures": i % 2,
                    "versions": {"policy": 6},
                }
                for i in range(instances)
            ],
            "streams": [
                {
                    "name": "arith",
                    "epoch": 0,
                    "position": 96,
                    "size": 256,
                    "num_epochs": 2,
                    "exhausted": False,
                },
                {"name": "eval", "epoch": 0, "position": 0, "size": 64, "num_epochs": 0},
            ],
        },
        "trainers": {
            "policy": {
                "step": 7,
                "version": 7,
                "loss": 0.0123,
                "metrics": {
                    "accuracy": 0.625,
                    "reward_mean": 0.71,
                    "score": 0.12,
                    "version_gap_mean": 1.5,
                },
            }
        },
        "rates": {"groups_per_s": 2.5, "steps_per_s": {"policy": 0.62}},
        "evals": [
            {"stream": "eval", "version": 0, "mean_reward": 0.5, "complete": True},
            {"stream": "eval", "version": 5, "mean_reward": 0.75, "complete": True},
            {"stream": "eval", "version": 10, "complete": False, "groups_done": 3, "groups": 64},
        ],
    }


def test_frame_shows_every_field() -> None:
    text = view.render_text(snapshot())
    assert "\x1b" not in text and text.isascii()
    for expected in (
        "astra demo",
        "elapsed 12s",
        "gate SYNC_BARRIER (staleness 0.42 > 0.30)",
        "staleness 0.421",
        "buffer fill 35%",
        "in flight 5",
        "admit capacity 3",
        "dispatched 40",
        "trained 28",
        "2.50 groups/s",
        "0.62 steps/s",
        "7/50",  # step of num_steps
        "7 (pool 6)",  # version, and the version the pool is told to load
        "0.0123",  # loss
        "0.62",  # accuracy
        "0.710",  # reward mean
        "6/64 +4 leased",  # buffer
        "policy: the last 40 finished groups were dropped (filtered_equal_reward); no batch",
        "arith: epoch 1/2 record 96/256",
        "RaaS pool: 1 ACTIVE, 1 DEAD, 1 SUSPECT",
        "policy:v6",
        "held-out eval (mean reward) v0 0.50 | v5 0.75 | v10 running 3/64",
    ):
        assert expected in text, f"{expected!r} not in\n{text}"
    assert "eval: epoch" not in text  # an evaluation stream has no epochs to show
    for i, state in enumerate(("ACTIVE", "SUSPECT", "DEAD")):
        line = next(x for x in text.splitlines() if f"raas-{i}" in x)
        assert state in line


def test_frame_is_bounded_and_takes_ids_literally() -> None:
    snap = snapshot(instances=40)
    snap["detail"]["instances"][0]["id"] = "[bold]raas[/bold]"
    text = view.render_text(snap)
    assert "[bold]raas[/bold]" in text
    assert f"... {40 - view.MAX_INSTANCES} more" in text
    assert sum("raas-" in line for line in text.splitlines()) <= view.MAX_INSTANCES


def test_frame_from_an_empty_or_unreachable_snapshot() -> None:
    text = view.render_text({"name": "x", "error": "UNAVAILABLE: connection refused"})
    assert "dataflow unreachable: UNAVAILABLE" in text and "no Dataflow status yet" in text
    # The snapshot of a poller that never reached anything renders too.
    poller = asyncio.run(_poller_snapshot())
    assert "no Dataflow status yet" in view.render_text(poller)


async def _poller_snapshot() -> dict:
    poller = observe.StatusPoller("127.0.0.1:1", {"policy": "127.0.0.1:1"}, show_elapsed=False)
    try:
        return poller.snapshot()
    finally:
        await poller.close()


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_view_prints_log_records_above_the_frame() -> None:
    out = Tty()
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        live = view.LiveView(out)
        live.update(snapshot())
        assert handler.stream is not out  # records go through the live display meanwhile
        logging.getLogger("astra.test").warning("a record while the frame is shown")
        live.update(snapshot())
        live.stop()
        assert handler.stream is out
    finally:
        root.removeHandler(handler)
    text = out.getvalue()
    assert "a record while the frame is shown" in text and "SYNC_BARRIER" in text


def test_throughput_window() -> None:
    t = Throughput(window_s=10.0, maxlen=8)
    assert t.rate("groups") is None
    for i in range(30):
        t.add(float(i), "groups", 2.0 * i)
    assert t.rate("groups") == pytest.approx(2.0)
    assert len(t.samples["groups"]) <= 8
    t.add(31.0, "groups", 0.0)  # a counter that restarted
    assert t.rate("groups") is None


def rows(n: int = 6, policy: str = "policy") -> list[dict]:
    out = []
    for step in range(1, n + 1):
        out.append(
            {
                "time": 1_700_000_000.0 + step,
                "elapsed_s": 1.5 * step,
                "policy": policy,
                "step": step,
                "version": step,
                "loss": 0.5 / step,
                "skipped": None,
                "accuracy": 0.1 * step if step != 3 else None,
                "trainer": None
                if step == 3
                else {
                    "grad_norm": 2.0 + step,
                    "reward_mean": 0.1 * step,
                    "score": 0.05 * step,
                    "version_gap_mean": 0.5,
                    "total_ms": 120.0,
                },
                "dataflow": {
                    "gate": "SYNC_BARRIER" if step == 2 else "ASYNC_RUNNING",
                    "staleness": 0.01 * step,
                    "buffer_fill": 0.25,
                    "in_flight": 4,
                    "buffered": {policy: 3},
                    "versions": {policy: step},
                    "raas_active": 2,
                    "counters": {"consumed_groups": 4 * step},
                },
            }
        )
    return out


def test_crc32c_known_value() -> None:
    assert tboard.crc32c(b"123456789") == 0xE3069283
    assert tboard.crc32c(b"") == 0


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_files_hold_the_rows(tmp_path: Path) -> None:
    sink = tboard.TensorBoardSink(tmp_path / "tensorboard")
    for row in rows():
        sink.write_row(row)
    sink.close()
    files = list((tmp_path / "tensorboard" / "policy").glob("events.out.tfevents.*"))
    assert len(files) == 1
    s = read_scalars(tmp_path / "tensorboard" / "policy")
    assert [st for st, _ in s["loss"]] == [1, 2, 3, 4, 5, 6]
    assert s["loss"][1][1] == pytest.approx(0.25)
    assert [st for st, _ in s["accuracy"]] == [1, 2, 4, 5, 6]  # step 3 had none
    assert s["trainer/grad_norm"][0] == (1, pytest.approx(3.0))
    assert s["trainer/reward_mean"][-1][1] == pytest.approx(0.6)
    assert s["dataflow/staleness"][3][1] == pytest.approx(0.04)
    assert s["dataflow/buffer_fill"][0][1] == pytest.approx(0.25)
    assert [v for _, v in s["dataflow/gate_barrier"]] == [0, 1, 0, 0, 0, 0]
    assert s["dataflow/counters/consumed_groups"][-1][1] == 24
    assert s["trainer/total_ms"][0][1] == pytest.approx(120.0)


def test_plot_is_a_png_of_the_rows(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows(30)) + '{"cut sh')
    series, n = plot.read_series(metrics)
    assert n == 30 and len(series["policy"]["accuracy"]) == 29
    out = plot.write_plot(metrics, tmp_path / "plot.png", title="demo")
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000
    # No rows: still a figure, saying so.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plot.write_plot(empty, tmp_path / "empty.png").read_bytes().startswith(PNG)


def test_a_long_runs_plot_reads_a_bounded_number_of_points(tmp_path: Path, monkeypatch) -> None:
    """Past MAX_POINTS a series keeps every k-th point and its last, evenly spaced."""
    monkeypatch.setattr(plot, "MAX_POINTS", 100)
    metrics = tmp_path / "metrics.jsonl"
    n = 1000
    rows_ = ({"policy": "p", "step": i, "accuracy": i / n} for i in range(1, n + 1))
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    series, read = plot.read_series(metrics)
    points = series["p"]["accuracy"]
    assert read == n and 100 <= len(points) <= 201
    steps = [s for s, _ in points]
    assert steps[0] == 1 and steps[-1] == n  # the first and the last
    gaps = {b - a for a, b in itertools.pairwise(steps[:-1])}  # but to the last
    assert gaps == {8}, gaps  # every 8th (1000 rows, at most 200 kept)
    assert all(v == s / n for s, v in points)  # the values of those rows
    out = plot.write_plot(metrics, tmp_path / "plot.png")
    assert out.read_bytes().startswith(PNG)


def make_observer(tmp_path: Path, **kw) -> Observer:
    log_path = tmp_path / "trainer.log"
    return Observer(
        "127.0.0.1:1",
        {"policy": "127.0.0.1:1"},
        {"policy": (log_path, 0)},
        tmp_path / "metrics.jsonl",
        num_steps=3,
        out=io.StringIO(),
        tensorboard=tmp_path / "tensorboard",
        plot=tmp_path / "plot.png",
        **kw,
    )


def test_observer_rows_go_to_tensorboard_and_the_plot(tmp_path: Path) -> None:
    async def go() -> None:
        obs = make_observer(tmp_path)
        obs.trainer_status["policy"] = {
            "step": 2,
            "version": 2,
            "loss": 0.5,
            "metrics": {"accuracy": 0.75, "grad_norm": 1.0},
        }
        lines = [f"x INFO astra.servers.trainer: step {i} version {i} loss 0.{i}\n" for i in (1, 2)]
        (tmp_path / "trainer.log").write_text("".join(lines))
        obs.read_logs()
        obs.flush()
        obs.print_status(force=True)
        await obs.close()
        await obs.finish()

    asyncio.run(go())
    got = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2] and got[1]["accuracy"] == 0.75
    s = read_scalars(tmp_path / "tensorboard" / "policy")
    assert s["accuracy"] == [(2, 0.75)] and [st for st, _ in s["loss"]] == [1, 2]
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG)


def test_observer_outputs_that_fail_do_not_stop_it(tmp_path: Path, monkeypatch, caplog) -> None:
    def broken(*a, **k):
        raise RuntimeError("broken output")

    monkeypatch.setattr(view, "render", broken)
    monkeypatch.setattr(plot, "write_plot", broken)
    monkeypatch.setattr(tboard.TensorBoardSink, "write_row", broken)

    async def go() -> Observer:
        obs = make_observer(tmp_path, live=True)
        (tmp_path / "trainer.log").write_text("astra.servers.trainer: step 1 version 1 loss 0.1\n")
        obs.read_logs()
        obs.flush()
        obs.print_status(force=True)  # the live view fails: the compact line instead
        obs.print_status(force=True)
        obs.end_line()
        await obs.close()
        await obs.finish()
        return obs

    with caplog.at_level(logging.WARNING, logger="astra.run.observe"):
        obs = asyncio.run(go())
    assert obs.live is None and obs.tensorboard is None
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    failed = [r.getMessage() for r in caplog.records]
    assert any("live view failed" in m for m in failed)
    assert any("TensorBoard event files failed" in m for m in failed)
    assert any("plot.png failed" in m for m in failed)


class _Trainer(trainer_grpc.TrainerServiceServicer):
    """A TrainerService that answers GetStatus with `step`, after `hang_s` (a dying trainer)."""

    def __init__(self, step: int, hang_s: float = 0.0) -> None:
        self.step, self.hang_s = step, hang_s
        self.polled = asyncio.Event()

    async def GetStatus(self, request, context):
        self.polled.set()
        await asyncio.sleep(self.hang_s)
        return trainer_pb.GetStatusResponse(policy_id="policy", step=self.step, version=self.step)


def test_observer_goes_on_when_its_trainer_moves_during_a_poll(tmp_path: Path) -> None:
    """A trainer restarted on a new port (astra.run.restarts calls set_trainer) while a poll of
    the old one was in flight: closing the old channel cancels that call, which must not end
    the observer (it did: no status line, row or stall check for the rest of the run)."""

    async def go() -> None:
        old, new = _Trainer(3, hang_s=60), _Trainer(7)
        servers = []
        for servicer in (old, new):
            server = GrpcServer("127.0.0.1", 0)
            server.add_service(
                trainer_grpc.add_TrainerServiceServicer_to_server, servicer, TRAINER_SERVICE
            )
            await server.start()
            servers.append(server)
        obs = make_observer(tmp_path, poll_interval_s=0.2)
        obs.timeout_s = 120.0  # the hanging poll's deadline never comes first
        obs.set_trainer("policy", servers[0].address)
        old_client = obs.trainers["policy"]
        task = asyncio.create_task(obs.run())
        try:
            await asyncio.wait_for(old.polled.wait(), 10)  # a poll hangs on the old trainer
            await asyncio.sleep(0.2)
            obs.set_trainer("policy", servers[1].address)
            await old_client.close()  # no grace: gRPC cancels the call in flight
            deadline = time.monotonic() + 20
            while obs.trainer_status.get("policy", {}).get("step") != 7:
                assert not task.done(), task
                assert time.monotonic() < deadline, "the new trainer was never polled"
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await obs.close()
            for server in servers:
                await server.stop(0)

    asyncio.run(go())


class _SteppingTrainer(_Trainer):
    """A trainer that takes a step every `every_s` (faster than the observer's ticks): its
    figures first, then its step line, as the real one does."""

    def __init__(self, log_path: Path, every_s: float) -> None:
        super().__init__(0)
        self.log_path, self.every_s = log_path, every_s

    async def steps(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.step += 1
            with self.log_path.open("a") as f:
                f.write(f"x INFO astra.servers.trainer: step {self.step} version 1 loss 0.5\n")

    async def GetStatus(self, request, context):
        resp = await super().GetStatus(request, context)
        resp.metrics["step_of_figures"] = float(resp.step)
        return resp


def test_rows_of_steps_faster_than_a_tick_still_get_the_trainers_figures(tmp_path: Path) -> None:
    """Steps 0.05 s apart, ticks 0.25 s apart: the poll comes right after the log is read, so
    the last step read in a tick gets its figures (read 0.25 s before the poll, almost none
    did: 1 row of 100 in a real run), and a row only ever gets its own step's."""

    async def go() -> None:
        trainer = _SteppingTrainer(tmp_path / "trainer.log", 0.05)
        server = GrpcServer("127.0.0.1", 0)
        server.add_service(
            trainer_grpc.add_TrainerServiceServicer_to_server, trainer, TRAINER_SERVICE
        )
        await server.start()
        obs = make_observer(tmp_path, poll_interval_s=1.0)
        obs.set_trainer("policy", server.address)

        async def no_dataflow() -> dict:  # none here: its poll would stall ticks
            return {}

        obs.poll_dataflow = no_dataflow  # type: ignore[method-assign]
        stepping = asyncio.create_task(trainer.steps())
        task = asyncio.create_task(obs.run())
        try:
            await asyncio.sleep(3.0)
        finally:
            for t in (task, stepping):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await obs.close()
            await server.stop(0)

    asyncio.run(go())
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    with_figures = [r for r in rows if r["trainer"]]
    assert len(rows) >= 20
    assert all(r["trainer"]["step_of_figures"] == r["step"] for r in with_figures)
    assert len(with_figures) >= 4, [r["step"] for r in with_figures]


@pytest.fixture
def dataflow_proc(dataset: Path, tmp_path: Path):
    proc = start_dataflow(make_config(dataset, tmp_path / "state"), tmp_path)
    raas = start_scripted_raas(proc.address, tmp_path, "raas-top")
    try:
        yield proc
    finally:
        raas.close()
        proc.close()


def top(*args: str):
    from astra.cli import main

    return CliRunner().invoke(main, ["top", *args], catch_exceptions=False)


def test_top_once_against_a_running_dataflow(dataflow_proc, tmp_path: Path) -> None:
    deadline = time.monotonic() + 20
    while True:  # until the RaaS has registered
        result = top("--dataflow", dataflow_proc.address, "--once")
        assert result.exit_code == 0, result.output
        if "raas-top" in result.output or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = result.output
    assert "\x1b" not in out
    assert "astra top" in out and f"dataflow {dataflow_proc.address}" in out
    assert "gate " in out and "buffer fill" in out and "groups/s" in out
    assert "RaaS pool: 1 ACTIVE" in out
    assert "raas-top" in out and "ACTIVE" in out
    assert "policy" in out  # the policy row: buffer and version from Dataflow

    # --run-dir: the addresses from run.json (a trainer that is gone shows no figures).
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    children = [
        {"name": "dataflow", "role": "dataflow", "address": dataflow_proc.address},
        {"name": "trainer-policy", "role": "trainer", "address": f"127.0.0.1:{free_port()}"},
    ]
    (run_dir / "run.json").write_text(json.dumps({"children": children}))
    (run_dir / "recipe.yaml").write_text("name: myrun\ntrainer:\n  num_steps: 9\n")
    result = top("--run-dir", str(run_dir), "--once", "--timeout", "1")
    assert result.exit_code == 0, result.output
    assert "astra myrun" in result.output and "raas-top" in result.output


def test_top_once_without_a_dataflow(tmp_path: Path) -> None:
    result = top("--dataflow", f"127.0.0.1:{free_port()}", "--once", "--timeout", "1")
    assert result.exit_code == 1
    assert "dataflow unreachable" in result.output
    assert top("--once").exit_code == 2  # neither --dataflow nor --run-dir
    assert top("--run-dir", str(tmp_path), "--once").exit_code == 2  # no run.json


def test_a_run_is_stalled_only_while_its_buffer_cannot_make_a_batch() -> None:
    from types import SimpleNamespace

    from astra.run.observe import Observer

    def view(n: int, buffered: int, limit: int = 100, obs=None) -> str | None:
        obs = obs or SimpleNamespace(_resumed=False, _drops_before={})
        obs.max_dropped_in_a_row, obs.batch_groups = limit, {"p": 4}
        obs.last_detail = {
            "policies": {"p": {"dropped_in_a_row": n, "last_drop": "failed", "buffered": buffered}}
        }
        return Observer.stalled(obs)

    assert view(99, 0) is None
    why = view(100, 3)
    assert why is not None and why.startswith("stalled: policy p: the last 100 finished groups")
    assert "(the newest: failed)" in why and "supervision.max_dropped_in_a_row: 100" in why
    assert view(100, 4) is None  # a full batch is waiting: batches still form
    assert view(10**6, 0, limit=0) is None  # 0: never
    # A new run counts from 0 whenever its first poll comes (RaaS may have dropped a lot by then).
    late = SimpleNamespace(_resumed=False, _drops_before={})
    assert view(400, 0, obs=late) is not None
    # A resumed run (Dataflow kept its run of drops) counts from where it resumed.
    resumed = SimpleNamespace(_resumed=True, _drops_before={})
    assert view(150, 0, obs=resumed) is None and view(249, 0, obs=resumed) is None
    assert view(250, 0, obs=resumed) is not None
    assert view(5, 0, obs=resumed) is None  # a group kept since: a new run, from 0
    assert view(100, 0, obs=resumed) is not None


def test_a_run_is_out_of_data_only_while_a_trainer_with_steps_left_cannot_get_a_batch() -> None:
    from types import SimpleNamespace

    from astra.run.observe import Observer

    def view(reason: str, buffered: int, leased: int = 0, step: int = 3, held_s: float = 5.0):
        obs = SimpleNamespace(num_steps=10, batch_groups={"p": 4}, poll_interval_s=1.0)
        obs.last_dataflow = {"gate_reason": reason}
        obs.last_detail = {"policies": {"p": {"buffered": buffered, "leased": leased}}}
        obs.trainer_status = {"p": {"step": step}}
        obs._short_since = {"p": (step, time.monotonic() - held_s)}
        return Observer.exhausted(obs)

    gone = "training data exhausted: every training stream ran its num_epochs"
    why = view(gone, 3)
    assert why is not None and why.startswith("stalled: training data exhausted")
    assert view(gone, 3, held_s=0.5) is None  # not yet: the trainer may have just finished
    assert "policy p is at step 3 of 10 with 3 groups buffered, less than a batch of 4" in why
    assert view("admitting: capacity 8", 0) is None  # data left: groups still come
    assert view(gone, 4) is None  # a batch is waiting
    assert view(gone, 0, leased=4) is None  # a batch is being trained
    assert view(gone, 0, step=10) is None  # the trainer is done


def test_every_row_has_its_steps_accuracy_from_the_step_line(tmp_path: Path) -> None:
    """Steps shorter than a poll: no GetStatus saw steps 1 and 3, their rows still carry the
    accuracy the trainer logged with the step (text and JSON log lines, skipped or not)."""

    async def go() -> None:
        obs = make_observer(tmp_path)
        obs.trainer_status["policy"] = {"step": 2, "version": 2, "metrics": {"accuracy": 0.5}}
        lines = [
            "x INFO astra.servers.trainer: step 1 version 1 loss 0.1  reward_mean=0.25\n",
            "x INFO astra.servers.trainer: step 2 version 2 loss 0.2  reward_mean=0.5\n",
            '{"logger": "astra.servers.trainer", "msg": "step 3 version 3 loss 0.3 '
            'NONFINITE_LOSS accuracy=0.875"}\n',
            "x INFO astra.servers.trainer: step 4 version 4 loss 0.4 \n",
            # a refused batch: no loss (the supervisor used to fail on every tick on it)
            "x INFO astra.servers.trainer: step 5 version 4 loss None TOKEN_OUT_OF_RANGE\n",
        ]
        (tmp_path / "trainer.log").write_text("".join(lines))
        obs.read_logs()
        obs.flush()
        await obs.close()
        await obs.finish()

    asyncio.run(go())
    got = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["accuracy"]) for r in got][:4] == [
        (1, 0.25), (2, 0.5), (3, 0.875), (4, None)
    ]  # fmt: skip
    assert (got[4]["loss"], got[4]["skipped"]) == (None, "TOKEN_OUT_OF_RANGE")
    assert got[2]["skipped"] == "NONFINITE_LOSS" and got[1]["trainer"] == {"accuracy": 0.5}


def test_observer_reads_on_from_the_top_after_its_log_was_rotated(tmp_path: Path) -> None:
    """astra.run.logrotate copies a trainer's log aside and empties it: the observer, which
    reads the step lines from an offset, starts again at the top (with a partial line
    dropped), called just before the truncation so nothing read-worthy is left behind."""
    from astra.run.logrotate import rotate

    async def go() -> Observer:
        obs = make_observer(tmp_path)
        log = tmp_path / "trainer.log"
        step = "x INFO astra.servers.trainer: step {0} version {0} loss 0.{0}\n"
        with log.open("ab") as f:  # one writer, appending, as a child does
            f.write(("padding " * 40 + "\n").encode() + step.format(1).encode())
            f.flush()
            obs.read_logs()
            f.write(step.format(2).encode() + b"x INFO astra.servers.tr")  # a line half-written
            f.flush()
            assert rotate(log, 100, 1, lambda _p: obs.read_logs())
            f.write(step.format(3).encode())
            f.flush()
            obs.read_logs()
        await obs.close()
        await obs.finish()
        return obs

    obs = asyncio.run(go())
    assert [p[1] for p in obs.pending] == [1, 2, 3]


def test_observer_reads_what_came_before_a_rotation_it_was_not_told_of(tmp_path: Path) -> None:
    """A trainer placed by Ray: its actor rotates the log on the trainer's node without
    telling the observer, which finds the lines it had not read in the copy."""
    from astra.run.logrotate import rotate

    async def go() -> Observer:
        obs = make_observer(tmp_path)
        log = tmp_path / "trainer.log"
        step = "x INFO astra.servers.trainer: step {0} version {0} loss 0.{0}\n"
        with log.open("ab") as f:
            f.write(("padding " * 40 + "\n").encode() + step.format(1).encode())
            f.flush()
            obs.read_logs()
            f.write(step.format(2).encode() + b"x INFO astra.servers.trainer: st")
            f.flush()
            assert rotate(log, 100, 1)  # no reader called
            f.write(b"ep 3 version 3 loss 0.3\n")  # the rest of the half-written line
            f.flush()
            obs.read_logs()
            f.write(step.format(4).encode())
            f.write(b"x INFO astra.servers.trainer: step 8")  # half a line, then lines lost:
            f.flush()
            obs.read_logs()
            f.write(b" version 8 loss 0.8\n" + step.format(9).encode()[:-1])
            f.flush()
            assert rotate(log, 10, 0)  # no copies kept: what came before is gone
            # Had the half line been kept, "step 8" + the rest of step 9 would be a row.
            f.write(b" version 9 loss 0.9\n" + step.format(5).encode())
            f.flush()
            obs.read_logs()
            for n in (6, 7):  # read on from there, each line once
                f.write(step.format(n).encode())
                f.flush()
                obs.read_logs()
        await obs.close()
        await obs.finish()
        return obs

    obs = asyncio.run(go())
    assert [p[1] for p in obs.pending] == [1, 2, 3, 4, 5, 6, 7]


def test_a_run_ends_once_every_raas_has_failed_to_load_the_weights_for_long() -> None:
    from types import SimpleNamespace

    from astra.run.observe import Observer

    def view(failures: dict[str, int], limit: int = 20, states=None) -> str | None:
        obs = SimpleNamespace(max_load_failures_in_a_row=limit)
        counters = {f"weight_load_failing.{i}": n for i, n in failures.items() if n}
        reason = "waiting; weight loads failing on r0 (20 in a row: VERSION_BAD: v7 is bad)"
        obs.last_dataflow = {"counters": counters, "gate_reason": reason}
        states = states or dict.fromkeys(failures, "ACTIVE")
        obs.last_detail = {"instances": [{"id": i, "state": s} for i, s in states.items()]}
        return Observer.loads_failing(obs)

    why = view({"r0": 20, "r1": 25})
    assert why is not None and why.startswith("failed: every RaaS fails to load the new weights")
    assert "VERSION_BAD: v7 is bad" in why and "max_load_failures_in_a_row: 20" in why
    assert view({"r0": 20, "r1": 3}) is None  # one still loads now and then
    assert view({"r0": 20, "r1": 0}) is None
    assert view({"r0": 20, "r1": 0}, states={"r0": "ACTIVE", "r1": "DEAD"}) is not None
    assert view({"r0": 10**6}, limit=0) is None  # 0: wait forever
    assert view({}) is None  # no RaaS at all: another condition


def test_observer_reads_a_generation_written_and_rotated_while_it_looked_away(
    tmp_path: Path,
) -> None:
    """The observer saw the log empty just after a rotation; before it looked again the
    trainer wrote a whole generation and the actor rotated it too (steps every 30 ms, logs of
    512 bytes under Ray). That generation was skipped: its lines are in the newest copy."""
    from astra.run.logrotate import rotate

    async def go() -> Observer:
        obs = make_observer(tmp_path)
        log = tmp_path / "trainer.log"
        step = "x INFO astra.servers.trainer: step {0} version {0} loss 0.{0}\n"
        with log.open("ab") as f:
            f.write(("padding " * 40 + "\n").encode() + step.format(1).encode())
            f.flush()
            obs.read_logs()
            f.write(step.format(2).encode())
            f.flush()
            assert rotate(log, 100, 5)
            obs.read_logs()  # the copy's rest (step 2); the file itself is empty now
            f.write(step.format(3).encode() + ("padding " * 20 + "\n").encode())
            f.flush()
            assert rotate(log, 100, 5)  # a whole generation the observer never saw
            f.write(step.format(4).encode())
            f.flush()
            obs.read_logs()
            f.write(step.format(5).encode())
            f.flush()
            obs.read_logs()
        await obs.close()
        await obs.finish()
        return obs

    obs = asyncio.run(go())
    assert [p[1] for p in obs.pending] == [1, 2, 3, 4, 5]


STEP = "x INFO astra.servers.trainer: step {0} version {0} loss 0.{0}\n"


def _steps(f, *steps: int, padding: int = 0) -> None:
    f.write(("".join(STEP.format(n) for n in steps) + "padding " * padding + "\n").encode())
    f.flush()


def test_observer_reads_the_generations_rotated_away_before_its_first_look(tmp_path: Path) -> None:
    """A trainer's first generations (fast steps, small logs under Ray) rotated before the
    observer first looked at its log: they are in the copies made since the trainer started,
    read before the file itself (steps 1-4 were lost: the blind spot of the first generation)."""
    from astra.run.logrotate import copy_ids, rotate

    log = tmp_path / "trainer.log"

    async def go() -> Observer:
        obs = make_observer(tmp_path)  # before the trainer writes: no copies to leave out
        with log.open("ab") as f:
            _steps(f, 1, 2, padding=20)
            assert rotate(log, 100, 5)
            _steps(f, 3, 4, padding=20)
            assert rotate(log, 100, 5)
            _steps(f, 5)
            obs.read_logs()  # the first look
            _steps(f, 6, padding=20)
            assert rotate(log, 100, 5)  # from here on, as before
            _steps(f, 7)
            obs.read_logs()
        await obs.close()
        await obs.finish()
        return obs

    assert [p[1] for p in asyncio.run(go()).pending] == [1, 2, 3, 4, 5, 6, 7]

    # A resumed run: the log and a copy hold an earlier start's steps. Rotated away before the
    # first look: this start's lines from where it began (its offset), the earlier ones not.
    later = tmp_path / "resumed"
    later.mkdir()
    log = later / "trainer.log"
    with log.open("ab") as f:
        _steps(f, 1, 2, padding=20)
        assert rotate(log, 100, 5)
        _steps(f, 3)  # the earlier start ends here
        offset, known = f.tell(), copy_ids(log)

        async def resumed() -> Observer:
            obs = make_observer(later)
            obs.logs["policy"][1] = offset  # what the supervisor passes: (path, offset, known)
            obs.logs["policy"][5] = known
            _steps(f, 4, padding=20)
            assert rotate(log, 100, 5)  # the earlier copy shifts to .2: still left out
            _steps(f, 5)
            obs.read_logs()
            await obs.close()
            await obs.finish()
            return obs

        assert [p[1] for p in asyncio.run(resumed()).pending] == [4, 5]


def test_observer_waits_out_a_rotation_under_way_at_its_first_look(tmp_path: Path) -> None:
    """First look in the instant between a rotation's truncation and its copy's rename: the
    lines are only in the copy being made. The observer looks again once it is a copy."""
    from astra.run.logrotate import _bulk, backup

    log = tmp_path / "trainer.log"

    async def go() -> tuple[list[int], list[int]]:
        obs = make_observer(tmp_path)
        with log.open("ab") as f:
            _steps(f, 1, 2, padding=20)
            tmp = log.with_name(f".{log.name}.rotating")
            _bulk(log, tmp)
            os.truncate(log, 0)  # truncated, the copy not yet renamed
            obs.read_logs()
            during = [p[1] for p in obs.pending]
            os.replace(tmp, backup(log, 1))
            _steps(f, 3)
            obs.read_logs()
        await obs.close()
        await obs.finish()
        return during, [p[1] for p in obs.pending]

    assert asyncio.run(go()) == ([], [1, 2, 3])
