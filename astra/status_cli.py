"""`astra status`: Dataflow's status as JSON, found by address or by a run's directory."""

from __future__ import annotations

import asyncio
import json
import sys

import click


@click.command("status")
@click.option("--dataflow", "address", default=None, help="HOST:PORT of Dataflow.")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="A run of `astra run`: its Dataflow (from RUN_DIR/run.json).",
)
@click.option("--timeout", "timeout_s", type=float, default=10.0, show_default=True)
def status_command(address: str | None, run_dir: str | None, timeout_s: float) -> None:
    """Print Dataflow's status as JSON (counters and versions as numbers)."""
    import grpc

    from astra.clients.channel import connect_hint
    from astra.clients.dataflow import DataflowClient
    from astra.clients.jsonview import as_dict

    if (address is None) == (run_dir is None):
        raise click.UsageError("give --dataflow HOST:PORT or --run-dir RUN_DIR (one of them)")
    if run_dir is not None:
        address = _run_dataflow(run_dir)
    assert address is not None  # one of the two, checked above

    async def fetch() -> dict:
        async with DataflowClient(address, timeout_s=timeout_s) as client:
            return as_dict(await client.get_status())

    try:
        out = asyncio.run(fetch())
    except grpc.aio.AioRpcError as exc:
        hint = connect_hint(exc.code())
        click.echo(f"status: {exc.code().name}: {exc.details()}{hint}", err=True)
        sys.exit(1)
    click.echo(json.dumps(out, indent=2, sort_keys=True))


def _run_dataflow(run_dir: str) -> str:
    """The address of the Dataflow of the run in `run_dir`, from its run.json."""
    from pathlib import Path

    path = Path(run_dir) / "run.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise click.UsageError(f"{path}: cannot read it ({exc}): is {run_dir} a run?") from None
    found = [c for c in record.get("children", []) if c.get("role") == "dataflow"]
    if not found or not found[-1].get("address"):
        raise click.UsageError(f"{path}: no Dataflow with an address (the run is starting?)")
    if record.get("supervisor", {}).get("state") == "ended":
        click.echo(f"note: the run in {run_dir} has ended; its Dataflow is gone", err=True)
    return str(found[-1]["address"])
