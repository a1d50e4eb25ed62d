#!/usr/bin/env python
"""Runs the real vLLM and/or SGLang servers through Astra's HTTP adapters and checks them.

    python tools/gpu/run_engines.py --model /path/to/small/hf/model [--engines vllm,sglang]
    python tools/gpu/run_engines.py                # no --model: a random 4-layer Qwen3 + byte
                                                   # tokenizer is written first (needs `tokenizers`)
    python tools/gpu/run_engines.py --fake         # CPU dry run against the FAKE servers

Installs nothing; an engine whose package is not importable is skipped (exit 1 if every
engine was skipped). For each engine, one after the other: launch the server
(`VLLMEngine.launch` / `SGLangEngine.launch`), generate a few sequences at temperature 1 and
compare their log-probs with a full forward pass of Astra's own CausalLM on the same weights
(fp32; the built-in engine's log-probs match that forward to 1e-4), measure tokens/s with
`--requests` concurrent generations, then swap to a second checkpoint version (final norm
x1.5, written as a full HF directory) while `--inflight` long generations run: pause ->
update from disk -> resume. Afterwards the log-probs must match the new weights (and not the
old), every token must carry version 1, and the sequences cut by the swap must carry
0...0 1...1. Prints a table, writes JSON to --out, exits 0 only if every run engine passed.
Keep the whole run under --deadline-s (default 280 s).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from astra.waits import within

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from astra.engine.api import Generation, Sampling  # noqa: E402
from astra.engine.http import SGLangEngine, VLLMEngine, WeightsDir  # noqa: E402
from astra.engine.http.base import HTTPEngine  # noqa: E402
from astra.engine.tiny import load_model, random_model, save_tiny  # noqa: E402
from astra.engine.tokenizer import load_tokenizer  # noqa: E402
from astra.engine.torch_weights import load_state, to_raw  # noqa: E402
from astra.weights.checkpoint import write_full  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1 + 1 =", "Once upon a time"]
POLICY = "policy"
EOS = "<|endoftext|>"
RANDOM_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 4,
    "bos_token_id": 256,
    "eos_token_id": 256,
    "torch_dtype": "bfloat16",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="local HF model directory (default: write a random one)")
    p.add_argument("--engines", default="vllm,sglang", help="comma list of vllm, sglang")
    p.add_argument("--fake", action="store_true", help="use the FAKE CPU servers (dry run)")
    p.add_argument("--dtype", default="bfloat16", help="server dtype (default bfloat16)")
    p.add_argument("--requests", type=int, default=32, help="concurrent requests for tokens/s")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--inflight", type=int, default=8, help="generations running during the swap")
    p.add_argument(
        "--long-tokens", type=int, default=None, help="their max new tokens (1024; --fake: 96)"
    )
    p.add_argument("--max-mean-diff", type=float, default=0.1, help="mean |logprob diff| bound")
    p.add_argument("--max-abs-diff", type=float, default=1.5, help="max |logprob diff| bound")
    p.add_argument("--startup-timeout-s", type=float, default=200.0)
    p.add_argument("--deadline-s", type=float, default=280.0, help="whole run (all engines)")
    p.add_argument("--vllm-args", default="", help="extra vLLM server args (one string)")
    p.add_argument("--sglang-args", default="", help="extra SGLang server args (one string)")
    p.add_argument("--workdir", default="", help="where checkpoints and logs go (default: tmp)")
    p.add_argument("--out", default="gpu-engines-results.json")
    return p.parse_args()


# -- checkpoints -----------------------------------------------------------------------------


def make_random_model(directory: Path) -> Path:
    """A random 4-layer Qwen3 (bf16) with a byte-level tokenizer, as a full HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    # Fill the vocabulary: a random model samples every id, and servers detokenize them all.
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(RANDOM_CONFIG["vocab_size"] - 257)])
    assert vocab[EOS] == RANDOM_CONFIG["eos_token_id"]
    assert tok.get_vocab_size(with_added_tokens=True) == RANDOM_CONFIG["vocab_size"]
    files = {
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "model_max_length": RANDOM_CONFIG["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
            }
        ).encode(),
        "generation_config.json": json.dumps({"eos_token_id": vocab[EOS]}).encode(),
    }
    model = random_model(RANDOM_CONFIG, seed=0, dtype=torch.bfloat16)
    state = {n: to_raw(t) for n, t in model.hf_state_dict().items()}
    write_full(directory, state, RANDOM_CONFIG, version="0", files=files)
    return directory


def make_next_version(src: Path, dst: Path) -> Path:
    """`src` with the final norm scaled by 1.5, written as a full directory (plus its
    tokenizer and generation files, so any loader finds what it expects)."""
    state = load_state(src)
    name = "model.norm.weight"
    state[name] = (state[name].float() * 1.5).to(state[name].dtype)
    config = json.loads((src / "config.json").read_text())
    files = {
        p.name: p.read_bytes()
        for p in src.iterdir()
        if p.is_file()
        and p.suffix in (".json", ".txt", ".model", ".jinja")
        and p.name not in ("config.json", "model.safetensors.index.json")
    }
    write_full(dst, {n: to_raw(t) for n, t in state.items()}, config, version="1", files=files)
    return dst


class Reference:
    """Astra's CausalLM on one checkpoint, fp32: log-probs of given tokens (temperature 1)."""

    def __init__(self, path: Path | str, device: str) -> None:
        self.model, _ = load_model(path, device, torch.float32)
        self.device = device

    @torch.no_grad()
    def logprobs(self, prompt: list[int], tokens: list[int]) -> list[float]:
        ids = torch.tensor([prompt + tokens], device=self.device)
        logits = self.model.forward_full(ids)[0].float()
        n = len(prompt)
        lp = torch.log_softmax(logits[n - 1 : n - 1 + len(tokens)], -1)
        return [float(lp[i, t]) for i, t in enumerate(tokens)]


def diffs(ref: Reference, prompts: list[list[int]], gens: list[Generation]) -> tuple[float, float]:
    """(max, mean) |engine log-prob - reference| over every token of `gens`."""
    all_d: list[float] = []
    for prompt, gen in zip(prompts, gens, strict=True):
        want = ref.logprobs(prompt, gen.token_ids)
        all_d += [abs(a - b) for a, b in zip(gen.logprobs, want, strict=True)]
    if not all_d:
        return float("nan"), float("nan")
    return max(all_d), sum(all_d) / len(all_d)


# -- one engine ------------------------------------------------------------------------------


def make_engine(
    kind: str, args: argparse.Namespace, model: Path, work: Path, fakes: list
) -> HTTPEngine:
    tok = load_tokenizer(model)
    common = {"max_running": max(64, args.requests * 2), "drain_timeout_s": 20.0}
    if args.fake:
        from astra.testing.fake_engines import FakeEngineServer

        fake = FakeEngineServer(kind, model, served_model_name=POLICY, step_delay_s=0.002)  # type: ignore[arg-type]
        fakes.append(fake.start())
        if kind == "sglang":
            return SGLangEngine(fake.url, POLICY, tok, **common)
        return VLLMEngine(fake.url, POLICY, POLICY, tok, **common)
    if kind == "vllm":
        extra = ["--dtype", args.dtype, "--gpu-memory-utilization", "0.3",
                 "--max-model-len", "2048", "--enforce-eager", "--seed", "0"]  # fmt: skip
        extra += shlex.split(args.vllm_args)
        return VLLMEngine.launch(
            model, POLICY, tok, served_model_name=POLICY, extra_args=extra,
            log_path=work / "vllm-server.log", **common,
        )  # fmt: skip
    extra = ["--dtype", args.dtype, "--mem-fraction-static", "0.3",
             "--context-length", "2048", "--disable-cuda-graph"]  # fmt: skip
    extra += shlex.split(args.sglang_args)
    return SGLangEngine.launch(
        model, POLICY, tok, extra_args=extra, log_path=work / "sglang-server.log", **common
    )


async def check_engine(
    engine: HTTPEngine,
    args: argparse.Namespace,
    v1: Path,
    ref0: Reference,
    ref1: Reference,
) -> dict[str, Any]:
    row: dict[str, Any] = {"failures": []}
    fail: list[str] = row["failures"]
    tok = engine.tokenizer(POLICY)
    prompts = [tok.encode(p) for p in PROMPTS]
    t0 = time.monotonic()
    await engine.wait_ready(args.startup_timeout_s)
    row["startup_s"] = round(time.monotonic() - t0, 1)

    async def sample(ps: list[list[int]], n: int, seed0: int) -> list[Generation]:
        return list(
            await asyncio.gather(
                *(
                    engine.generate(POLICY, p, Sampling(max_new_tokens=n, seed=seed0 + i))
                    for i, p in enumerate(ps)
                )
            )
        )

    # 1. log-probs on version 0 vs the reference forward pass
    gens = await sample(prompts, 32, 0)
    row["v0_max_diff"], row["v0_mean_diff"] = diffs(ref0, prompts, gens)
    if not row["v0_mean_diff"] <= args.max_mean_diff or not row["v0_max_diff"] <= args.max_abs_diff:
        fail.append(
            f"v0 log-probs off: max {row['v0_max_diff']:.3g} mean {row['v0_mean_diff']:.3g}"
        )
    if any(g.versions != [0] * len(g.token_ids) for g in gens):
        fail.append("v0 tokens not all labelled 0")

    # 2. throughput
    batch = [prompts[i % len(prompts)] for i in range(args.requests)]
    t0 = time.monotonic()
    gens = await sample(batch, args.max_new_tokens, 100)
    wall = time.monotonic() - t0
    row["tokens"] = sum(len(g.token_ids) for g in gens)
    row["tokens_per_s"] = round(row["tokens"] / wall, 1)
    if any(g.finish_reason not in ("stop", "length") for g in gens):
        fail.append(f"finish reasons {sorted({g.finish_reason for g in gens})}")

    # 3. swap while long generations run: pause -> update from disk -> resume
    inflight = [prompts[i % len(prompts)] for i in range(args.inflight)]
    long_n = args.long_tokens or (96 if args.fake else 1024)
    long_n = min(long_n, 2048 - max(len(p) for p in inflight) - 1)
    running = asyncio.gather(
        *(
            engine.generate(POLICY, p, Sampling(max_new_tokens=long_n, seed=500 + i))
            for i, p in enumerate(inflight)
        )
    )
    await asyncio.sleep(0.05 if args.fake else 0.3)
    t0 = time.monotonic()
    await engine.swap_weights({POLICY: 1}, {POLICY: WeightsDir(v1)})
    row["update_s"] = round(time.monotonic() - t0, 2)
    cut = await running
    row["split_sequences"] = sum(0 in g.versions and 1 in g.versions for g in cut)
    for g in cut:
        k = g.versions.count(0)
        if g.versions != [0] * k + [1] * (len(g.versions) - k):
            fail.append("versions of a sequence cut by the swap are not 0..0 1..1")
            break
    if engine.version(POLICY) != 1:
        fail.append(f"engine version {engine.version(POLICY)} after the swap")

    # 4. log-probs on version 1: match the new weights, not the old
    gens = await sample(prompts, 32, 1000)
    row["v1_max_diff"], row["v1_mean_diff"] = diffs(ref1, prompts, gens)
    _, old_mean = diffs(ref0, prompts, gens)
    row["v1_vs_old_mean_diff"] = old_mean
    if not row["v1_mean_diff"] <= args.max_mean_diff:
        fail.append(f"v1 log-probs off: mean {row['v1_mean_diff']:.3g}")
    if not old_mean > 2 * row["v1_mean_diff"]:
        fail.append(f"update had no visible effect (mean diff vs old {old_mean:.3g})")
    if any(g.versions != [1] * len(g.token_ids) for g in gens):
        fail.append("tokens after the swap not all labelled 1")
    # the cut sequences' version-1 tokens also follow the new weights
    post = [(p, g) for p, g in zip(inflight, cut, strict=True) if 1 in g.versions]
    if post:
        d = []
        for p, g in post:
            k = g.versions.index(1)
            want = ref1.logprobs(p, g.token_ids)[k:]
            d += [abs(a - b) for a, b in zip(g.logprobs[k:], want, strict=True)]
        row["cut_v1_mean_diff"] = sum(d) / max(1, len(d))
        if not row["cut_v1_mean_diff"] <= args.max_mean_diff:
            fail.append(f"resumed tokens off the new weights: {row['cut_v1_mean_diff']:.3g}")
    return row


async def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    start = time.monotonic()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="astra-gpu-engines-"))
    work.mkdir(parents=True, exist_ok=True)
    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    device = "cpu" if args.fake or not torch.cuda.is_available() else "cuda"
    if args.model:
        model = Path(args.model)
    elif args.fake:
        model = save_tiny(work / "v0") if not (work / "v0").exists() else work / "v0"
    else:
        model = work / "v0"
        if not model.exists():
            make_random_model(model)
    v1 = work / "v1"
    if v1.exists():
        shutil.rmtree(v1)
    make_next_version(model, v1)
    ref0, ref1 = Reference(model, device), Reference(v1, device)
    rows: list[dict[str, Any]] = []
    for kind in kinds:
        row: dict[str, Any] = {"engine": kind, "status": "skipped", "failures": []}
        rows.append(row)
        if kind not in ("vllm", "sglang"):
            row["failures"] = [f"unknown engine {kind!r}"]
            row["status"] = "FAIL"
            continue
        if not args.fake and importlib.util.find_spec(kind) is None:
            row["note"] = f"{kind} is not importable here"
            continue
        left = args.deadline_s - (time.monotonic() - start)
        if left < 30:
            row["note"] = "no time left under --deadline-s"
            continue
        fakes: list[Any] = []
        engine = make_engine(kind, args, model, work, fakes)
        try:
            row.update(await within(check_engine(engine, args, v1, ref0, ref1), left))
            row["status"] = "ok" if not row["failures"] else "FAIL"
        except Exception as exc:  # report, then move on to the next engine
            row["status"] = "FAIL"
            row["failures"].append(f"{type(exc).__name__}: {exc}"[:2000])
            traceback.print_exc()
            if engine.process is not None:
                print(f"--- {kind} server log tail ---\n{engine.process.log_tail()}", flush=True)
        finally:
            await engine.close()
            for fake in fakes:
                fake.stop()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        ("engine", "engine"), ("status", "status"), ("startup s", "startup_s"),
        ("tokens/s", "tokens_per_s"), ("lp max diff v0", "v0_max_diff"),
        ("lp mean diff v0", "v0_mean_diff"), ("lp mean diff v1", "v1_mean_diff"),
        ("v1 vs old", "v1_vs_old_mean_diff"), ("update s", "update_s"),
        ("split seqs", "split_sequences"),
    ]  # fmt: skip

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    table = [[h for h, _ in cols]] + [[cell(r.get(k)) for _, k in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for i, line in enumerate(table):
        print(" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    for r in rows:
        for f in r.get("failures", []):
            print(f"{r['engine']}: FAIL: {f}")
        if r.get("note"):
            print(f"{r['engine']}: {r['note']}")


def main() -> int:
    args = parse_args()
    rows = asyncio.run(run_all(args))
    print_table(rows)
    Path(args.out).write_text(json.dumps({"fake": args.fake, "rows": rows}, indent=2) + "\n")
    ran = [r for r in rows if r["status"] != "skipped"]
    if not ran:
        print("no engine ran (none importable?)", file=sys.stderr)
        return 1
    return 0 if all(r["status"] == "ok" for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
