"""A version's way out for models of many small tensors: publish, then fetch by two RaaS.

    python tools/bench/version_path.py --old /work/wt-old --label-old ce9958a   # A/B, writes
                                                   # the "Weights: small tensors" section (~2 min)
    python tools/bench/version_path.py --no-write   # this checkout only; prints the section

What bounds an asynchronous run of a small model (or of a LoRA adapter) is not bandwidth but the
cost of each tensor on the way: a version of the embedded `tiny` model is 25 tensors of 0.5 MB in
all, a rank-16 adapter of a Qwen2.5-0.5B-shaped model 336 tensors. Each round publishes the next
version (a perturbed copy of the last, sent as xor+zstd against it, as the trainer does) to an
`astra serve weights` process, then two in-memory receivers (as two RaaS with the built-in engine)
fetch it at once. A round's figures: the publish call, and the slower of the two fetches.
The `-dir` cases fetch into durable checkpoint directories instead (`ReceiverWeightLoader
(durable=True)`, as a RaaS whose HTTP engine, vLLM or SGLang, loads each version from one).

Two baselines in the same invocation:

  packed   the same bytes as one tensor, through the same path: what is left of each figure
           once the per-tensor cost is gone (a floor for this protocol and store);
  old      `--old DIR`: the same rounds from another checkout (its own .venv, this script run
           with its interpreter from its directory), sides in the order A B B A.

`--json F` (internal) runs one side here and writes its figures to F.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SECTION = "## Weights: small tensors (a version's publish and fetch)"
ROUNDS = 40
WARMUP = 3


def tiny_tensors() -> dict[str, Any]:
    """The embedded tiny model's state, fp32 as the trainer publishes it."""
    from astra.engine.tiny import tiny_model

    return {k: v.detach().float().clone() for k, v in tiny_model().state_dict().items()}


def lora_tensors() -> dict[str, Any]:
    """Rank-16 LoRA A/B pairs, fp32, on every linear layer of a Qwen2.5-0.5B-shaped model
    (24 layers, hidden 896, 2 KV heads of 64, MLP 4864): 336 tensors, 8.8M parameters."""
    import torch

    gen = torch.Generator().manual_seed(0)
    shapes = {  # module: (in, out)
        "q_proj": (896, 896), "k_proj": (896, 128), "v_proj": (896, 128), "o_proj": (896, 896),
        "gate_proj": (896, 4864), "up_proj": (896, 4864), "down_proj": (4864, 896),
    }  # fmt: skip
    out = {}
    for layer in range(24):
        for module, (n_in, n_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(16, n_in, generator=gen) * 0.01
            out[f"{prefix}.lora_B.weight"] = torch.randn(n_out, 16, generator=gen) * 0.01
    return out


def as_wire(state: dict[str, Any], packed: bool) -> dict[str, tuple[str, list[int], bytes]]:
    import torch

    views = {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in state.items()}
    if packed:
        blob = b"".join(views.values())
        return {"packed": ("F32", [len(blob) // 4], blob)}
    return {k: ("F32", list(state[k].shape), b) for k, b in views.items()}


async def fetch_one(loader: Any, spec: Any, address: str, published: float) -> float:
    await loader.fetch("policy", spec, address)
    return time.perf_counter() - published


async def rounds(shape: str, packed: bool, n: int, to_dir: bool = False) -> dict[str, list[float]]:
    """Publish + two concurrent fetches per round (in memory, or `to_dir` into durable
    checkpoint directories); seconds per round."""
    import torch

    from astra.clients.raas_weights import ReceiverWeightLoader
    from astra.clients.weights_publish import publish_version
    from astra.raas.backend import VersionSpec

    state = tiny_tensors() if shape == "tiny" else lora_tensors()
    gen = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-m", "astra.cli", "serve", "weights", "--store", f"{tmp}/store",
             "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        try:
            address = json.loads(proc.stdout.readline())["address"]
            how: dict[str, Any] = {"durable": True} if to_dir else {"in_memory": True}
            loaders = [
                ReceiverWeightLoader(f"{tmp}/raas-{i}", receiver_prefix=f"r{i}", **how)
                for i in range(2)
            ]
            out: dict[str, list[float]] = {"publish_s": [], "fetch_s": []}
            base = None
            for i in range(n + WARMUP):
                for t in state.values():  # an AdamW-like step: every element moves a little
                    t.add_(torch.randn(t.shape, generator=gen) * 1e-4)
                wire = as_wire(state, packed)
                started = time.perf_counter()
                await publish_version(address, "policy", f"v{i}", i + 1, wire, base=base)
                published = time.perf_counter()
                spec = VersionSpec(version=i + 1, version_id=f"v{i}")

                fetched = await asyncio.gather(
                    *(fetch_one(x, spec, address, published) for x in loaders)
                )
                if i >= WARMUP:
                    out["publish_s"].append(published - started)
                    out["fetch_s"].append(max(fetched))
                base = (f"v{i}", wire)
            for loader in loaders:
                await loader.close()
            out["tensors"] = [len(wire)]
            out["bytes"] = [sum(len(b) for _, _, b in wire.values())]
            return out
        finally:
            proc.terminate()
            proc.wait(30)


def side(n: int) -> dict[str, Any]:
    """Every case of this checkout: {case: {publish_s: [...], fetch_s: [...], ...}}."""
    cases = {}
    for shape in ("tiny", "lora"):
        for packed in (False, True):
            cases[f"{shape}{'-packed' if packed else ''}"] = asyncio.run(rounds(shape, packed, n))
        cases[f"{shape}-dir"] = asyncio.run(rounds(shape, False, n, to_dir=True))
    return cases


def run_side(checkout: Path, n: int, timeout_s: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [str(checkout / ".venv" / "bin" / "python"), str(Path(__file__).resolve()),
               "--json", f.name, "--rounds", str(n)]  # fmt: skip
        proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{checkout}: exited {proc.returncode}\n{proc.stderr[-3000:]}")
        return json.loads(Path(f.name).read_text())


def ms(values: list[float], q: float) -> float:
    s = sorted(values)
    return 1e3 * s[min(len(s) - 1, int(q * len(s)))]


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of several runs of one side, case by case."""
    out: dict[str, Any] = {}
    for run in runs:
        for case, figs in run.items():
            into = out.setdefault(case, {"publish_s": [], "fetch_s": [], **{
                k: figs[k] for k in ("tensors", "bytes")}})  # fmt: skip
            into["publish_s"] += figs["publish_s"]
            into["fetch_s"] += figs["fetch_s"]
    return out


def render(sides: dict[str, dict[str, Any]], labels: dict[str, str], total_s: float,
           load_before: str, n: int) -> str:  # fmt: skip
    from runs import measured

    rows = ["| case | tensors | MB | side | publish p50 / p90, ms | fetch by 2, p50 / p90, ms |"
            " publish + fetch p50, ms |", "|---|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    order = [s for s in ("old", "new") if s in sides]
    for case in ("tiny", "tiny-packed", "tiny-dir", "lora", "lora-packed", "lora-dir"):
        for s in order:
            f = sides[s][case]
            pub, fet = f["publish_s"], f["fetch_s"]
            rows.append(
                f"| {case} | {f['tensors'][0]} | {f['bytes'][0] / 1e6:.2f} | {labels[s]} | "
                f"{ms(pub, 0.5):.1f} / {ms(pub, 0.9):.1f} | {ms(fet, 0.5):.1f} / {ms(fet, 0.9):.1f} | "
                f"{ms(pub, 0.5) + ms(fet, 0.5):.1f} |"
            )
    new = sides["new"]
    lines = [SECTION, "", *rows, "", measured("version_path.py", total_s,
                                                 load_before), ""]  # fmt: skip
    notes = []
    for shape in ("tiny", "lora"):
        a, p = new[shape], new[f"{shape}-packed"]
        both = ms(a["publish_s"], 0.5) + ms(a["fetch_s"], 0.5)
        floor = ms(p["publish_s"], 0.5) + ms(p["fetch_s"], 0.5)
        per = (both - floor) / max(1, a["tensors"][0] - 1)
        notes.append(
            f"- {shape}, {labels['new']}: publish + fetch {both:.1f} ms against {floor:.1f} ms "
            f"for the same bytes as one tensor: {per:.2f} ms per further tensor."
        )
        if "old" in sides:
            o = sides["old"][shape]
            before = ms(o["publish_s"], 0.5) + ms(o["fetch_s"], 0.5)
            notes.append(
                f"- {shape}: {labels['old']} {before:.1f} ms, {labels['new']} {both:.1f} ms "
                f"({before / both:.2f}x faster)."
            )
            d_old, d_new = (
                ms(sides["old"][f"{shape}-dir"]["fetch_s"], 0.5),
                ms(new[f"{shape}-dir"]["fetch_s"], 0.5),
            )
            notes.append(
                f"- {shape}, fetch by 2 into checkpoint directories: {labels['old']} {d_old:.1f}"
                f" ms, {labels['new']} {d_new:.1f} ms ({d_old / d_new:.2f}x faster)."
            )
    lines += notes
    lines += [
        "",
        "Method:",
        "",
        f"- Each side runs {n} rounds per case after {WARMUP} unmeasured ones, against its own"
        " `astra serve weights` process (durable store, the default); a round perturbs every"
        " element (as an optimiser step does), publishes the version as xor+zstd against the"
        " last one, then two in-memory receivers (`ReceiverWeightLoader(in_memory=True)`, as"
        " RaaS with the built-in engine) fetch it at once; the fetch figure is the slower one.",
        "- tiny: the embedded model in fp32 (what `astra run` publishes); lora: rank-16 A/B"
        " pairs of every linear layer of a Qwen2.5-0.5B-shaped model, fp32; `-packed`: the same"
        " bytes as one tensor through the same path; `-dir`: the same rounds, the two receivers"
        " writing durable checkpoint directories (`ReceiverWeightLoader(durable=True)`, as a"
        " RaaS whose vLLM or SGLang loads each version from one).",
    ]
    if "old" in sides:
        lines.append(
            "- old and new: the same script, each side from its own checkout and"
            " interpreter, in the order A B B A; medians over both runs of a side."
        )
    lines.append("- All processes share this machine's cores with whatever else runs.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, help="a checkout of another commit with its .venv")
    ap.add_argument("--label-old", default="old")
    ap.add_argument("--label-new", default="new")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.json is not None:
        args.json.write_text(json.dumps(side(args.rounds)))
        return 0
    sys.path.insert(0, str(HERE))
    from report import replace_section
    from runs import load

    if args.old is not None and not (args.old / ".venv" / "bin" / "python").exists():
        print(f"--old {args.old}: no .venv there (make .venv/.installed in it)", file=sys.stderr)
        return 2
    started, load_before = time.monotonic(), load()
    here = HERE.parents[1]
    timeout = 600.0
    if args.old is not None:
        order = ["old", "new", "new", "old"]
        runs: dict[str, list] = {"old": [], "new": []}
        for s in order:
            runs[s].append(run_side(args.old if s == "old" else here, args.rounds, timeout))
        sides = {s: merged(r) for s, r in runs.items()}
    else:
        sides = {"new": merged([run_side(here, args.rounds, timeout)])}
    labels = {"old": args.label_old, "new": args.label_new}
    text = render(sides, labels, time.monotonic() - started, load_before, args.rounds)
    print(text)
    if not args.no_write:
        replace_section(here / "BENCHMARKS.md", SECTION, text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
