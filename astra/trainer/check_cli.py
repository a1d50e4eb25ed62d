"""`astra trainer check -- COMMAND...`: a trainer program checked against its side of the contract.

Starts a checking DataflowService and a real WeightService on 127.0.0.1
(servers/trainer_check.py), runs COMMAND with `{dataflow}`, `{weights}` and
`{policy}` filled in (`{{`/`}}` are literal braces) until it has committed --steps
new versions, and stops it (SIGTERM, then SIGKILL after --grace). With --restart it
is stopped by --restart-signal (SIGKILL by default) and started again for as many more. Then each rule of
astra.trainer.contract_rules is judged over what was recorded: one line per rule
(PASS, FAIL, SKIP) or one JSON object with --json. Exit status: 0 when no rule
failed, 1 when one did (or COMMAND could not start), 2 usage. The trainer runs in a
session of its own; only that session is signalled.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import click

from astra.waits import within

POLL_S = 0.1


def fill(command: tuple[str, ...], values: dict[str, str]) -> list[str]:
    try:
        return [arg.format_map(values) for arg in command]
    except (KeyError, ValueError, IndexError) as exc:
        raise click.UsageError(f"COMMAND: bad placeholder {exc}; use {sorted(values)}") from exc


async def _stop(proc: asyncio.subprocess.Process, sig: int, grace_s: float) -> None:
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # the session COMMAND was started in (start_new_session)
    except ProcessLookupError:
        return
    try:
        await within(proc.wait(), grace_s)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def _one_run(argv: list[str], run: int, services, opts: dict, log) -> None:
    from astra.trainer.contract_rules import committed

    rec = services.recorder
    rec.run = run
    rec.add("run_start", current_version=services.servicer.current)
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
    )
    deadline = time.monotonic() + opts["timeout_s"]
    while proc.returncode is None and time.monotonic() < deadline:
        if committed(rec.events, run) >= opts["steps"]:
            break
        await asyncio.sleep(POLL_S)
    last = run == opts["runs"]
    sig = signal.SIGTERM if last else getattr(signal, f"SIG{opts['restart_signal']}")
    await _stop(proc, sig, opts["grace_s"])
    rec.add("run_end", returncode=proc.returncode)


async def check_trainer(
    command: tuple[str, ...], opts: dict, log_path: str | None, tmp: str
) -> list:
    """Runs COMMAND against checking services (their store under `tmp`); every rule's verdict."""
    from astra.servers.trainer_check import BatchShape, start_checking_services
    from astra.trainer.contract_rules import Recording, evaluate

    shape = BatchShape(vocab_size=opts["vocab_size"], lease_s=opts["lease_s"])
    services = await start_checking_services(Path(tmp) / "weights", opts["policy"], shape)
    values = {"dataflow": services.dataflow.address, "weights": services.weights.address}
    log = open(log_path, "ab") if log_path else asyncio.subprocess.DEVNULL  # noqa: SIM115
    try:
        argv = fill(command, {**values, "policy": opts["policy"]})
        for run in range(1, opts["runs"] + 1):
            await _one_run(argv, run, services, opts, log)
    finally:
        if log_path:
            log.close()  # type: ignore[union-attr]
        await services.stop()
    return evaluate(Recording(services.recorder.events, opts["steps"], opts["runs"] > 1))


@click.group("trainer")
def trainer_group() -> None:
    """Check a trainer program against its side of the contract."""


@trainer_group.command("check", context_settings={"ignore_unknown_options": True})
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="New versions each run of the trainer must commit.")  # fmt: skip
@click.option("--restart", is_flag=True, help="Stop the trainer after --steps, start it again.")
@click.option("--restart-signal", type=click.Choice(["KILL", "TERM"]), default="KILL",
              show_default=True, help="How --restart stops the first run.")  # fmt: skip
@click.option("--policy", default="policy", show_default=True, help="The policy ({policy}).")
@click.option("--vocab-size", type=click.IntRange(min=2), default=256, show_default=True,
              help="Token ids of the synthetic batches are below this.")  # fmt: skip
@click.option("--lease", "lease_s", type=click.FloatRange(min=0.5), default=10.0,
              show_default=True, help="Batch lease in seconds (Dataflow's default is 300).")  # fmt: skip
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1.0), default=300.0,
              show_default=True, help="Seconds each run may take to commit --steps versions.")  # fmt: skip
@click.option("--grace", "grace_s", type=click.FloatRange(min=0.0), default=15.0,
              show_default=True, help="Seconds between SIGTERM and SIGKILL.")  # fmt: skip
@click.option("--log", "log_path", type=click.Path(dir_okay=False), default=None,
              help="Append the trainer's stdout and stderr to this file.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of lines.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def check_command(
    command: tuple[str, ...], restart: bool, as_json: bool, log_path: str | None, **opts: object
) -> None:
    """Runs COMMAND (a trainer; placeholders {dataflow}, {weights}, {policy}) against a
    checking Dataflow and WeightService and judges its side of the contract."""
    from astra.servers.runtime import install_event_loop_policy
    from astra.trainer.contract_rules import summary

    opts["runs"] = 2 if restart else 1
    install_event_loop_policy()
    # asyncio.run returns once the store's worker threads are done: then the store goes.
    tmp = tempfile.TemporaryDirectory(prefix="astra-trainer-check-", ignore_cleanup_errors=True)
    try:
        with tmp:
            verdicts = asyncio.run(check_trainer(command, opts, log_path, tmp.name))
    except OSError as exc:  # COMMAND not found, a log that cannot be written
        click.echo(f"astra trainer check: {exc}", err=True)
        sys.exit(1)
    report = summary(verdicts)
    if as_json:
        click.echo(json.dumps(report))
    else:
        width = max(len(v.name) for v in verdicts)
        for v in verdicts:
            click.echo(f"{v.status.upper():4}  {v.name:{width}}  {v.detail}")
            if v.status == "fail":
                click.echo(f"      {'':{width}}  (rule: {v.rule})")
        click.echo(f"{report['pass']} passed, {report['fail']} failed, {report['skip']} skipped")
    sys.exit(0 if report["ok"] else 1)
