"""Trainer benchmark: step time, trained tokens/s and the time a step is blocked on publishing.

    python tools/bench/trainer.py            # full run (< 6 min on the 2-core dev machine);
                                             # writes the "Trainer" section of BENCHMARKS.md
    python tools/bench/trainer.py --quick    # fewer steps (< 1.5 min); prints the section only
    python tools/bench/trainer.py --quick --write / --no-write   # override where it goes

For the tiny model and a ~100M-parameter Qwen3-architecture model (random
init), `astra.trainer.loop.Trainer` runs optimiser steps on synthetic GRPO
batches of fixed shape (`FixedSource`: every sample has the same prompt and
generated length) and publishes every version to a real WeightService in its
own process (`start_weights` with the default, durable `StoreConfig`, as
`astra serve weights` runs it), so publishing competes with training for the
same cores as in production. Three modes train on the same batches (same
request ids, same seeds: their losses must match), each with its own Trainer
and policy on the same service:

  background  the product: the step waits for the host copy (and for room in
              the publisher's queue); the version streams while the next
              steps train.
  sync        baseline: after each step the loop also awaits
              `publisher.drain()`, so the step includes the whole publish
              (+ announce to the in-memory source).
  none        no sink: training alone, the floor for the step time.

Modes run interleaved in rounds (every mode in turn: `warm` unmeasured steps,
then `steps` measured ones, then its queue drained, unmeasured), the order
reversed every other round, so load from other jobs on the machine hits
every mode alike; step-time ratios between modes are also paired by round.
A round that would end past the time budget is skipped (the first round of
each model always runs). Figures are median (min-max) over the measured steps.
Everything is written under a temporary directory in /tmp, removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DASH, TIMES = "\u2013", "\u00d7"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import M100_OVERRIDES  # noqa: E402
from report import replace_section  # noqa: E402

SECTION = "## Trainer"
TARGET_BLOCKED = 0.05
MODES = ("background", "sync", "none")


@dataclass
class Shape:
    name: str
    groups: int
    group_size: int
    prompt_len: int
    gen_len: int
    warm: int
    steps: int
    rounds: int
    params: int = 0
    vocab: int = 0

    @property
    def samples(self) -> int:
        return self.groups * self.group_size

    def describe(self) -> str:
        return (
            f"{self.groups} groups x {self.group_size} samples, prompt {self.prompt_len} + "
            f"{self.gen_len} generated tokens ({self.samples * self.gen_len:,} trained tokens, "
            f"{self.samples * (self.prompt_len + self.gen_len):,} in all, per step)"
        )


def shapes(quick: bool) -> list[Shape]:
    tiny = Shape("tiny", 8, 8, 64, 192, warm=1, steps=3, rounds=6)
    m100 = Shape("~100M", 2, 4, 16, 48, warm=1, steps=2, rounds=4)
    if quick:
        tiny.warm, tiny.steps, tiny.rounds = 1, 3, 1
        m100.warm, m100.steps, m100.rounds = 1, 1, 1
    return [tiny, m100]


# Wall-clock budget (s) and the share of it the tiny model may use: a round that would end
# past its model's deadline is not started (the first round of each model always runs), so a
# heavily shared machine gets fewer rounds, not a longer run.
BUDGET_S = {False: 320.0, True: 80.0}
SHARE = {"tiny": 0.25}


# ----- the WeightService process ----------------------------------------------------------------


def service_main(store: str) -> None:
    """Child process: `start_weights` with the default StoreConfig until stdin closes."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from astra.servers.runtime import install_event_loop_policy
    from astra.servers.weights_serve import start_weights
    from astra.weights.store import StoreConfig

    install_event_loop_policy()

    async def main() -> None:
        server = await start_weights(store, config=StoreConfig())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wait_eof() -> None:
            for _ in sys.stdin:
                pass
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=wait_eof, daemon=True).start()
        print(json.dumps({"address": server.address, "pid": os.getpid()}), flush=True)
        await stop.wait()
        await server.stop(5)

    asyncio.run(main())


class Service:
    """The WeightService child process; stops when its stdin closes."""

    def __init__(self, store: Path, log: Path) -> None:
        self.log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--service", str(store)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=ROOT,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the WeightService did not start: {log.read_text()[-2000:]}")
        info = json.loads(line)
        self.address, self.pid = info["address"], info["pid"]

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ----- batches and sinks ----------------------------------------------------------------------


class FixedSource:
    """A BatchSource of seeded GRPO groups of one shape; the batch is a function of the request id.

    Like `SyntheticSource` but every sample has `prompt_len + gen_len` tokens
    and nothing is kept after a fetch."""

    def __init__(self, policy_id: str, shape: Shape, seed: int = 0) -> None:
        self.policy_id, self.shape, self.seed = policy_id, shape, seed
        self.version = 0

    async def fetch(self, request_id: str, num_groups: int, trainer_version: int = 0) -> Any:
        import numpy as np

        from astra.trainer.sources import FetchedBatch
        from astra.trainer.synthetic import make_sequence, make_trajectory

        s = self.shape
        rng = np.random.default_rng([self.seed, zlib.crc32(request_id.encode())])
        trajectories = []
        for g in range(num_groups):
            prompt = rng.integers(3, s.vocab, s.prompt_len)
            rewards = rng.random(s.group_size)
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            for i in range(s.group_size):
                tokens = np.concatenate([prompt, rng.integers(3, s.vocab, s.gen_len)])
                lp = np.concatenate([np.zeros(s.prompt_len), -rng.uniform(0.5, 6.0, s.gen_len)])
                seq = make_sequence(
                    self.policy_id, tokens, s.prompt_len, logprobs=lp, versions=self.version
                )
                trajectories.append(
                    make_trajectory(f"{request_id}/{g}", i, [seq], float(rewards[i]), float(adv[i]))
                )
        return FetchedBatch(f"b-{request_id}", self.version, trajectories)

    async def ack(self, batch_id: str, untrained_reason: str = "") -> None:
        pass

    async def current_version(self) -> int | None:
        return self.version

    async def announce(
        self, version: int, identity: str, resumed: bool = False, resumed_from: int | None = None
    ) -> None:
        self.version = version

    async def close(self) -> None:
        pass


class TimedSink:
    """Wraps a WeightSink to record each publish's wall time and bytes (measurement only)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.times: list[float] = []
        self.nbytes: list[int] = []  # on the stream: frames against the previous version, or raw
        self.model_bytes: list[int] = []

    async def latest_version(self) -> int | None:
        return await self.inner.latest_version()

    async def publish(self, version: int, identity: str, tensors: Any) -> None:
        start, sent = time.perf_counter(), self.inner.bytes_sent
        await self.inner.publish(version, identity, tensors)
        self.times.append(time.perf_counter() - start)
        self.nbytes.append(self.inner.bytes_sent - sent)
        self.model_bytes.append(sum(memoryview(v[2]).nbytes for v in tensors.values()))

    async def close(self) -> None:
        await self.inner.close()


# ----- running ------------------------------------------------------------------------------


@dataclass
class StepFig:
    total_s: float  # wall time of the iteration (sync: + the drain)
    fetch_s: float  # fetch + batch build
    compute_s: float  # forward/backward/optimiser
    copy_s: float  # full_state to host (bf16)
    wait_s: float  # background: room in the queue; sync: + the whole publish
    tokens: int  # trained (generated) tokens
    round: int = 0

    @property
    def blocked_s(self) -> float:
        return self.copy_s + self.wait_s


@dataclass
class ModeRun:
    mode: str
    trainer: Any
    sink: TimedSink | None
    steps: list[StepFig] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    cpu_trainer_s: float = 0.0
    cpu_service_s: float = 0.0
    wall_s: float = 0.0
    publish_s: list[float] = field(default_factory=list)
    publish_bytes: list[int] = field(default_factory=list)
    model_bytes: list[int] = field(default_factory=list)
    drain_after_s: list[float] = field(default_factory=list)
    init_s: float = 0.0
    v0_publish_s: float = 0.0


def cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def bench_trainer(
    policy: str,
    shape: Shape,
    model: str,
    hf: dict,
    service: Service | None,
    **config: Any,
) -> tuple[Any, TimedSink | None]:
    """A Trainer of `model` on `FixedSource` batches of `shape`, publishing bf16 versions to
    `service` through a TimedSink (None: no sink); `config`: more TrainerConfig keys."""
    from astra.clients.trainer_sources import WeightServiceSink
    from astra.trainer.config import TrainerConfig
    from astra.trainer.loop import Trainer
    from astra.trainer.sources import model_files

    cfg = TrainerConfig.model_validate(
        {
            "policy_id": policy,
            "model": model,
            "port": None,
            "batch": {"num_groups": shape.groups},
            "publish": {"dtype": "bfloat16"},
            **config,
        }
    )
    sink = None
    if service is not None:
        sink = TimedSink(WeightServiceSink(service.address, policy, model_files(model, hf)))
    return Trainer(cfg, source=FixedSource(policy, shape), sink=sink), sink


async def make_run(mode: str, shape: Shape, model: str, hf: dict, service: Service) -> ModeRun:
    policy = f"bench-{shape.name.strip('~')}-{mode}"
    t0 = time.perf_counter()
    trainer, sink = bench_trainer(policy, shape, model, hf, service if mode != "none" else None)
    await trainer.initialize()  # builds the model and optimiser, publishes v0 (a full version)
    run = ModeRun(mode, trainer, sink, init_s=time.perf_counter() - t0)
    if sink is not None:
        run.v0_publish_s = sink.times[0]
        sink.times.clear()
        sink.nbytes.clear()
    return run


async def run_block(run: ModeRun, shape: Shape, service: Service, log, rnd: int) -> None:
    t, pub = run.trainer, run.sink is not None
    cpu0 = svc0 = wall0 = 0.0
    for i in range(shape.warm + shape.steps):
        measured = i >= shape.warm
        if i == shape.warm:
            cpu0, svc0, wall0 = cpu_self(), service.cpu_s(), time.perf_counter()
            first_publish = len(run.sink.times) if pub else 0
        q0 = t.publisher.stats.blocked_s if pub else 0.0
        r = await t.train_step_async()
        if r.skipped:
            raise RuntimeError(f"{run.mode}: step {r.step} skipped: {r.skipped}")
        m = r.metrics
        queue_wait = t.publisher.stats.blocked_s - q0 if pub else 0.0
        total, wait = m["total_ms"] / 1e3, queue_wait
        if run.mode == "sync":
            d0 = time.perf_counter()
            await t.publisher.drain()
            drain = time.perf_counter() - d0
            total, wait = total + drain, wait + drain
        fig = StepFig(
            total_s=total,
            fetch_s=m["fetch_ms"] / 1e3,
            compute_s=m["compute_ms"] / 1e3,
            copy_s=max(m["publish_blocked_ms"] / 1e3 - queue_wait, 0.0),
            wait_s=wait,
            tokens=r.training_result.num_tokens,
            round=rnd,
        )
        if measured:
            run.steps.append(fig)
            run.losses.append(r.training_result.loss)
        log(
            f"  {shape.name:5s} {run.mode:10s} v{r.version:<3d}{'' if measured else ' warm'}: "
            f"step {fig.total_s:6.3f} s = compute {fig.compute_s:6.3f} + copy {fig.copy_s:5.3f}"
            f" + wait {fig.wait_s:6.3f} + fetch {fig.fetch_s:5.3f}"
        )
    run.cpu_trainer_s += cpu_self() - cpu0
    run.cpu_service_s += service.cpu_s() - svc0
    run.wall_s += time.perf_counter() - wall0
    if pub:
        d0 = time.perf_counter()
        await t.publisher.drain()  # unmeasured: the next mode starts on a quiet service
        run.drain_after_s.append(time.perf_counter() - d0)
        run.publish_s += run.sink.times[first_publish:]
        run.publish_bytes += run.sink.nbytes[first_publish:]
        run.model_bytes += run.sink.model_bytes[first_publish:]


def model_for(shape: Shape, tmp: Path, log) -> tuple[str, dict]:
    from astra.engine.tiny import TINY_CONFIG, random_model, save_model

    if shape.name == "tiny":
        return "tiny", dict(TINY_CONFIG)
    cfg = {**TINY_CONFIG, **M100_OVERRIDES, "eos_token_id": 2}
    cfg.pop("astra_tokenizer", None)
    t0 = time.perf_counter()
    save_model(tmp / "m100", random_model(cfg, 1), cfg)
    log(f"wrote the ~100M model (fp32) in {time.perf_counter() - t0:.1f} s")
    return str(tmp / "m100"), cfg


async def bench_shape(
    shape: Shape, tmp: Path, service: Service, log, deadline: float
) -> dict[str, ModeRun]:
    model, hf = model_for(shape, tmp, log)
    shape.vocab = int(hf["vocab_size"])
    runs: dict[str, ModeRun] = {}
    for mode in MODES:
        runs[mode] = await make_run(mode, shape, model, hf, service)
        log(f"{shape.name} {mode}: initialised in {runs[mode].init_s:.1f} s")
    shape.params = sum(p.numel() for p in runs["none"].trainer.model.parameters())
    round_s, done = 0.0, 0
    for rnd in range(shape.rounds):
        if rnd and time.perf_counter() + round_s > deadline:
            log(f"{shape.name}: stopping after {rnd} round(s) to stay within the time budget")
            break
        t0 = time.perf_counter()
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
            await run_block(runs[mode], shape, service, log, rnd)
        round_s, done = max(round_s, time.perf_counter() - t0), rnd + 1
    shape.rounds = done
    for mode in ("background", "sync"):  # every version reached the service
        run = runs[mode]
        latest = await run.sink.latest_version()
        if latest != run.trainer.version:
            raise RuntimeError(
                f"{mode}: service holds v{latest}, trainer at v{run.trainer.version}"
            )
    for run in runs.values():
        await run.trainer.shutdown()
    return runs


# ----- report -------------------------------------------------------------------------------


def med(xs: list[float], fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    if not xs:
        return ""
    xs = [x * scale for x in xs]
    m = fmt.format(statistics.median(xs))
    if len(xs) == 1:
        return m
    return f"{m} ({fmt.format(min(xs))}{DASH}{fmt.format(max(xs))})"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.2f}%"


def machine() -> str:
    cores = os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    return (
        f"{cores} cores, {mem:.0f} GiB RAM, no GPU, Python {platform.python_version()}, "
        f"torch {torch.__version__.split('+')[0]} ({torch.get_num_threads()} intra-op threads), "
        f"Linux {platform.release()}"
    )


def model_table(shape: Shape, runs: dict[str, ModeRun]) -> tuple[list[str], dict[str, Any]]:
    b, s, n = (runs[m] for m in MODES)

    def col(fn, fmt="{:.2f}", scale=1.0) -> list[str]:
        return [med([fn(x) for x in r.steps], fmt, scale) for r in (b, s, n)]

    def per_step(total: float, r: ModeRun) -> str:
        fr = [x.blocked_s / x.total_s for x in r.steps]
        return f"{pct(total)} (per step {pct(min(fr))}{DASH}{pct(max(fr))})"

    def frac(r: ModeRun) -> float:
        return sum(x.blocked_s for x in r.steps) / sum(x.total_s for x in r.steps)

    step_fmt = "{:.3f}" if statistics.median(x.total_s for x in n.steps) < 1 else "{:.2f}"
    bf, sf = frac(b), frac(s)
    met = bf < TARGET_BLOCKED
    worst = max(x.blocked_s / x.total_s for x in b.steps)

    def ratios(num: ModeRun, den: ModeRun) -> list[float]:
        """Per round: median step of `num` / median step of `den` (paired, so drift cancels)."""
        out = []
        for rnd in sorted({x.round for x in den.steps}):
            a = [x.total_s for x in num.steps if x.round == rnd]
            c = [x.total_s for x in den.steps if x.round == rnd]
            if a and c:
                out.append(statistics.median(a) / statistics.median(c))
        return out

    sync_over_bg, none_over_bg = ratios(s, b), ratios(n, b)
    speed = statistics.median(sync_over_bg)
    floor = statistics.median(x.total_s for x in n.steps)
    cpu = {
        r.mode: (r.cpu_trainer_s / len(r.steps), r.cpu_service_s / len(r.steps))
        for r in runs.values()
    }
    rows = [
        ("step time, s", col(lambda x: x.total_s, step_fmt)),
        (
            "fastest step (least disturbed by other jobs), s",
            [step_fmt.format(min(x.total_s for x in r.steps)) for r in (b, s, n)],
        ),
        (
            "step time / background step time, paired by round (median (range) over rounds)",
            ["1", med(sync_over_bg), med(none_over_bg)],
        ),
        ("trained tokens/s", col(lambda x: x.tokens / x.total_s, "{:,.0f}")),
        (
            "trained tokens/s over the measured blocks (wall)",
            [f"{sum(x.tokens for x in r.steps) / r.wall_s:,.0f}" for r in (b, s, n)],
        ),
        ("compute (forward, backward, AdamW), s", col(lambda x: x.compute_s, step_fmt)),
        ("fetch + batch build, s", col(lambda x: x.fetch_s, "{:.3f}")),
        (
            "blocked: host copy (full_state → bf16), ms",
            [*col(lambda x: x.copy_s, "{:.1f}", 1e3)[:2], ""],
        ),
        (
            "blocked: queue room (background) / whole publish (sync), ms",
            [*col(lambda x: x.wait_s, "{:.1f}", 1e3)[:2], ""],
        ),
        (
            "**fraction of the step blocked on publishing** (sum over the measured steps)",
            [per_step(bf, b), per_step(sf, s), ""],
        ),
        (
            "publish of one version, s (background: overlapping the next steps)",
            [med(b.publish_s), med(s.publish_s), ""],
        ),
        (
            "version on the wire: MB (xor+zstd frames against the version before, of "
            f"{statistics.median(b.model_bytes) / 1e6:.1f} MB raw)",
            [
                f"{statistics.median(b.publish_bytes) / 1e6:.1f}",
                f"{statistics.median(s.publish_bytes) / 1e6:.1f}",
                "",
            ],
        ),
        (
            "CPU s per step: trainer process / WeightService process",
            [
                f"{r.cpu_trainer_s / len(r.steps):.2f} / {r.cpu_service_s / len(r.steps):.2f}"
                for r in (b, s, n)
            ],
        ),
    ]
    lines = [
        f"**{shape.name}** ({shape.params / 1e6:.1f}M parameters): {shape.describe()}; "
        f"{shape.rounds} round(s) of {shape.warm} warm-up + {shape.steps} measured step(s) per "
        f"mode ({len(b.steps)} measured per mode).",
        "",
        "| metric | background publish (Astra) | synchronous publish (baseline) | no publishing | target | met? |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, cells in rows:
        if name.startswith("**fraction"):
            target = f"< 5% | {'met' if met else '**missed**'}"
        else:
            target = " | "
        lines.append(f"| {name} | {' | '.join(cells)} | {target} |")
    facts = {
        "blocked_frac": bf,
        "sync_frac": sf,
        "met": met,
        "worst": worst,
        "speedup": speed,
        "bg_over_none": 1 / statistics.median(none_over_bg),
        "publish_cpu": cpu["background"][0] - cpu["none"][0] + cpu["background"][1],
        "train_cpu": cpu["none"][0],
        "floor": floor,
        "bg_step": statistics.median(x.total_s for x in b.steps),
        "sync_step": statistics.median(x.total_s for x in s.steps),
        "bg_compute": statistics.median(x.compute_s for x in b.steps),
        "none_compute": statistics.median(x.compute_s for x in n.steps),
        "bg_publish": statistics.median(b.publish_s),
        "sync_publish": statistics.median(s.publish_s),
        "v0_publish": b.v0_publish_s,
        "max_wait": max(x.wait_s for x in b.steps),
        "same_losses": b.losses == s.losses == n.losses,
    }
    return lines, facts


def render(results, args, started: str, seconds: float, loads: tuple, cmd: str) -> str:
    out = [
        SECTION,
        "",
        f"Measured {started} with `{cmd}` ({seconds:.0f} s) on this machine: {machine()}. "
        f"Load average (1 min) {loads[0]:.1f} at the start, {loads[1]:.1f} at the end: other jobs "
        "shared the 2 cores, so wall times vary from step to step; figures with a range are "
        f"median (min{DASH}max) over the measured steps.",
        "",
    ]
    all_facts = {}
    for shape, runs in results:
        lines, facts = model_table(shape, runs)
        all_facts[shape.name] = facts
        out += [*lines, ""]
    missed = [n for n, f in all_facts.items() if not f["met"]]
    out.append("Observations:")
    out.append("")
    for name, f in all_facts.items():
        out.append(
            f"- {name}: blocked {pct(f['blocked_frac'])} of the step with background publishing "
            f"(worst step {pct(f['worst'])}, longest wait for queue room {1e3 * f['max_wait']:.1f} ms) "
            f"against {pct(f['sync_frac'])} when the step waits for the publish; median step "
            f"{f['bg_step']:.3f} s background, {f['sync_step']:.3f} s synchronous, "
            f"{f['floor']:.3f} s without publishing; paired by round, the synchronous step takes "
            f"{f['speedup']:.2f}{TIMES} the background one and the background step "
            f"{f['bg_over_none']:.2f}{TIMES} the step without publishing. Publishing a version "
            f"costs about {f['publish_cpu']:.2f} CPU s (client in the trainer process + service) "
            f"against {f['train_cpu']:.2f} CPU s for the training step itself: taking the publish "
            f"off the critical path could at best make the step {1 / (1 - f['sync_frac']):.2f}"
            f"{TIMES} faster than synchronous; on these shared cores it gains "
            f"{f['speedup']:.2f}{TIMES}, because the publish's CPU time now slows training. "
            f"A version took {f['sync_publish']:.2f} s to publish alone (sync) and "
            f"{f['bg_publish']:.2f} s in the background, sharing the cores with training; "
            f"the first (full) version {f['v0_publish']:.2f} s. Losses identical in the three "
            f"modes: {'yes' if f['same_losses'] else '**no**'}."
        )
    out.append("")
    if missed:
        out.append(f"**Target missed ({', '.join(missed)}): blocked ≥ 5% of the step.**")
    else:
        out.append("Target met for both models: < 5% of the step blocked on publishing.")
    out += [
        "",
        "Method. One invocation, one WeightService process (`start_weights` on a fresh store "
        "in /tmp with the default, durable `StoreConfig`, as `astra serve weights` runs it), "
        "the trainers in the benchmark process, all on the same 2 cores. Each model gets three "
        "`Trainer`s (float32 parameters, AdamW, default loss: decoupled PPO, token aggregation; "
        "default micro-batching at 4,096 padded tokens; `publish.dtype: bfloat16`, "
        "`publish.max_pending: 2`), each with its own policy on the service and a `FixedSource` "
        "of seeded GRPO groups (shared prompt, random continuations of one fixed length, "
        "group-normalised advantages, random behaviour log-probs): identical batches and "
        "identical losses in every mode. Background: `Trainer.train_step_async` as shipped — "
        "the step waits for the host copy and for room in the publish queue, and the "
        "`WeightServiceSink` streams the raw bf16 tensors over gRPC while later steps train. "
        "Synchronous baseline: the same loop awaiting `publisher.drain()` after every step "
        "(copy, stream, commit, announce). No publishing: no sink. Modes alternate in rounds "
        "(warm-up steps first, so a background block starts with a publish in flight; the "
        "queue is drained, unmeasured, at the end of each block; order reversed every other "
        "round). Step time = the iteration's wall time (fetch, batch build, compute, host "
        "copy, queue wait; + the drain in sync mode); trained tokens = generated tokens under "
        "the loss mask; blocked = host copy + queue wait (+ the drain); the blocked fraction "
        "is summed blocked time over summed step time (what `Trainer.get_statistics()` "
        "reports as `publish_blocked_fraction`, here over the measured steps only); ratios "
        "between modes compare the median steps of the same round. Publish time per version is measured "
        "around `WeightServiceSink.publish` (Adler-32, the gRPC stream, the service's staging "
        "and commit: delta against the previous version, fsync). CPU = getrusage of this "
        "process and /proc of the service over the measured steps. The ~100M model is "
        f"written once as an fp32 Hugging Face directory ({M100_OVERRIDES['num_hidden_layers']} "
        f"layers, hidden {M100_OVERRIDES['hidden_size']}, {M100_OVERRIDES['num_attention_heads']} "
        f"heads / {M100_OVERRIDES['num_key_value_heads']} kv heads, MLP "
        f"{M100_OVERRIDES['intermediate_size']}, vocabulary {M100_OVERRIDES['vocab_size']:,}, "
        "tied embeddings, seeded random init) that the trainers load like any model.",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (< 1.5 min); print only")
    ap.add_argument("--write", dest="write", action="store_true", default=None)
    ap.add_argument("--no-write", dest="write", action="store_false", help="print only")
    ap.add_argument("--service", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.service:
        service_main(a.service)
        return

    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load0 = os.getloadavg()[0]

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="astra-bench-trainer-"))
    service = None
    try:
        service = Service(tmp / "store", tmp / "service.log")
        log(f"WeightService pid {service.pid} at {service.address}")
        results = []
        for shape in shapes(a.quick):
            deadline = t_start + BUDGET_S[a.quick] * SHARE.get(shape.name, 1.0)
            runs = asyncio.run(bench_shape(shape, tmp, service, log, deadline))
            results.append((shape, runs))
            shutil.rmtree(tmp / "m100", ignore_errors=True)
    finally:
        if service is not None:
            service.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - t_start
    cmd = "python tools/bench/trainer.py" + (" --quick" if a.quick else "")
    text = render(results, a, started, seconds, (load0, os.getloadavg()[0]), cmd)
    print()
    print(text)
    if a.write if a.write is not None else not a.quick:
        replace_section(ROOT / "BENCHMARKS.md", SECTION, text)
        log("wrote the Trainer section of BENCHMARKS.md")


if __name__ == "__main__":
    main()
