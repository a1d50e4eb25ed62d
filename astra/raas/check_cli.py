"""`astra raas check ADDRESS`: a RolloutService implementation checked against the contract.

One line per check on stdout (PASS, FAIL, WARN, SKIP and what was seen), or one
JSON object with --json. Exit status: 0 when no check failed (warnings and
skips allowed), 1 when one did or the server could not be reached, 2 usage.
The checks themselves live in astra.clients.raas_check (and raas_check_weights, raas_rules).
"""

from __future__ import annotations

import asyncio
import json
import sys

import click


@click.command("check")
@click.argument("address", required=False, default="")
@click.option("--policy", default="", help="Policy to run groups of (default: the first served).")
@click.option("--workflow", default="", help="Workflow to run (default: the first served).")
@click.option("--reward", default="", help="Reward to name (default: the workflow's).")
@click.option("--prompt", default="1+1=", show_default=True, help="Prompt text of every group.")
@click.option("--answer", default="2", show_default=True, help="The record's answer field.")
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1), default=8, show_default=True,
    help="Tokens per sample: keep the checks cheap on a real engine.",
)  # fmt: skip
@click.option(
    "--result-timeout", "result_timeout_s", type=click.FloatRange(min=1.0), default=120.0,
    show_default=True, help="Seconds for one group to finish.",
)  # fmt: skip
@click.option("--weights", default="", help="WeightService HOST:PORT for the LoadWeights checks.")
@click.option(
    "--version", "version_id", default="",
    help="Version identity of the policy there to load (needs --weights).",
)  # fmt: skip
@click.option(
    "--serve-weights", is_flag=True,
    help="Also serve corrupt weights from a WeightService of the checker's own: the instance "
    "must refuse them (needs --weights and --version for the version it loads first).",
)  # fmt: skip
@click.option(
    "--allow-busy", is_flag=True,
    help="Run even when the instance has groups running or pending (refused otherwise: they "
    "are a live Dataflow's).",
)  # fmt: skip
@click.option(
    "--as-dataflow", default="", metavar="HOST:PORT",
    help="Serve a DataflowService there for the instance to register with, and check what it "
    "registers and heartbeats (start the RaaS with this Dataflow address). ADDRESS may then "
    "be left out: it is taken from the first registration.",
)  # fmt: skip
@click.option(
    "--register-timeout", "register_timeout_s", type=click.FloatRange(min=1.0), default=120.0,
    show_default=True, help="Seconds to wait for the instance to register (--as-dataflow).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of lines.")
def check_command(
    address: str, as_json: bool, result_timeout_s: float, as_dataflow: str, **options: object
) -> None:
    """Checks the RolloutService at ADDRESS (host:port) against rollout_service.proto.

    Runs a few real groups of one or two samples, so point it at an instance no
    Dataflow dispatches to. With --weights and --version it also loads that version
    (the instance must not hold a newer one) and checks the LoadWeights rules.
    """
    from astra.clients.raas_check import CheckOptions
    from astra.clients.raas_rules import InstanceInUse, summary
    from astra.servers.runtime import install_event_loop_policy

    if not (address or as_dataflow):
        raise click.UsageError("give the instance's ADDRESS, or --as-dataflow HOST:PORT")
    opts = CheckOptions(result_timeout_s=result_timeout_s, **options)  # type: ignore[arg-type]
    install_event_loop_policy()
    try:
        results = asyncio.run(run_checks(address, opts, as_dataflow))
    except (OSError, InstanceInUse, TimeoutError) as exc:
        click.echo(f"astra raas check: {exc}", err=True)
        sys.exit(1)
    report = summary(results)
    if as_json:
        click.echo(json.dumps(report))
    else:
        width = max(len(r.name) for r in results)
        for r in results:
            click.echo(f"{r.status.upper():4}  {r.name:{width}}  {r.detail}")
        click.echo(
            f"{report['pass']} passed, {report['fail']} failed, {report['warn']} warnings, "
            f"{report['skip']} skipped"
        )
    sys.exit(0 if report["ok"] else 1)


async def run_checks(address: str, opts, as_dataflow: str):  # type: ignore[no-untyped-def]
    """The checks, with the checker's own DataflowService on `as_dataflow` when given."""
    from astra.clients.raas_check import RaasChecker
    from astra.raas.registration_record import Recording
    from astra.servers.raas_registration_check import start_checking_dataflow

    if not as_dataflow:
        return await RaasChecker(address, opts).run()
    host, _, port = as_dataflow.rpartition(":")
    opts.recording = Recording()
    dataflow = await start_checking_dataflow(opts.recording, host or "127.0.0.1", int(port or 0))
    try:
        click.echo(f"checking Dataflow on {dataflow.address}: start the RaaS with it", err=True)
        if not address:
            first = await opts.recording.wait_for("register", opts.register_timeout_s)
            if first is None:
                raise TimeoutError(
                    f"no RegisterInstance at {dataflow.address} within "
                    f"{opts.register_timeout_s:.0f} s (--register-timeout)"
                )
            address = first.request.address
        return await RaasChecker(address, opts).run()
    finally:
        await dataflow.stop(0)
