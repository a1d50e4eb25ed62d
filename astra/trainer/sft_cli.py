"""`astra sft MODEL DATA --out DIR`: supervised fine-tuning on prompt/answer JSONL.

What `astra run` starts as its warm-up stage (astra.trainer.sft); usable on its
own. Logs progress on stderr and prints one JSON line with the figures on
stdout when the model directory is written. Exit 0 on success, 2 on bad
arguments, 1 when training fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command("sft")
@click.argument("model")
@click.argument("data", type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(), help="Model directory to write (new).")
@click.option("--steps", type=click.IntRange(min=1), required=True, help="Optimiser steps.")
@click.option("--lr", type=click.FloatRange(min=0, max=1, min_open=True), default=3e-3)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="torch CPU threads; 0: torch's default.",
)
@click.option(
    "--chat",
    is_flag=True,
    help="Render each prompt through the model's chat template (as the chat workflow does).",
)
@click.option("--log-every", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--log-level", default="info", show_default=True)
def sft_command(
    model: str,
    data: str,
    out: str,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    device: str,
    threads: int,
    chat: bool,
    log_every: int,
    log_level: str,
) -> None:
    """Fine-tune MODEL ('tiny' or a local HF directory) on the prompt/answer records of DATA."""
    from astra.logs import configure

    configure(log_level)
    import torch

    from astra.raas.tasks import read_records
    from astra.trainer.sft import SftSettings, run_sft

    if threads:
        torch.set_num_threads(threads)

    if Path(out).exists():
        raise click.UsageError(f"--out {out} exists")
    try:
        settings = SftSettings(
            steps=steps, lr=lr, batch_size=batch_size, seed=seed, log_every=log_every, chat=chat
        )
        records = read_records(data)
    except (ValueError, OSError) as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        result = run_sft(model, records, out, settings, device=device)
    except (ValueError, FloatingPointError) as exc:
        click.echo(f"astra sft: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps({"out": str(Path(out).resolve()), **result.summary()}))
