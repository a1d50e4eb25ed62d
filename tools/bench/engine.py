"""Engine benchmark: the built-in torch engine's tokens/s against transformers' `generate`.

    python tools/bench/engine.py            # full run (< 6 min on the 2-core dev machine);
                                            # writes the "Engine (RaaS built-in torch engine)"
                                            # section of BENCHMARKS.md
    python tools/bench/engine.py --quick    # smoke run (< 1 min); prints the section only
    python tools/bench/engine.py --quick --write / --no-write   # override where it goes

Needs transformers for the baseline (`pip install -e '.[bench]'`); exits with a message if
it is missing.

Two models, each written once as a Hugging Face directory with `astra.engine.tiny.save_model`
and loaded from that directory by both systems (fp32): `tiny` (astra's 2-layer test model,
its own weights) and a ~100M-parameter Qwen3-architecture model with seeded random weights
(`random_model`). Neither config names an eos token (`eos_token_id: null`), so no system
stops early: every request produces exactly its own `max_new_tokens`.

Workload at concurrency N: R requests (R = N, one wave, for N > 1; a few back-to-back
requests for N = 1), each with a random prompt (uniform length, uniform ids) and its own
output length drawn from a seeded log-normal, rounded and clipped (`Lengths`); the same
requests, lengths and order for both systems and every repeat.

  astra     `TorchEngine.generate` (the product: continuous batching on its worker thread,
            max_batch 64) called by N concurrent asyncio clients, each sending its next
            request when the previous one returns; `Sampling(max_new_tokens=L,
            temperature=1, seed=...)` (full-vocabulary sampling, no stop ids; the bench
            tokenizer's eos id is -1, an id never sampled).
  generate  `model.generate` of `AutoModelForCausalLM.from_pretrained(dir)` (sdpa attention,
            DynamicCache) on static batches of N consecutive requests: prompts left-padded
            with an attention mask, `do_sample=True, temperature=1, top_k=0, top_p=1`, no eos,
            `max_new_tokens` = the longest request of the batch (how a static batch serves
            mixed lengths); a request's tokens past its own length are computed and dropped.

tokens/s = useful tokens (each request's own length, summed) / wall time of the run (first
submit to last result; for generate, all its batches back to back). Both systems run in this
one process with the same intra-op thread count (`--threads`, default 1: on a shared 2-core
machine two OpenMP threads stall each other whenever another job holds a core, which made
both systems' times erratic), after a warm-up of each; repeats interleave the two systems (order alternating), so
load from other jobs hits both alike. Figures are median (min-max) over the repeats; the
speed-up is also paired by repeat (astra over generate in the same repeat).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import M100_OVERRIDES  # noqa: E402
from report import replace_section  # noqa: E402

DASH, TIMES = "\u2013", "\u00d7"
SECTION = "## Engine (RaaS built-in torch engine)"
TARGET = 1.5  # astra / generate useful tokens/s at TARGET_N concurrent requests
TARGET_N = 64
CONCURRENCY = (1, 16, 64)
SYSTEMS = ("astra", "generate")
INSTALL_HINT = (
    "tools/bench/engine.py needs transformers for its baseline: "
    "pip install -e '.[bench]'  (or: pip install 'transformers>=4.51')"
)


@dataclass(frozen=True)
class Lengths:
    """Output lengths: round(exp(N(ln median, sigma))) clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, n: int, seed: Sequence[int]) -> list[int]:
        import numpy as np

        x = np.random.default_rng(list(seed)).lognormal(math.log(self.median), self.sigma, n)
        return [int(v) for v in np.clip(np.rint(x), self.lo, self.hi)]

    def describe(self) -> str:
        return (
            f"log-normal max_new_tokens, median {self.median:g}, sigma {self.sigma:g}, "
            f"rounded and clipped to [{self.lo}, {self.hi}]"
        )


@dataclass(frozen=True)
class Spec:
    """One model's benchmark: which model, which workloads, how many repeats."""

    name: str
    lengths: Lengths
    concurrency: tuple[int, ...] = CONCURRENCY
    repeats: int = 3
    single_requests: int = 4  # requests sent back to back at concurrency 1
    prompt_len: tuple[int, int] = (4, 16)  # uniform, inclusive
    seed: int = 0


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    new_tokens: int
    seed: int


@dataclass
class Run:
    """One timed run of one system over one workload."""

    seconds: float
    useful: int  # each request's own tokens, summed
    computed: int  # tokens the system sampled (generate: batch size x longest, per batch)
    load: float  # 1-min load average when the run ended

    @property
    def tps(self) -> float:
        return self.useful / self.seconds

    @property
    def computed_tps(self) -> float:
        return self.computed / self.seconds


@dataclass
class Cell:
    """Everything measured at one concurrency of one model."""

    concurrency: int
    requests: list[Request]
    runs: dict[str, list[Run]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})

    def ratios(self) -> list[float]:
        a, g = self.runs["astra"], self.runs["generate"]
        return [x.tps / y.tps for x, y in zip(a, g, strict=False)]


@dataclass
class ModelResult:
    spec: Spec
    params: int
    config: dict[str, Any]
    cells: list[Cell]
    repeats: int = 0
    setup_s: dict[str, float] = field(default_factory=dict)


def specs(quick: bool) -> list[Spec]:
    full = Lengths(median=12, sigma=0.75, lo=2, hi=64)
    if quick:
        small = Lengths(median=4, sigma=0.5, lo=2, hi=8)
        return [Spec("tiny", small, repeats=2), Spec("~100M", small, repeats=1)]
    return [Spec("tiny", full, repeats=9), Spec("~100M", full, repeats=5)]


# Wall-clock budget (s) and each model's share, counted from the start of that model's setup:
# a repeat that would end past its model's deadline is not started (the first repeat always
# runs), so a heavily shared machine gets fewer repeats, not a much longer run.
BUDGET_S = {False: 330.0, True: 55.0}
SHARE = {"tiny": 0.2, "~100M": 0.8}


# ----- models and workloads -------------------------------------------------------------------


def model_config(name: str) -> dict[str, Any]:
    """The config.json written for `name`: no eos token, so nothing stops a request early."""
    from astra.engine.tiny import TINY_CONFIG

    cfg = dict(TINY_CONFIG)
    if name != "tiny":
        cfg.update(M100_OVERRIDES)
        cfg.pop("astra_tokenizer", None)
    cfg["eos_token_id"] = None
    return cfg


def write_model(name: str, directory: Path) -> dict[str, Any]:
    from astra.engine.tiny import TINY_SEED, random_model, save_model

    cfg = model_config(name)
    save_model(directory, random_model(cfg, TINY_SEED if name == "tiny" else 1), cfg)
    return cfg


def load_astra(directory: Path, device: str = "cpu") -> Any:
    """`CausalLM` from the directory, as `astra.engine.tiny.load_model` loads it (fp32)."""
    import torch

    from astra.engine.model import CausalLM
    from astra.engine.model_config import ModelConfig
    from astra.engine.torch_weights import load_state

    cfg = ModelConfig.from_dir(directory)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(torch.float32)
    model.tie()
    model.load_weights(load_state(directory))
    return model.eval()


def load_hf(directory: Path, device: str = "cpu") -> Any:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.to(device).eval()


class BenchTokenizer:
    """api.Tokenizer for the engine: eos id -1 (never sampled), ids decoded as numbers."""

    eos_id = -1

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def make_requests(spec: Spec, concurrency: int, vocab: int) -> list[Request]:
    import numpy as np

    n = spec.single_requests if concurrency == 1 else concurrency
    lengths = spec.lengths.draw(n, (spec.seed, concurrency, 1))
    rng = np.random.default_rng([spec.seed, concurrency, 2])
    lo, hi = spec.prompt_len
    out = []
    for i, new in enumerate(lengths):
        prompt = rng.integers(4, vocab, int(rng.integers(lo, hi + 1)))
        out.append(Request(tuple(int(t) for t in prompt), new, 1000 * concurrency + i))
    return out


# ----- the two systems ------------------------------------------------------------------------


async def run_astra(engine: Any, requests: Sequence[Request], concurrency: int) -> Run:
    """N closed-loop clients over the requests in order; checks every request's length."""
    from astra.engine.api import Sampling

    produced: list[int] = [0] * len(requests)
    cursor = iter(range(len(requests)))

    async def client() -> None:
        for i in cursor:
            r = requests[i]
            sampling = Sampling(max_new_tokens=r.new_tokens, temperature=1.0, seed=r.seed)
            gen = await engine.generate("bench", list(r.prompt), sampling)
            if gen.finish_reason != "length":
                raise RuntimeError(f"astra request {i} finished with {gen.finish_reason!r}")
            produced[i] = len(gen.token_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - t0
    for i, r in enumerate(requests):
        if produced[i] != r.new_tokens:
            raise RuntimeError(f"astra request {i}: {produced[i]} tokens, asked {r.new_tokens}")
    useful = sum(produced)
    return Run(seconds, useful, useful, os.getloadavg()[0])


def generate_batches(
    model: Any, requests: Sequence[Request], concurrency: int, seed: int
) -> tuple[list[int], int]:
    """Static batches of `concurrency` requests through `model.generate`; returns each request's
    useful token count (its own length, once the batch has produced at least that many) and
    the number of tokens sampled in all."""
    import torch
    import transformers

    produced, computed = [], 0
    for b in range(0, len(requests), concurrency):
        batch = requests[b : b + concurrency]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        longest = max(r.new_tokens for r in batch)
        config = transformers.GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=longest,
            eos_token_id=None,
            pad_token_id=0,
        )
        torch.manual_seed(seed + b)
        with torch.inference_mode():
            out = model.generate(
                ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config
            )
        if out.is_cuda:
            torch.cuda.synchronize()  # the timer stops when the tokens exist
        new = out.shape[1] - width
        if new != longest:
            raise RuntimeError(f"generate produced {new} tokens, asked {longest}")
        produced += [min(r.new_tokens, new) for r in batch]
        computed += new * len(batch)
    return produced, computed


def run_generate(model: Any, requests: Sequence[Request], concurrency: int, seed: int) -> Run:
    t0 = time.perf_counter()
    produced, computed = generate_batches(model, requests, concurrency, seed)
    seconds = time.perf_counter() - t0
    for i, r in enumerate(requests):
        if produced[i] != r.new_tokens:
            raise RuntimeError(f"generate request {i}: {produced[i]} tokens, asked {r.new_tokens}")
    return Run(seconds, sum(produced), computed, os.getloadavg()[0])


# ----- one model ------------------------------------------------------------------------------


async def bench_model(
    spec: Spec,
    directory: Path,
    *,
    threads: int,
    device: str = "cpu",
    deadline: float = math.inf,
    log: Callable[[str], None] = lambda msg: None,
) -> ModelResult:
    """Writes the model into `directory` (must not exist), loads it into both systems, warms
    both up, then runs the repeats (each: every concurrency, both systems, order alternating)."""
    import torch

    from astra.engine.torch_engine import TorchEngine

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    cfg = write_model(spec.name, directory)
    setup = {"write": time.perf_counter() - t0}
    t0 = time.perf_counter()
    ours = load_astra(directory, device)
    setup["load astra"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = load_hf(directory, device)
    setup["load generate"] = time.perf_counter() - t0
    params = sum(p.numel() for p in ours.parameters())
    vocab = int(cfg["vocab_size"])
    tokenizer = BenchTokenizer(vocab)
    engine = TorchEngine(
        {"bench": (ours, tokenizer)},
        device,
        max_batch=max(64, *spec.concurrency),
        num_threads=threads,
    )
    cells = [Cell(n, make_requests(spec, n, vocab)) for n in spec.concurrency]
    result = ModelResult(spec, params, cfg, cells, setup_s=setup)
    try:
        t0 = time.perf_counter()
        widest = max(cells, key=lambda c: c.concurrency)
        warm = [Request(r.prompt[:4], 2, r.seed) for r in widest.requests]
        await run_astra(engine, warm, widest.concurrency)
        run_generate(theirs, warm, widest.concurrency, spec.seed)
        setup["warm-up"] = time.perf_counter() - t0
        log(f"{spec.name}: {params / 1e6:.1f}M parameters; setup {fmt_setup(setup)}")
        repeat_s = 0.0
        for rep in range(spec.repeats):
            if rep and time.perf_counter() + repeat_s > deadline:
                log(f"{spec.name}: stopping after {rep} repeat(s) to stay within the time budget")
                break
            t0 = time.perf_counter()
            for k, cell in enumerate(cells):
                order = SYSTEMS if (rep + k) % 2 == 0 else SYSTEMS[::-1]
                for system in order:
                    if system == "astra":
                        run = await run_astra(engine, cell.requests, cell.concurrency)
                    else:
                        seed = spec.seed + 100_000 * rep
                        run = run_generate(theirs, cell.requests, cell.concurrency, seed)
                    cell.runs[system].append(run)
                    log(
                        f"{spec.name} N={cell.concurrency} repeat {rep + 1} {system}: "
                        f"{run.useful} tokens in {run.seconds:.2f} s = {run.tps:,.1f} tokens/s "
                        f"(load {run.load:.1f})"
                    )
            repeat_s = max(repeat_s, time.perf_counter() - t0)
            result.repeats = rep + 1
    finally:
        await engine.close()
    return result


# ----- report ---------------------------------------------------------------------------------


def fmt_setup(setup: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f} s" for k, v in setup.items())


def med(xs: Sequence[float], fmt: str = "{:,.1f}") -> str:
    if not xs:
        return ""
    m = fmt.format(statistics.median(xs))
    if len(xs) == 1:
        return m
    return f"{m} ({fmt.format(min(xs))}{DASH}{fmt.format(max(xs))})"


def machine(threads: int) -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"

    cores = os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import transformers

        tf = f"transformers {transformers.__version__}"
    except ImportError:
        tf = "no transformers"
    return (
        f"{cores} cores, {mem:.0f} GiB RAM, {gpu}, Python {platform.python_version()}, "
        f"torch {torch.__version__.split('+')[0]} ({threads} intra-op thread"
        f"{'s' if threads != 1 else ''} for both "
        f"systems), {tf}, Linux {platform.release()}"
    )


def speedup(cell: Cell) -> float:
    return statistics.median(cell.ratios())


def verdict_of(res: ModelResult) -> tuple[Cell | None, bool]:
    cell = next((c for c in res.cells if c.concurrency == TARGET_N), None)
    return cell, cell is not None and speedup(cell) >= TARGET


def model_table(res: ModelResult) -> list[str]:
    s = res.spec
    lines = [
        f"**{s.name}** ({res.params / 1e6:.1f}M parameters, fp32; {res.repeats} repeat(s); "
        f"outputs: {s.lengths.describe()}; prompts {s.prompt_len[0]}{DASH}{s.prompt_len[1]} "
        "random tokens).",
        "",
        "| concurrent requests | requests (output tokens: sum; min / median / max) "
        "| astra, tokens/s | generate, useful tokens/s | generate, all sampled tokens/s "
        "(useful share) | astra / generate, paired by repeat | target | met? |",
        "|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for c in res.cells:
        lens = [r.new_tokens for r in c.requests]
        a, g = c.runs["astra"], c.runs["generate"]
        share = sum(r.new_tokens for r in c.requests) / g[0].computed if g else 0.0
        target, met = "", ""
        if c.concurrency == TARGET_N:
            target = f"≥ {TARGET:g}{TIMES}"
            met = "met" if speedup(c) >= TARGET else "**missed**"
        lines.append(
            f"| {c.concurrency} | {len(lens)} ({sum(lens):,}; {min(lens)} / "
            f"{statistics.median(lens):g} / {max(lens)}) | {med([r.tps for r in a])} | "
            f"{med([r.tps for r in g])} | {med([r.computed_tps for r in g])} "
            f"({100 * share:.0f}%) | {med(c.ratios(), '{:.2f}')}{TIMES} | {target} | {met} |"
        )
    return lines


def token_steps(lens: Sequence[int], concurrency: int, static: bool) -> tuple[int, float]:
    """(forward passes that sample a token, mean rows per pass) for a workload: static batches
    of `concurrency` run to their longest request (generate), or closed-loop clients whose
    finished requests leave the batch and are replaced at once (astra's continuous batching;
    the prefill that samples a request's first token counts as one of its steps)."""
    if static:
        batches = [lens[i : i + concurrency] for i in range(0, len(lens), concurrency)]
        steps = sum(max(b) for b in batches)
        return steps, sum(len(b) * max(b) for b in batches) / steps
    queue, running, steps, rows = list(lens), [], 0, 0
    while queue or running:
        while queue and len(running) < concurrency:
            running.append(queue.pop(0))
        steps, rows = steps + 1, rows + len(running)
        running = [r - 1 for r in running if r > 1]
    return steps, rows / steps


def observations(res: ModelResult) -> list[str]:
    out = []
    for c in res.cells:
        lens = [r.new_tokens for r in c.requests]
        a = statistics.median(r.tps for r in c.runs["astra"])
        g = statistics.median(r.tps for r in c.runs["generate"])
        gc = statistics.median(r.computed_tps for r in c.runs["generate"])
        share = sum(lens) / c.runs["generate"][0].computed
        g_steps, g_rows = token_steps(lens, c.concurrency, static=True)
        a_steps, a_rows = token_steps(lens, c.concurrency, static=False)
        if c.concurrency == 1:
            how = (
                f"{len(lens)} requests one after another, no padding in either system: "
                f"{a_steps} token steps of 1 row each; the ratio is the two systems' cost per "
                "token at batch 1"
            )
        else:
            how = (
                f"generate samples {gc:,.1f} tokens/s in all, {100 * share:.0f}% of them "
                f"useful; it takes {g_steps} token steps of {g_rows:.0f} rows, astra "
                f"{a_steps} steps of {a_rows:.1f} rows on average as finished requests leave "
                f"the batch (were a step's cost proportional to its rows, the gain would be "
                f"{1 / share:.1f}{TIMES})"
            )
        out.append(
            f"- {res.spec.name}, {c.concurrency} concurrent: astra {a:,.1f} useful tokens/s, "
            f"generate {g:,.1f}; astra / generate {speedup(c):.2f}{TIMES} paired by repeat. "
            f"{how[0].upper()}{how[1:]}."
        )
    return out


def render(
    results: Sequence[ModelResult],
    *,
    started: str,
    seconds: float,
    loads: Sequence[float],
    cmd: str,
    threads: int,
    notes: Sequence[str] = (),
) -> str:
    out = [
        SECTION,
        "",
        f"Measured {started} with `{cmd}` ({seconds:.0f} s) on this machine: {machine(threads)}. "
        f"Load average (1 min) {loads[0]:.1f} before the start (`uptime`), "
        f"{min(loads):.1f}{DASH}{max(loads):.1f} over the runs, {loads[-1]:.1f} at the end: "
        "other jobs shared the 2 cores, so each figure is the median (min"
        f"{DASH}max) over the repeats, the two systems interleaved.",
        "",
    ]
    for res in results:
        out += [*model_table(res), ""]
    out += ["Observations:", ""]
    for res in results:
        out += observations(res)
    out += [*notes, ""]
    verdicts = []
    for res in results:
        cell, met = verdict_of(res)
        if cell is None:
            continue
        verdicts.append(
            f"{res.spec.name} {speedup(cell):.2f}{TIMES} ({'met' if met else 'missed'})"
        )
    all_met = all(verdict_of(r)[1] for r in results if verdict_of(r)[0] is not None)
    outcome = ("**met**" if all_met else "**missed**") if verdicts else "not measured"
    out.append(
        f"Target (astra ≥ {TARGET:g}{TIMES} generate's useful tokens/s at {TARGET_N} "
        f"concurrent requests): {outcome}" + (": " + "; ".join(verdicts) if verdicts else "") + "."
    )
    why = []
    for res in results:
        cell = verdict_of(res)[0]
        single = next((c for c in res.cells if c.concurrency == 1), None)
        if cell is None or single is None:
            continue
        lens = [r.new_tokens for r in cell.requests]
        share = sum(lens) / cell.runs["generate"][0].computed
        why.append(
            f"{res.spec.name}: {speedup(single):.2f}{TIMES} at 1 request, "
            f"{speedup(cell):.2f}{TIMES} at {TARGET_N} where {100 * share:.0f}% of generate's "
            "tokens are useful"
        )
    if why:
        out += [
            "",
            "Why: what astra gains here is continuous batching's. A static batch decodes every "
            "row until its longest request ends, so with long-tailed lengths most of generate's "
            "work is discarded, while astra's batch shrinks as requests finish (and would take "
            "waiting requests in their place). The ratio at 1 request (no padding on either "
            "side) compares the two systems' cost per token; the gain at "
            f"{TARGET_N} stays below 1 / (useful share) because a decode step's cost grows "
            "less than linearly with its rows (per-step overhead, and on a CPU reading the "
            "weights, do not depend on the batch): " + "; ".join(why) + ".",
        ]
    out += [
        "",
        "Method. One process, both systems on the same weights: each model is written once as "
        "an fp32 Hugging Face directory (`astra.engine.tiny.save_model`; `tiny` = astra's test "
        "model, the ~100M model "
        f"{M100_OVERRIDES['num_hidden_layers']} layers, hidden {M100_OVERRIDES['hidden_size']}, "
        f"{M100_OVERRIDES['num_attention_heads']} heads / {M100_OVERRIDES['num_key_value_heads']}"
        f" kv heads, MLP {M100_OVERRIDES['intermediate_size']}, vocabulary "
        f"{M100_OVERRIDES['vocab_size']:,}, tied embeddings, seeded `random_model` init; "
        "`eos_token_id: null` in both configs) and loaded from it by astra (`CausalLM`, as "
        "`load_model` does) and by `transformers.AutoModelForCausalLM.from_pretrained` "
        "(sdpa attention). **astra**: `TorchEngine` (max_batch 64, continuous batching on its "
        "worker thread) with N asyncio clients sending the requests in order, each its next "
        "when the previous returns; `Sampling(max_new_tokens=L, temperature=1, seed)`, "
        "full-vocabulary sampling, no stop ids, the bench tokenizer's eos id -1 (never "
        "sampled), so every request ends with finish_reason `length` after exactly L tokens "
        "(checked). **generate** (baseline): `model.generate` on static batches of N "
        "consecutive requests, prompts left-padded with an attention mask, `do_sample=True, "
        "temperature=1, top_k=0, top_p=1`, `eos_token_id=None`, `max_new_tokens` = the "
        "longest request of the batch (checked: every batch returns exactly that many), "
        "batches run back to back; only each request's own L tokens count as useful. Requests "
        "at concurrency N: N (one wave) for N > 1, "
        f"{results[0].spec.single_requests if results else 4} back to back for N = 1; "
        "prompts uniform random ids; output lengths seeded per concurrency, identical for "
        "both systems and every repeat. tokens/s = useful tokens / wall time of the run (first "
        "request sent to last result). Same intra-op thread count for both (set in the main "
        "thread and, through `TorchEngine(num_threads=)`, in the engine's worker); 1 by "
        "default: with 2 on these shared cores, both systems' step times jumped several-fold "
        "whenever other jobs held a core (OpenMP threads waiting on each other), and repeats "
        f"disagreed by up to 10{TIMES}; `--threads 2` measures it that way. Each "
        "system is warmed up first (one pass of the widest workload cut to 4 prompt and 2 "
        "output tokens per request; the engine's KV cache then keeps its grown size, as in "
        "service). Repeats "
        "run every concurrency with both systems, the order alternating between systems, "
        "concurrencies and repeats; astra / generate is paired by repeat (median (min"
        f"{DASH}max) of the per-repeat ratios).",
        "",
    ]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run (< 1 min); print only")
    ap.add_argument("--write", dest="write", action="store_true", default=None)
    ap.add_argument("--no-write", dest="write", action="store_false", help="print only")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both systems")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where both systems run")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the runs")
    a = ap.parse_args(argv)
    if a.write and a.device != "cpu":
        ap.error("--write: BENCHMARKS.md's engine section is the CPU run; GPU figures go by hand")
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit(INSTALL_HINT)

    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    loads = [os.getloadavg()[0]]

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    log(f"load average (1 min) {loads[0]:.1f}")
    tmp = Path(tempfile.mkdtemp(prefix="astra-bench-engine-"))
    results = []
    try:
        for i, spec in enumerate(specs(a.quick)):
            budget = a.budget_s if a.budget_s is not None else BUDGET_S[a.quick]
            deadline = time.perf_counter() + budget * SHARE[spec.name]
            res = asyncio.run(
                bench_model(
                    spec,
                    tmp / f"m{i}",
                    threads=a.threads,
                    device=a.device,
                    deadline=deadline,
                    log=log,
                )
            )
            results.append(res)
            loads += [r.load for c in res.cells for runs in c.runs.values() for r in runs]
            shutil.rmtree(tmp / f"m{i}", ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    loads.append(os.getloadavg()[0])
    cmd = "python tools/bench/engine.py" + (" --quick" if a.quick else "")
    if a.threads != 1:
        cmd += f" --threads {a.threads}"
    if a.device != "cpu":
        cmd += f" --device {a.device}"
    if a.budget_s is not None:
        cmd += f" --budget-s {a.budget_s:g}"
    text = render(
        results,
        started=started,
        seconds=time.perf_counter() - t_start,
        loads=loads,
        cmd=cmd,
        threads=a.threads,
    )
    print()
    print(text)
    if a.write if a.write is not None else not a.quick and a.device == "cpu":
        replace_section(ROOT / "BENCHMARKS.md", SECTION, text)
        log(f"wrote the {SECTION[3:]} section of BENCHMARKS.md")


if __name__ == "__main__":
    main()
