"""The Trainer loop on the tiny model with an in-memory source and sink: steps, versions,
bad input, non-finite losses, checkpoints and exact resume."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from astra.common.arrays import to_array
from astra.config import ConfigError, load_config
from astra.engine.tiny import tiny_model
from astra.trainer.checkpoint import list_checkpoints, read_checkpoint
from astra.trainer.config import TrainerConfig
from astra.trainer.loop import Trainer
from astra.trainer.parallel import full_state
from astra.trainer.synthetic import MemorySink, SyntheticSource


def config(**over) -> TrainerConfig:
    raw = {
        "policy_id": "p",
        "port": None,
        "optim": {"lr": 1e-3},
        "batch": {"num_groups": 2, "max_tokens_per_microbatch": 48},
    }
    raw.update(over)
    return TrainerConfig.model_validate(raw)


def trainer(cfg: TrainerConfig | None = None, **kw) -> tuple[Trainer, SyntheticSource, MemorySink]:
    source = kw.pop("source", None) or SyntheticSource("p", vocab_size=100, max_lag=1, **kw)
    sink = MemorySink()
    return Trainer(cfg or config(), source=source, sink=sink), source, sink


def as_bytes(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in state.items()}


def test_steps_publish_every_version_in_order_and_ack_each_batch() -> None:
    t, source, sink = trainer()
    results = list(t.run_training(3))
    assert [r.step for r in results] == [1, 2, 3] and [r.version for r in results] == [1, 2, 3]
    for r in results:
        assert not r.skipped and math.isfinite(r.training_result.loss)
        assert r.batch_size == r.num_trajectories == 8 and r.staleness_metrics.num_tokens > 0
        assert {"loss", "grad_norm", "clip_fraction", "kl_behaviour_current"} <= set(r.metrics)
    assert results[-1].staleness_metrics.version_gap_max <= 1
    for k in ("fetch", "total"):  # summed over the steps so far
        sums = [r.metrics[f"{k}_s_sum"] for r in results]
        assert sums[-1] == pytest.approx(sum(r.metrics[f"{k}_ms"] for r in results) / 1e3)
        assert sums == sorted(sums) and sums[0] > 0
    assert source.announced == [(v, str(v)) for v in range(4)]  # version 0 = initial weights
    assert source.acked == [f"b-trainer-v{v}-a0" for v in (1, 2, 3)]
    stored = {k: b for k, (_, _, b) in sink.versions[3].items()}
    assert stored == as_bytes(full_state(t.model))  # the published bytes are the weights
    stats = t.get_statistics()
    assert stats["step"] == 3 and stats["publisher"]["announced"] == 4
    assert 0 <= stats["publish_blocked_fraction"] < 1
    t.close()


def test_a_bad_batch_is_counted_acked_and_skipped_then_training_goes_on() -> None:
    def poison(request_id, trajectories):
        if request_id == "trainer-v2-a0":
            seq = trajectories[1].sequences[0]
            n = seq.token_ids.shape[0]
            seq.logprobs.CopyFrom(to_array(np.full(n, np.nan, np.float32)))

    t, source, sink = trainer(mutate=poison)
    results = list(t.run_training(3))
    assert [r.skipped for r in results] == ["", "NAN_LOGPROB", ""]
    assert results[1].training_result is None and results[1].version == 1
    assert source.acked == ["b-trainer-v1-a0", "b-trainer-v2-a0", "b-trainer-v2-a1"]
    assert source.untrained == {"b-trainer-v2-a0": "NAN_LOGPROB"}  # Dataflow frees its slots
    assert t.counters["batches_rejected"] == 1 and t.counters["skipped_NAN_LOGPROB"] == 1
    assert sorted(sink.versions) == [0, 1, 2]
    t.close()


def test_a_non_finite_loss_applies_and_publishes_nothing() -> None:
    def overflow(request_id, trajectories):
        if request_id == "trainer-v2-a0":  # ratio exp(logp + 3e38) overflows
            seq = trajectories[0].sequences[0]
            seq.logprobs.CopyFrom(to_array(np.full(seq.token_ids.shape[0], -3e38, np.float32)))

    t, source, sink = trainer(config(loss={"kind": "ppo"}), mutate=overflow)
    first = next(iter(t.run_training(1)))
    before = as_bytes(full_state(t.model))
    second = next(iter(t.run_training(1)))
    assert second.skipped == "NON_FINITE_LOSS" and not second.training_result.applied
    assert second.version == first.version == 1 and sorted(sink.versions) == [0, 1]
    assert as_bytes(full_state(t.model)) == before
    third = next(iter(t.run_training(1)))
    assert third.version == 2 and not third.skipped and t.counters["skipped_NON_FINITE_LOSS"] == 1
    assert source.untrained == {"b-trainer-v2-a0": "NON_FINITE_LOSS"}
    t.close()


def test_the_loop_waits_out_a_batch_that_is_not_ready() -> None:
    t, source, _ = trainer()
    source.not_ready = 3
    (r,) = list(t.run_training(1))
    assert r.version == 1 and t.counters["fetch_waits"] == 3
    t.close()


def test_a_trainer_kept_waiting_for_a_batch_says_why(monkeypatch, caplog) -> None:
    """Waits show at INFO once per WAIT_LOG_EVERY_S with the source's reason (Dataflow's why()),
    so a trainer that stopped training tells which condition holds it."""
    from astra.trainer import feed

    monkeypatch.setattr(feed, "WAIT_LOG_EVERY_S", 0.0)
    t, source, _ = trainer()
    source.not_ready = 2
    with caplog.at_level(logging.INFO, logger="astra.trainer.feed"):
        (r,) = list(t.run_training(1))
    said = [m.getMessage() for m in caplog.records if "no batch for version" in m.getMessage()]
    assert len(said) == 2 and all("synthetic: not ready" in m for m in said), said
    assert r.version == 1
    t.close()


def test_bf16_compute_keeps_fp32_masters_so_updates_below_bf16_spacing_accumulate() -> None:
    # AdamW moves each weight by ~lr per step: 1e-4 is below half the bf16 spacing of a norm
    # weight near 1.0 (2^-8), so bf16 parameters updated in place would never move.
    t, _, sink = trainer(config(dtype="bfloat16", optim={"lr": 1e-4}))
    list(t.run_training(3))
    before = tiny_model().hf_state_dict()
    after = full_state(t.model)
    assert {v.dtype for v in after.values()} == {torch.float32}  # the masters
    moved = {n: float((v != before[n]).float().mean()) for n, v in after.items()}
    assert min(moved.values()) > 0.9, moved
    assert any("norm" in n for n in moved)
    assert all(d == "BF16" for d, _, _ in sink.versions[3].values())  # published in bf16
    t.close()


def _run(cfg: TrainerConfig, steps: int, source: SyntheticSource, sink: MemorySink):
    t = Trainer(cfg, source=source, sink=sink)
    losses = [r.training_result.loss for r in t.run_training(steps)]
    return t, losses


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path: Path) -> None:
    cfg = config(checkpoint={"dir": str(tmp_path / "a"), "keep_last": 2, "every_steps": 1})
    full, losses = _run(cfg, 4, SyntheticSource("p", vocab_size=100, max_lag=1), MemorySink())
    final = as_bytes(full_state(full.model))
    assert [p.name for p in list_checkpoints(tmp_path / "a")] == [
        "step-000000003",
        "step-000000004",
    ]
    full.close()

    root = tmp_path / "b"
    source, sink = SyntheticSource("p", vocab_size=100, max_lag=1), MemorySink()
    first, head = _run(config(checkpoint={"dir": str(root)}), 2, source, sink)
    path = first.save_checkpoint()
    first.close()
    (root / ".tmp-step-000000009").mkdir()  # a crash mid-write leaves only a temporary
    ckpt = read_checkpoint(path)
    assert ckpt.trainer["step"] == ckpt.trainer["version"] == 2
    assert (path / "model" / "config.json").is_file() and ckpt.optimizer["state"]
    resumed_cfg = config(checkpoint={"dir": str(root), "resume": True})
    second, tail = _run(resumed_cfg, 2, source, sink)
    assert head + tail == losses  # bit-identical: same batches, same optimiser state
    assert as_bytes(full_state(second.model)) == final
    assert second.version == 4 and sorted(sink.versions) == [0, 1, 2, 3, 4]
    second.save_checkpoint()
    assert not (root / ".tmp-step-000000009").exists()
    second.close()


def test_resume_takes_the_configured_learning_rate_and_keeps_the_moments(tmp_path: Path) -> None:
    source, sink = SyntheticSource("p", vocab_size=100, max_lag=1), MemorySink()
    first, _ = _run(config(checkpoint={"dir": str(tmp_path)}), 2, source, sink)
    first.save_checkpoint()
    first.close()
    calmer = config(checkpoint={"dir": str(tmp_path), "resume": True}, optim={"lr": 1e-5})
    second = Trainer(calmer, source=source, sink=sink)
    (result,) = list(second.run_training(1))
    assert result.metrics["lr"] == 1e-5  # not the checkpoint's 1e-3
    steps = {float(v["step"]) for v in second.optimizer.state.values()}
    assert steps == {3.0}  # Adam's state came back: 2 steps before the checkpoint, 1 after
    second.close()


def test_versions_stay_monotonic_when_services_are_ahead_of_the_checkpoint() -> None:
    source, sink = SyntheticSource("p", vocab_size=100), MemorySink()
    source.version = 5
    sink.versions = {5: {}, 6: {}}  # published 6, died before announcing it
    t = Trainer(config(), source=source, sink=sink)
    (r,) = list(t.run_training(1))
    assert source.announced[0] == (6, "6") and r.version == 7
    assert source.acked == ["b-trainer-v7-a0"]
    t.close()


def test_checkpoint_requests_are_idempotent_by_request_id(tmp_path: Path) -> None:
    async def body() -> None:
        t, _, _ = trainer(config(checkpoint={"dir": str(tmp_path)}))
        await t.initialize()
        first = await t.checkpoint_async("r1")
        await t.train_step_async()
        again = await t.checkpoint_async("r1")
        other = await t.checkpoint_async("r2")
        assert first == again and first[1] == 0 and other[1] == 1
        await t.shutdown()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_config_refuses_unknown_keys_and_inconsistent_settings(tmp_path: Path) -> None:
    path = tmp_path / "trainer.yaml"
    path.write_text("policy_id: p\nloss:\n  kind: ppo\n  clip_hgih: 0.3\n")
    with pytest.raises(ConfigError, match="clip_hgih"):
        load_config(TrainerConfig, path, env_prefix="ASTRA_TRAINER")
    with pytest.raises(ValueError, match="reference_model"):
        config(loss={"kl_coef": 0.1})
    with pytest.raises(ValueError, match="policy_id"):
        config(policy_id="bad/name")


def test_kl_to_the_initial_weights_is_zero_at_first_and_grows() -> None:
    cfg = config(reference_model="initial", loss={"kl_coef": 0.1, "entropy_coef": 0.01})
    t, _, _ = trainer(cfg)
    results = list(t.run_training(3))
    assert results[0].metrics["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert results[-1].metrics["kl_ref"] > 0 and results[-1].metrics["entropy"] > 0
    t.close()


class FlakyAcks(SyntheticSource):
    """Dataflow unreachable for the first `down` AckBatch calls; refuses batch ids in `refuse`."""

    def __init__(self, *args, down: int = 0, refuse: tuple[str, ...] = (), **kw) -> None:
        super().__init__(*args, **kw)
        self.down, self.refuse, self.ack_calls = down, refuse, 0

    async def ack(self, batch_id: str, untrained_reason: str = "") -> None:
        from astra.errors import FailedPrecondition, Unavailable

        self.ack_calls += 1
        if self.down:
            self.down -= 1
            raise Unavailable("dataflow restarting", reason="DATAFLOW_UNREACHABLE")
        if batch_id in self.refuse:
            raise FailedPrecondition("lease expired", reason="BATCH_LEASE_EXPIRED")
        await super().ack(batch_id)


def test_an_ack_lost_while_dataflow_is_down_is_retried_so_no_batch_is_served_twice() -> None:
    source = FlakyAcks("p", vocab_size=100, max_lag=1, down=3)
    t, _, _ = trainer(source=source)
    results = list(t.run_training(2))
    assert [r.step for r in results] == [1, 2]
    assert source.acked == ["b-trainer-v1-a0", "b-trainer-v2-a0"], "each batch acknowledged"
    assert t.counters["ack_retries"] == 3 and t.counters["ack_failures"] == 0
    t.close()


def test_an_ack_refused_by_dataflow_is_counted_not_retried() -> None:
    source = FlakyAcks("p", vocab_size=100, max_lag=1, refuse=("b-trainer-v1-a0",))
    t, _, _ = trainer(source=source)
    results = list(t.run_training(2))
    assert [r.step for r in results] == [1, 2], "the step stands; training goes on"
    assert source.ack_calls == 2 and t.counters["ack_failures"] == 1
    assert t.counters["ack_retries"] == 0
    t.close()


def test_dataflow_source_reports_an_unreachable_dataflow_as_unavailable() -> None:
    import socket

    from astra.clients.trainer_sources import DataflowSource
    from astra.errors import Unavailable

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def body() -> None:
        source = DataflowSource(
            f"127.0.0.1:{port}", "p", trainer_id="t", weights_address="127.0.0.1:1"
        )
        try:
            with pytest.raises(Unavailable) as err:
                await source.ack("b-1")
            assert err.value.reason == "DATAFLOW_UNREACHABLE"
        finally:
            await source.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_overlapping_checkpoint_requests_each_get_one_answer() -> None:
    """SaveCheckpoint twice while paused, the second while the first is written: each gets a
    checkpoint, none an error (a second answer to the first request's future raised)."""
    from astra.trainer.state import StateMixin

    class Writer(StateMixin):
        def __init__(self) -> None:
            self._init_checkpoints()
            self.step, self.writes = 3, 0

        async def _checkpoint_now(self):
            self.writes += 1
            n = self.writes
            await asyncio.sleep(0.2)
            return Path(f"/ckpt/step-{self.step}-w{n}"), self.step

    async def body():
        t = Writer()
        a = asyncio.create_task(t.checkpoint_async("req-A"))
        await asyncio.sleep(0.05)
        b = asyncio.create_task(t.checkpoint_async("req-B"))
        first, second = await asyncio.gather(a, b)
        again = await t.checkpoint_async("req-A")
        return first, second, again, t.writes

    first, second, again, writes = asyncio.run(asyncio.wait_for(body(), 10))
    assert first[1] == second[1] == 3 and again == first
    assert writes == 2 and first != second


def test_a_publish_that_fails_while_a_step_waits_for_queue_room_fails_the_step() -> None:
    # The queue is full (a slow WeightService), the step waits for room, then the publish
    # is refused for good: the worker ends and nothing would ever make room. The step must
    # fail (the process exits and its supervisor restarts it) rather than hang for ever.
    from astra.errors import FailedPrecondition
    from astra.trainer.publisher import Publisher

    class RefusingSink:
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        async def publish(self, version, identity, tensors):
            await self.gate.wait()
            raise FailedPrecondition("version 1 is not newer", reason="VERSION_NOT_NEWER")

    async def main() -> None:
        sink = RefusingSink()
        pub = Publisher(sink, None, max_pending=1)
        state = {"w": torch.zeros(4)}
        await pub.submit(1, state)  # the worker takes it and waits in publish
        await asyncio.sleep(0)
        await pub.submit(2, state)  # fills the queue
        blocked = asyncio.create_task(pub.submit(3, state))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        sink.gate.set()
        done, _ = await asyncio.wait({blocked}, timeout=5.0)
        assert done, "submit still blocked after the publisher gave up"
        with pytest.raises(RuntimeError, match="not newer"):
            blocked.result()

    asyncio.run(main())


def test_a_full_weight_store_pauses_publishing_instead_of_killing_the_trainer() -> None:
    # DISK_FULL comes back as RESOURCE_EXHAUSTED with a RetryInfo: the publish waits it out
    # (the trainer pauses on its full queue), where a crash would lose the steps since the
    # checkpoint at every restart until the run gave up.
    from google.rpc import status_pb2

    from astra.clients.weights import error_from_status
    from astra.errors import ResourceExhausted
    from astra.servers.errors import status_for
    from astra.trainer.sources import is_retryable

    def round_trip(exc):
        wire = status_for(exc, "astra.weights.v1")
        raw = dict(wire.trailing_metadata)["grpc-status-details-bin"]
        return error_from_status(status_pb2.Status.FromString(raw))

    full = round_trip(ResourceExhausted("disk full", reason="DISK_FULL", retry_after_s=30.0))
    assert full.retry_after_s == 30.0 and is_retryable(full)
    too_big = round_trip(ResourceExhausted("tensor too large", reason="TOO_LARGE"))
    assert not is_retryable(too_big)


def test_a_served_trainer_takes_num_steps_optimiser_steps_whatever_it_skips() -> None:
    # num_steps counts optimiser steps: a rejected batch takes none (the supervisor reads the
    # trainer's exit 0 as "finished its steps").
    from astra.servers.trainer import _train

    def poison(request_id, trajectories):
        if request_id == "trainer-v2-a0":
            seq = trajectories[0].sequences[0]
            seq.logprobs.CopyFrom(to_array(np.full(seq.token_ids.shape[0], np.nan, np.float32)))

    cfg = config(num_steps=3)
    t, _, _ = trainer(cfg, source=SyntheticSource("p", vocab_size=100, mutate=poison))

    async def main():
        await _train(t, cfg.num_steps)
        await t.shutdown()

    asyncio.run(main())
    assert t.step == 3 and t.counters["iterations"] == 4


def test_a_checkpoint_between_sync_steps_is_never_ahead_of_what_is_published(tmp_path) -> None:
    class SlowSink(MemorySink):  # a WeightService takes a moment to store a version
        async def publish(self, version, identity, tensors):
            await asyncio.sleep(0.05)
            await super().publish(version, identity, tensors)

    source, sink = SyntheticSource("p", vocab_size=100, max_lag=1), SlowSink()
    t = Trainer(config(checkpoint={"dir": str(tmp_path)}), source=source, sink=sink)
    for r in t.run_training(3):
        if r.step == 2:
            ckpt = read_checkpoint(t.save_checkpoint())
            assert ckpt.trainer["version"] <= min(max(sink.versions), source.version)
    t.close()


def test_a_served_trainer_leaves_a_checkpoint_of_its_last_step(tmp_path: Path) -> None:
    # `astra run` reads "finished" from the checkpoints (an exit 0 short of the steps is a
    # SIGTERM from outside, to restart); and a resume of a finished run trains nothing again.
    from astra.servers.trainer import _train

    cfg = config(num_steps=3, checkpoint={"dir": str(tmp_path), "every_steps": 2})
    t, _, _ = trainer(cfg)

    async def main():
        await _train(t, cfg.num_steps)
        await t.shutdown()

    asyncio.run(main())
    assert [p.name for p in list_checkpoints(tmp_path)][-1] == "step-000000003"
    written = t.counters["checkpoints_written"]
    assert written == 2  # step 2 (every_steps) and the last one, once
