"""`astra top --dataflow HOST:PORT | --run-dir DIR [--once]`: the live view of a running system.

Polls Dataflow's GetStatus (and, with --run-dir, each trainer's: their addresses are
in DIR/run.json, which `astra run` writes) every --interval seconds and redraws the
frame `astra run` shows (astra.run.view) until Ctrl-C. --once prints one frame as
plain text and exits: 0 when Dataflow answered, 1 when it did not. Rates (groups/s,
steps/s) need two polls, so --once shows none. On a stdout that is not a terminal
each refresh prints a plain frame.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import click


def _run_tls(run_dir: Path) -> None:
    """A run made with `tls: true` is watched with its own credentials, unless others are set."""
    import os

    from astra.tls_material import ENV_DIR, tls_paths

    own = run_dir / "tls"
    if (own / "cert.pem").is_file() and tls_paths() is None:
        os.environ[ENV_DIR] = str(own.resolve())


def addresses_from_run_dir(run_dir: Path) -> tuple[str, dict[str, str]]:
    """Dataflow's address and each policy's trainer address, from run.json."""
    path = run_dir / "run.json"
    if not path.is_file():
        raise click.UsageError(f"{path}: not found (not a run directory, or not started yet)")
    children = json.loads(path.read_text()).get("children", [])
    dataflow = next((c.get("address") for c in children if c.get("role") == "dataflow"), None)
    if not dataflow:
        raise click.UsageError(f"{path}: no Dataflow address yet")
    trainers = {
        str(c["name"]).removeprefix("trainer-"): c["address"]
        for c in children
        if c.get("role") == "trainer" and c.get("address")
    }
    return dataflow, trainers


def recipe_facts(run_dir: Path) -> tuple[str, int | None]:
    """The recipe's name and trainer.num_steps (from DIR/recipe.yaml, when readable)."""
    import yaml

    try:
        recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text()) or {}
        steps = (recipe.get("trainer") or {}).get("num_steps")
        return str(recipe.get("name") or run_dir.name), int(steps) if steps else None
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return run_dir.name, None


async def _top(poller: Any, *, once: bool, interval_s: float, width: int | None) -> int:
    from astra.run.view import LiveView, render_text

    try:
        if once:
            await poller.poll()
            click.echo(render_text(poller.snapshot(), width=width or 110), nl=False)
            return 0 if poller.last_dataflow and poller.error is None else 1
        live = LiveView(sys.stdout) if sys.stdout.isatty() else None
        try:
            while True:
                await poller.poll()
                if live is not None:
                    live.update(poller.snapshot())
                else:
                    click.echo(render_text(poller.snapshot(), width=width or 110))
                await asyncio.sleep(interval_s)
        finally:
            if live is not None:
                live.stop()
    finally:
        await poller.close()


@click.command("top")
@click.option("--dataflow", "address", default=None, help="HOST:PORT of Dataflow.")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="A run directory: addresses from its run.json (trainers included).",
)
@click.option("--once", is_flag=True, help="Print one plain-text frame and exit.")
@click.option(
    "--interval", "interval_s", type=click.FloatRange(0.1), default=1.0, show_default=True
)
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.1), default=3.0, show_default=True)
@click.option("--width", type=click.IntRange(40), default=None, help="Columns of a plain frame.")
def top_command(
    address: str | None,
    run_dir: str | None,
    once: bool,
    interval_s: float,
    timeout_s: float,
    width: int | None,
) -> None:
    """Live view of a running system (Dataflow, RaaS pool, trainers); Ctrl-C exits."""
    if address is None and run_dir is None:
        raise click.UsageError("give --dataflow HOST:PORT or --run-dir DIR")
    trainers: dict[str, str] = {}
    name, num_steps = "top", None
    if run_dir is not None:
        _run_tls(Path(run_dir))
        found, trainers = addresses_from_run_dir(Path(run_dir))
        address = address or found
        name, num_steps = recipe_facts(Path(run_dir))
    assert address is not None

    from astra.run.poller import StatusPoller

    async def main() -> int:
        poller = StatusPoller(
            address,
            trainers,
            name=name,
            num_steps=num_steps,
            timeout_s=timeout_s,
            show_elapsed=False,
        )
        return await _top(poller, once=once, interval_s=interval_s, width=width)

    try:
        code = asyncio.run(main())
    except KeyboardInterrupt:
        code = 0
    sys.exit(code)
