"""Real-trace weight deltas: what a delta costs when real training makes the changes.

    python tools/bench/real_deltas.py                 # 1,000 versions at each of 3 learning rates;
                                                      # writes "Weight deltas on a real trace"
    python tools/bench/real_deltas.py --quick         # 30 versions per rate; prints the section
    python tools/bench/real_deltas.py --versions 200 --lrs 1e-5 --no-write

The loop is on-policy GRPO on the embedded arithmetic task, end to end through the product:

- A Qwen3-architecture model of ~10.4M parameters (char vocabulary, 6 layers, hidden 384) is
  warmed up by supervised fine-tuning (`astra.trainer.sft.supervised_warmup`) until it answers
  some problems, so rewards differ within a group and every step has a gradient.
- `astra.trainer.loop.Trainer` trains it with fp32 master weights (AdamW; compute in fp32 by
  default, `--compute-dtype bfloat16` is ~3x slower on a CPU without bf16 arithmetic) and
  publishes every version in bf16 through `WeightServiceSink` (XOR+zstd frames against the
  version before) to a real WeightService in its own process (`start_weights`, the default
  durable `StoreConfig`: a full version every 20).
- An in-memory `Receiver` (the torch-engine RaaS's) fetches every version as it is published;
  the next batch is sampled (temperature 1) from a model loaded from exactly those received
  bytes, rewarded by exact match, its advantages normalised per group, as Dataflow does. So the
  trace is a real run's: the updates come from real gradients of real samples.
- Every version the receiver holds is compared, tensor by tensor, with the bytes the trainer
  published (BLAKE2b), and every `--check-every` versions a fresh receiver fetches the newest
  version from nothing, so the store reconstructs it from its full version and delta chain:
  each must match bit for bit.

Per version it records the share of bf16 elements that changed, the delta's bytes on the wire
against the full version's bytes, the time to encode all tensors as XOR+zstd frames
(`encode_xor_zstd`, timed on the same tensors) and to decode them (`decode_xor_zstd_into`), and
the receiver's fetch (stream, apply, verify, swap). Everything runs under a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import replace_section  # noqa: E402
from runs import load, measured  # noqa: E402
from trainer import Service  # noqa: E402

SECTION = "## Weight deltas on a real trace"
TARGET_MEDIAN = 0.01  # delta wire bytes / full at lr 1e-6
MODEL = {  # over astra.engine.tiny.TINY_CONFIG: ~10.4M parameters
    "hidden_size": 384,
    "intermediate_size": 1152,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
PROMPTS, GROUP, MAX_NEW = 2, 8, 5  # prompts per step, samples per prompt, answer tokens


# ----- the policy as the RaaS holds it: sampled from received bytes -----------------------------


class OnPolicySource:
    """A BatchSource whose batch is sampled from the model the receiver holds (see module doc)."""

    def __init__(self, policy_id: str, sampler: Any, tokenizer: Any, records: list, seed: int):
        self.policy_id, self.sampler, self.tok, self.records = (
            policy_id,
            sampler,
            tokenizer,
            records,
        )
        self.rng = random.Random(seed)
        self.version, self.rewards = 0, []

    async def fetch(self, request_id: str, num_groups: int, trainer_version: int = 0) -> Any:
        import torch

        from astra.trainer.sources import FetchedBatch
        from astra.trainer.synthetic import make_sequence, make_trajectory

        trajectories = []
        gen = torch.Generator().manual_seed(self.rng.getrandbits(32))
        for g in range(num_groups):
            record = self.rng.choice(self.records)
            prompt = list(self.tok.encode(record["prompt"]))
            samples = sample(self.sampler, prompt, GROUP, self.tok.eos_id, gen)
            answer = str(record["answer"])
            rewards = np.array([float(self.answer_of(out) == answer) for out, _ in samples])
            self.rewards.append(float(rewards.mean()))
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            for i, (out, lps) in enumerate(samples):
                seq = make_sequence(
                    self.policy_id, prompt + out, len(prompt),
                    logprobs=[0.0] * len(prompt) + lps, versions=self.version,
                )  # fmt: skip
                trajectories.append(
                    make_trajectory(f"{request_id}/{g}", i, [seq], rewards[i], float(adv[i]))
                )
        return FetchedBatch(f"b-{request_id}", self.version, trajectories)

    def answer_of(self, out: list[int]) -> str:
        """The text before end-of-sequence (exact match compares it with the answer)."""
        return self.tok.decode(out[:-1] if out and out[-1] == self.tok.eos_id else out)

    async def ack(self, batch_id: str, untrained_reason: str = "") -> None:
        pass

    async def current_version(self) -> int | None:
        return self.version

    async def announce(self, version: int, identity: str, **_: Any) -> None:
        self.version = version

    async def close(self) -> None:
        pass


def sample(model: Any, prompt: list[int], n: int, eos: int, gen: Any) -> list[tuple[list, list]]:
    """`n` completions of `prompt` at temperature 1, each cut after its end-of-sequence."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt] * n)
        outs: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        done = [False] * n
        for _ in range(MAX_NEW):
            logp = torch.log_softmax(model(ids)[:, -1].float(), dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
            for i in range(n):
                if not done[i]:
                    outs[i].append(int(tok[i]))
                    lps[i].append(float(logp[i, tok[i]]))
                    done[i] = int(tok[i]) == eos
            if all(done):
                break
            ids = torch.cat([ids, tok[:, None]], dim=1)
    return list(zip(outs, lps, strict=True))


def load_received(model: Any, held: Any) -> None:
    from astra.engine.torch_weights import as_torch_state

    state = as_torch_state({n: (t.dtype, t.shape, t.data) for n, t in held.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"received version does not fit the model: {missing} {unexpected}")


# ----- what each published version cost ----------------------------------------------------------


@dataclass
class VersionFig:
    version: int
    changed: float  # share of elements whose bits changed
    wire: float  # bytes on the stream / full bytes
    encode_s: float
    decode_s: float
    fetch_s: float = 0.0
    plan: str = ""


@dataclass
class Trace:
    lr: float
    figs: list[VersionFig] = field(default_factory=list)
    mismatches: int = 0
    chain_checks: int = 0
    chain_mismatches: int = 0
    rewards: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    step_s: float = 0.0  # train step (without sampling)
    sample_s: float = 0.0  # sampling the batch from the received weights
    full_bytes: int = 0


class RecordingSink:
    """Wraps WeightServiceSink: per version, bytes on the wire, changed share, codec times and
    the BLAKE2b of every tensor published (measurement only; the wrapped sink does the work)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.digests: dict[int, dict[str, bytes]] = {}
        self.figs: dict[int, VersionFig] = {}
        self._prev: dict[str, np.ndarray] | None = None

    async def latest_version(self) -> int | None:
        return await self.inner.latest_version()

    async def publish(self, version: int, identity: str, tensors: Any) -> None:
        sent = self.inner.bytes_sent
        await self.inner.publish(version, identity, tensors)
        wire = self.inner.bytes_sent - sent
        await asyncio.to_thread(self._measure, version, wire, tensors)

    def _measure(self, version: int, wire: int, tensors: Any) -> None:
        from astra.weights.delta import decode_xor_zstd_into, encode_xor_zstd

        now = {n: np.frombuffer(memoryview(v[2]), np.uint8).copy() for n, v in tensors.items()}
        self.digests[version] = {n: hashlib.blake2b(a).digest() for n, a in now.items()}
        full = sum(a.nbytes for a in now.values())
        if self._prev is not None:
            changed = elements = 0
            enc = dec = 0.0
            for n, a in now.items():
                old = self._prev[n]
                changed += int(np.count_nonzero(a.view(np.uint16) != old.view(np.uint16)))
                elements += a.nbytes // 2
                t0 = time.perf_counter()
                frame = encode_xor_zstd(a, old)
                t1 = time.perf_counter()
                out = np.empty_like(a)
                decode_xor_zstd_into(frame, old, out)
                dec += time.perf_counter() - t1
                enc += t1 - t0
                if not np.array_equal(out, a):
                    raise RuntimeError(f"v{version} {n}: XOR+zstd round trip differs")
            self.figs[version] = VersionFig(version, changed / elements, wire / full, enc, dec)
        self._prev = now

    async def close(self) -> None:
        await self.inner.close()


# ----- one learning rate ---------------------------------------------------------------------------


async def run_lr(lr: float, versions: int, args: Any, warm: Path, service: Service, log) -> Trace:
    from astra.clients.trainer_sources import WeightServiceSink
    from astra.clients.weights_stream import Receiver
    from astra.engine.tiny import load_model
    from astra.trainer.config import TrainerConfig
    from astra.trainer.loop import Trainer
    from astra.trainer.sources import model_files

    policy = f"trace-lr{lr:g}"
    cfg = TrainerConfig.model_validate({
        "policy_id": policy, "model": str(warm), "port": None, "dtype": args.compute_dtype,
        "batch": {"num_groups": PROMPTS}, "publish": {"dtype": "bfloat16"},
        "optim": {"lr": lr}, "seed": args.seed,
    })  # fmt: skip
    sampler, tok = load_model(str(warm), "cpu", "float32")  # fp32 math over the received bf16
    hf = model_files(str(warm), json.loads((warm / "config.json").read_text()))
    sink = RecordingSink(WeightServiceSink(service.address, policy, hf))
    records = args.records
    source = OnPolicySource(policy, sampler, tok, records, args.seed)
    trainer = Trainer(cfg, source=source, sink=sink)
    trace = Trace(lr)
    t0 = time.perf_counter()
    await trainer.initialize()  # publishes v0, a full version
    await trainer.publisher.drain()
    receiver = Receiver(service.address, policy, None, in_memory=True, keep_versions=1)
    try:
        for _ in range(versions):
            s0 = time.perf_counter()
            r = await trainer.train_step_async()
            trace.step_s += time.perf_counter() - s0 - r.metrics["fetch_ms"] / 1e3
            trace.sample_s += r.metrics["fetch_ms"] / 1e3
            if r.skipped:
                raise RuntimeError(f"lr {lr}: step {r.step} skipped: {r.skipped}")
            await trainer.publisher.drain()  # every version published before the next sample
            f0 = time.perf_counter()
            res = await receiver.fetch()
            fetch_s = time.perf_counter() - f0
            held = receiver.current
            fig = sink.figs[res.version]
            fig.fetch_s, fig.plan = fetch_s, res.plan
            want = sink.digests[res.version]
            got = {n: hashlib.blake2b(t.data).digest() for n, t in held.items()}
            trace.mismatches += got != want
            load_received(sampler, held)
            if res.version % args.check_every == 0:
                trace.chain_checks += 1
                trace.chain_mismatches += not await fresh_matches(service, policy, want)
            trace.figs.append(fig)
            if res.version % args.log_every == 0:
                recent = source.rewards[-50 * PROMPTS :]
                log(
                    f"  lr {lr:g} v{res.version}: changed {fig.changed:.4%}, wire {fig.wire:.4%}"
                    f", plan {res.plan}, reward {statistics.mean(recent):.3f}, "
                    f"{time.perf_counter() - t0:.0f} s (sampling {trace.sample_s:.0f}, "
                    f"steps {trace.step_s:.0f})"
                )
        trace.full_bytes = sum(t.data.nbytes for t in receiver.current.values())
    finally:
        await receiver.close()
        await trainer.shutdown()
    trace.rewards, trace.wall_s = source.rewards, time.perf_counter() - t0
    return trace


async def fresh_matches(service: Service, policy: str, want: dict[str, bytes]) -> bool:
    from astra.clients.weights_stream import Receiver

    async with Receiver(service.address, policy, None, in_memory=True) as fresh:
        await fresh.fetch()
        got = {n: hashlib.blake2b(t.data).digest() for n, t in fresh.current.items()}
    return got == want


def warm_model(tmp: Path, args: Any, log) -> Path:
    """A ~10M-parameter model after supervised warm-up on the arithmetic records (fp32)."""
    from astra.engine.tiny import TINY_CONFIG, random_model, save_model
    from astra.engine.tokenizer import CharTokenizer
    from astra.trainer.sft import SftSettings, supervised_warmup

    cfg = {**TINY_CONFIG, **MODEL}
    model = random_model(cfg, args.seed)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    res = supervised_warmup(
        model, CharTokenizer(), args.records, SftSettings(steps=args.warmup, lr=1e-3, batch_size=32)
    )
    log(
        f"warm-up: {params / 1e6:.2f}M parameters, {args.warmup} SFT steps in "
        f"{time.perf_counter() - t0:.0f} s, loss {res.loss_first:.2f} -> {res.loss_last:.2f}"
    )
    args.params = params
    save_model(tmp / "warm", model, cfg)
    return tmp / "warm"


# ----- the section ---------------------------------------------------------------------------------


def spread(xs: list[float], fmt: str) -> str:
    """median (p90, max)"""
    s = sorted(xs)
    p90 = s[min(len(s) - 1, int(0.9 * len(s)))]
    return f"{fmt.format(statistics.median(s))} ({fmt.format(p90)}, {fmt.format(s[-1])})"


def render(traces: list[Trace], args: Any, total_s: float, load_before: str) -> str:
    pct, ms = "{:.3%}", "{:.1f}"
    head = "| metric | " + " | ".join(f"lr {t.lr:g}" for t in traces) + " |"
    rows = [head, "|---|" + "---:|" * len(traces)]

    def row(name: str, cell) -> None:
        rows.append(f"| {name} | " + " | ".join(cell(t) for t in traces) + " |")

    row("versions published and received", lambda t: f"{len(t.figs):,}")
    row("bf16 elements changed per version, median (p90, max)",
        lambda t: spread([f.changed for f in t.figs], pct))  # fmt: skip
    row("delta on the wire / full version, median (p90, max)",
        lambda t: spread([f.wire for f in t.figs], pct))  # fmt: skip
    row("delta on the wire per version, median KiB (full: "
        f"{traces[0].full_bytes / 2**20:.1f} MiB)",
        lambda t: f"{statistics.median(f.wire for f in t.figs) * t.full_bytes / 1024:,.0f}")  # fmt: skip
    row("encode XOR+zstd, whole model, ms, median (p90, max)",
        lambda t: spread([f.encode_s * 1e3 for f in t.figs], ms))  # fmt: skip
    row("decode (apply), whole model, ms, median (p90, max)",
        lambda t: spread([f.decode_s * 1e3 for f in t.figs], ms))  # fmt: skip
    row("receiver fetch (stream, apply, verify, swap), ms, median (p90, max)",
        lambda t: spread([f.fetch_s * 1e3 for f in t.figs], ms))  # fmt: skip
    row("received version differs from the trainer's bytes (every version)",
        lambda t: f"{t.mismatches} of {len(t.figs):,}")  # fmt: skip
    row(f"fresh receiver, newest version rebuilt from the store's chain (every {args.check_every})",
        lambda t: f"{t.chain_mismatches} mismatches of {t.chain_checks}")  # fmt: skip
    row("mean reward, first → last 100 versions",
        lambda t: f"{statistics.mean(t.rewards[: 100 * PROMPTS]):.2f} → "
        f"{statistics.mean(t.rewards[-100 * PROMPTS :]):.2f}")  # fmt: skip
    row("wall time, s", lambda t: f"{t.wall_s:,.0f}")
    low = next((t for t in traces if t.lr == 1e-6), None)
    exact = all(t.mismatches == 0 and t.chain_mismatches == 0 for t in traces)
    enough = all(len(t.figs) >= 1000 for t in traces)
    target = ["", "| target | figure | met? |", "|---|---|---|"]
    if low is not None:
        med = statistics.median(f.wire for f in low.figs)
        target.append(f"| median delta ≤ 1% of the full size at lr 1e-6 | {med:.3%} | "
                      f"{'met' if med <= TARGET_MEDIAN else '**missed**'} |")  # fmt: skip
    versions = min(len(t.figs) for t in traces)
    target.append(f"| 0 mismatches over 1,000 versions | {versions:,} versions, "
                  f"{'0 mismatches' if exact else 'mismatches'} | "
                  f"{'met' if exact and enough else '**missed**'} |")  # fmt: skip
    lines = [SECTION, "", *rows, *target, "", measured("real_deltas.py", total_s, load_before), ""]
    lines += [
        "Method:",
        "",
        f"- Model: Qwen3 architecture, {args.params / 1e6:.2f}M parameters (hidden 384, 6 layers, "
        f"char vocabulary), {args.warmup} supervised warm-up steps, then on-policy GRPO: "
        f"{PROMPTS} prompts x {GROUP} samples per step, temperature 1, exact-match reward.",
        f"- Trainer: `astra.trainer.loop.Trainer`, {args.compute_dtype} compute, fp32 master "
        "weights, AdamW at the learning rate of the column; every version published in bf16 "
        "(cast from the fp32 masters, as the product publishes) through `WeightServiceSink` "
        "to a WeightService in its own process (default durable store, a full version every 20).",
        "- Receiver: an in-memory `Receiver` fetches each version; the next batch is sampled from "
        "a model loaded from exactly those bytes. Each received version is compared with the "
        "trainer's bytes (BLAKE2b per tensor).",
        "- Encode/decode: `encode_xor_zstd` / `decode_xor_zstd_into` (zstd level 1) over every "
        "tensor against the version before, timed on the same bytes the trainer published, one "
        "thread; the round trip is checked.",
        "",
        "Observations:",
        "",
        "- Peers' published densities: slime ~3% of elements per sync; verl 2.1-2.6% of entries; "
        "Fireworks/Cursor 1.98% of the bytes per step (1T FP8); PULSE ~99% of bf16 elements "
        "unchanged per step. These are other models, optimisers and learning rates: compare "
        "ratios, not bytes.",
        "- Which elements change at a learning rate is set by bf16 rounding: an AdamW step moves "
        "an fp32 master by about lr, and the bf16 copy changes only when that crosses half a "
        "bf16 spacing (2^-9 of the weight's magnitude), so the changed share grows with lr.",
        "",
    ]
    return "\n".join(lines)


async def main_async(args: Any) -> list[Trace]:
    from astra.raas.tasks import generate_records

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    args.records = generate_records("arithmetic", 2000, seed=args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="astra-real-deltas-"))
    service = None
    try:
        warm = warm_model(tmp, args, log)
        service = Service(tmp / "store", tmp / "weights.log")
        traces: list[Trace] = []
        for lr in args.lrs:  # the section is written after each rate: a long run keeps its part
            traces.append(await run_lr(lr, args.versions, args, warm, service, log))
            write(render(traces, args, time.perf_counter() - args.t0, args.load_before), args)
        return traces
    finally:
        if service is not None:
            service.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="30 versions per rate, no write")
    ap.add_argument("--versions", type=int, default=1000)
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    ap.add_argument("--warmup", type=int, default=300, help="supervised warm-up steps")
    ap.add_argument("--check-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument(
        "--compute-dtype", default="float32", choices=["float32", "bfloat16"],
        help="forward/backward dtype (masters fp32, versions published in bf16 either way)",
    )  # fmt: skip
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"))
    args = ap.parse_args(argv)
    args.lrs = [float(x) for x in args.lrs.split(",")]
    if args.quick:
        args.versions, args.warmup, args.check_every, args.no_write = 30, 40, 10, True
    args.load_before, args.t0 = load(), time.perf_counter()
    asyncio.run(main_async(args))


def write(section: str, args: Any) -> None:
    print(section, flush=True)
    if not args.no_write:
        replace_section(Path(args.output), SECTION, section)


if __name__ == "__main__":
    main()
