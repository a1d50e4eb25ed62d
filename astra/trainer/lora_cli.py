"""`astra trainer merge-lora CHECKPOINT --model BASE --out DIR`: a LoRA checkpoint as a full model.

Writes the base with every adapted weight merged (W + alpha/rank * B @ A) as a
Hugging Face directory any engine loads (astra.trainer.lora.merge_checkpoint).
Prints one JSON line naming the directory. Exit 0 on success, 2 on bad
arguments, 1 when the checkpoint cannot be merged on that base (another base:
the message names base_digest), 65 when the checkpoint is damaged.
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("merge-lora")
@click.argument("checkpoint", type=click.Path(file_okay=False, exists=True))
@click.option("--model", required=True, help="The base it was trained on: 'tiny' or a directory.")
@click.option("--out", required=True, type=click.Path(), help="Model directory to write (new).")
def merge_command(checkpoint: str, model: str, out: str) -> None:
    """Merge the adapter of a LoRA trainer's CHECKPOINT (a step-N directory) into its base."""
    if Path(out).exists():
        raise click.UsageError(f"--out {out} exists")
    from astra.config import ConfigError
    from astra.damage import exit_if_damaged
    from astra.lora.format import AdapterError
    from astra.trainer.lora import merge_checkpoint

    with exit_if_damaged("trainer merge-lora"):
        try:
            path = merge_checkpoint(checkpoint, model, out)
        except (ConfigError, AdapterError) as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(json.dumps({"out": str(Path(path).resolve())}))
