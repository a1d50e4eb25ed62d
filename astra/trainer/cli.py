"""`astra serve trainer` / `python -m astra.trainer`: flags -> TrainerConfig -> serve_trainer.

Parses and validates the config before importing torch or gRPC, so --help
and config errors are fast. `--nproc N` (N > 1) re-runs the same command
under torchrun (`torch.distributed.run --standalone`), one rank per process:
rank 0 trains and serves, the others follow; gloo on CPU, nccl on CUDA. Each rank dies with
torchrun (astra.parent_death), however torchrun goes.
"""

from __future__ import annotations

import asyncio
import os
import sys

import click

TORCHRUN_PID = "ASTRA_TORCHRUN_PID"  # set for the ranks of a torchrun this command became


def _argv(
    config_path: str | None,
    checkpoint_dir: str | None,
    resume: bool | None,
    log_level: str,
    flags: dict[str, object],
) -> list[str]:
    """The same command's flags, for every rank (without --nproc)."""
    named = {**flags, "config": config_path, "checkpoint_dir": checkpoint_dir}
    argv = [f"--log-level={log_level}"]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in named.items() if v is not None]
    if "policy_id" in flags and flags["policy_id"] is not None:
        argv = [a.replace("--policy-id=", "--policy=") for a in argv]
    return [*argv, "--resume"] if resume else argv


@click.command("trainer")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML config.")
@click.option("--dataflow", default=None, help="Dataflow host:port.")
@click.option("--weights", default=None, help="WeightService host:port.")
@click.option("--policy", "policy_id", default=None, help="Policy trained.")
@click.option("--model", default=None, help="'tiny' or a Hugging Face directory.")
@click.option("--host", default=None, help="TrainerService listen address.")
@click.option("--port", type=int, default=None, help="TrainerService port (0 picks one).")
@click.option("--metrics-port", type=int, default=None, help="Prometheus port (0 picks one).")
@click.option("--device", default=None, help="cpu or cuda.")
@click.option("--num-steps", type=int, default=None, help="Optimiser steps; 0 runs until stopped.")
@click.option("--checkpoint-dir", default=None, help="Checkpoint root.")
@click.option("--resume", is_flag=True, default=None, help="Continue from the newest checkpoint.")
@click.option("--nproc", type=click.IntRange(1), default=1, show_default=True, help="FSDP ranks.")
@click.option("--log-level", default="info", show_default=True)
def trainer_command(
    config_path: str | None,
    nproc: int,
    log_level: str,
    checkpoint_dir: str | None,
    resume: bool | None,
    **flags: object,
) -> None:
    """Run the trainer (env overrides: ASTRA_TRAINER__SECTION__KEY)."""
    from astra.config import ConfigError, load_config
    from astra.trainer.config import TrainerConfig

    checkpoint = {k: v for k, v in (("dir", checkpoint_dir), ("resume", resume)) if v is not None}
    overrides: dict[str, object] = {**flags, "checkpoint": checkpoint or None}
    try:
        config = load_config(
            TrainerConfig, config_path, env_prefix="ASTRA_TRAINER", overrides=overrides
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    if nproc > 1 and "RANK" not in os.environ:
        argv = _argv(config_path, checkpoint_dir, resume, log_level, flags)
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        os.environ[TORCHRUN_PID] = str(os.getpid())  # exec keeps the pid: the ranks' parent
        os.execv(sys.executable, [*run, f"--nproc-per-node={nproc}", "-m", "astra.trainer", *argv])
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank started by torchrun
        from astra.parent_death import die_with_parent

        # torchrun starts each rank in a session of its own and stops them on SIGTERM; when
        # torchrun is SIGKILLed instead (the OOM killer, a stop whose grace ran out), the
        # kernel now ends its ranks too, which would otherwise keep their GPUs and ports.
        parent = os.environ.get(TORCHRUN_PID, "")
        die_with_parent(parent=int(parent) if parent.isdigit() else None)
    from astra.logs import configure

    configure(log_level)
    held = None
    if config.checkpoint.dir and os.environ.get("RANK", "0") == "0":  # rank 0 writes them
        from astra.statelock import acquire_or_exit

        held = acquire_or_exit(config.checkpoint.dir, "trainer")  # one writer per root
    from astra.damage import exit_if_damaged
    from astra.lora.format import AdapterError
    from astra.servers.trainer_serve import serve_trainer

    with exit_if_damaged("trainer"):
        try:
            asyncio.run(serve_trainer(config))
        except (ConfigError, AdapterError) as exc:  # found at start-up (trainer.lora, say)
            raise click.ClickException(str(exc)) from None
    if held is not None:
        held.release()
