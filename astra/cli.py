"""The `astra` command line. Parses config before importing gRPC, so --help is fast."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import sys
from collections.abc import Callable

import click


def _json_object(text: str, option: str) -> dict:
    """`text` as a JSON object ({} when empty); a BadParameter naming `option` otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=option) from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint=option)
    return value


def _logging(level: str) -> None:
    from astra.logs import configure

    configure(level)


def _metrics_and_log_level(metrics_help: str = "Prometheus HTTP port (0 picks).") -> Callable:
    """The `--metrics-port` and `--log-level` options of `astra serve dataflow|raas|weights`."""

    def decorate(f: Callable) -> Callable:
        f = click.option("--log-level", default="info", show_default=True)(f)
        return click.option("--metrics-port", type=int, default=None, help=metrics_help)(f)

    return decorate


@click.group()
@click.version_option(package_name="astra-rl")
@click.option(
    "--tls",
    "tls_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Mutual TLS with the credentials in this directory (ca.pem, cert.pem, key.pem; "
    "`astra tls init`), for this command and the processes it starts. Same as ASTRA_TLS_DIR.",
)
@click.pass_context
def main(ctx: click.Context, tls_dir: str | None) -> None:
    """Astra: asynchronous RL post-training over gRPC services."""
    import os

    from astra.tls import current_tls
    from astra.tls_material import ENV_DIR, TlsConfigError

    if tls_dir is not None:
        os.environ[ENV_DIR] = tls_dir
    if ctx.invoked_subcommand == "tls":
        return  # writes the credentials a later command reads
    try:
        current_tls()  # a wrong setting fails here, naming the variable, not at the first call
    except TlsConfigError as exc:
        raise click.UsageError(str(exc)) from exc


def _add_subcommands() -> None:
    from astra.raas.check_cli import check_command
    from astra.run.cli import run_command
    from astra.run.doctor import doctor_command
    from astra.run.raas_cli import raas
    from astra.run.top import top_command
    from astra.status_cli import status_command
    from astra.tls_cli import tls
    from astra.trainer.check_cli import trainer_group
    from astra.trainer.cli import trainer_command
    from astra.trainer.lora_cli import merge_command
    from astra.trainer.sft_cli import sft_command
    from astra.weights.cli import weights

    main.add_command(weights)
    main.add_command(run_command)
    raas.add_command(check_command)
    main.add_command(raas)
    main.add_command(top_command)
    main.add_command(status_command)
    main.add_command(doctor_command)
    main.add_command(sft_command)
    main.add_command(tls)
    trainer_group.add_command(merge_command)
    main.add_command(trainer_group)
    serve.add_command(trainer_command, "trainer")


@main.group()
def serve() -> None:
    """Run one of the four services."""


@serve.command("dataflow")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="YAML config.")
@click.option("--host", default=None, help="Listen address (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="gRPC port (default 50051; 0 picks one).")
@click.option("--state-dir", default=None, help="Durable state directory.")
@_metrics_and_log_level("Prometheus HTTP port.")
def serve_dataflow(
    config_path: str | None,
    host: str | None,
    port: int | None,
    state_dir: str | None,
    metrics_port: int | None,
    log_level: str,
) -> None:
    """Run the Dataflow coordinator (env overrides: ASTRA_DATAFLOW__SECTION__KEY)."""
    from astra.config import ConfigError, load_config
    from astra.dataflow.config import DataflowConfig

    _logging(log_level)
    try:
        config = load_config(
            DataflowConfig,
            config_path,
            env_prefix="ASTRA_DATAFLOW",
            overrides={
                "host": host,
                "port": port,
                "state_dir": state_dir,
                "metrics_port": metrics_port,
            },
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    from astra.damage import exit_if_damaged
    from astra.statelock import acquire_or_exit

    held = acquire_or_exit(config.state_dir, "Dataflow")  # one Dataflow per state, for life
    with exit_if_damaged("dataflow"):
        asyncio_run(_serve_dataflow(config))
    held.release()


async def _serve_dataflow(config) -> None:
    from astra.servers.dataflow_serve import start_dataflow
    from astra.servers.runtime import serve_until_signal
    from astra.stop_deadline import STOP_DEADLINE_S

    server, df, metrics = await start_dataflow(config)
    log = logging.getLogger("astra.dataflow")
    # One machine-readable line so scripts can find the bound ports.
    print(
        json.dumps(
            {
                "service": "dataflow",
                "address": server.address,
                "metrics_port": getattr(df, "metrics_port", None),
            }
        ),
        flush=True,
    )
    log.info("dataflow %s serving on %s", df.dataflow_id, server.address)

    async def on_stop() -> None:
        await df.stop()
        if metrics is not None:
            metrics.shutdown()

    await serve_until_signal(server, on_stop=on_stop, deadline_s=STOP_DEADLINE_S)
    log.info("dataflow stopped")


@serve.command("raas")
@click.option("--dataflow", default="", help="Dataflow HOST:PORT to register with.")
@click.option(
    "--engine",
    type=click.Choice(["torch", "vllm", "sglang", "openai"]),
    default="torch",
    show_default=True,
    help="Inference engine.",
)
@click.option("--engine-url", default="", help="Attach to a running engine server (HTTP).")
@click.option("--engine-args", default="", help="Extra arguments for a launched engine server.")
@click.option("--engine-python", default="", help="Python that runs a launched vLLM/SGLang server.")
@click.option(
    "--engine-logprobs-mode",
    type=click.Choice(["raw_logprobs", "processed_logprobs"]),
    default="raw_logprobs",
    show_default=True,
    help="vllm/openai with --engine-url: the log-probs the server reports (vLLM's "
    "--logprobs-mode); raw ones serve temperature 1 (or 0) only. A launched vLLM runs "
    "processed_logprobs.",
)
@click.option(
    "--served-model-name",
    default="policy",
    show_default=True,
    help="Model name on an OpenAI-compatible server.",
)
@click.option(
    "--hot-loaded",
    is_flag=True,
    help="openai: the endpoint is hot-loaded externally; swaps only relabel versions.",
)
@click.option("--model", default="tiny", show_default=True, help="tiny, or a local HF directory.")
@click.option("--policy", "policies", multiple=True, help="Policy served (repeatable).")
@click.option("--workflow", "workflows", multiple=True, help="Workflow served (repeatable).")
@click.option(
    "--reward",
    "rewards",
    multiple=True,
    help="Rewards groups may name (repeatable); default: the registered ones.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=0, show_default=True, help="0 picks one.")
@click.option(
    "--capacity",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="Samples generated at once.",
)
@click.option("--instance-id", default="", help="Stable id; default from address and time.")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE (repeatable).")
@click.option("--state-dir", default="./astra-state/raas", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--on-swap",
    type=click.Choice(["continue", "finish_old"]),
    default="continue",
    show_default=True,
    help="In-flight sequences on a weight swap.",
)
@click.option(
    "--weights-receive",
    type=click.Choice(["auto", "memory", "disk"]),
    default="auto",
    show_default=True,
    help="Where fetched versions are kept: memory (no disk round trip; a restart fetches a "
    "full copy) or a directory under --state-dir; auto: memory for the torch engine, disk for "
    "HTTP engines (they load by path).",
)
@click.option(
    "--agent-command",
    default="",
    help="Workflow agent: the program run per sample (shell words, e.g. 'python agent.py'); it "
    "gets OPENAI_BASE_URL and OPENAI_API_KEY of this RaaS's endpoint.",
)
@click.option(
    "--agent-timeout",
    "agent_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="Workflow agent: seconds one run of the agent command may take.",
)
@click.option(
    "--verifiers-env",
    default="",
    help="Workflow verifiers: verifiers' env config as JSON, e.g. "
    '\'{"taskset": {"id": "my_taskset"}, "agent": {"runtime": {"type": "subprocess"}}}\'.',
)
@click.option(
    "--workflow-options",
    default="",
    help="Settings of the served workflows as JSON, by workflow name, e.g. "
    '\'{"openenv": {"url": "http://127.0.0.1:8000"}}\' (docs/agents.md).',
)
@click.option(
    "--fetch-timeout",
    "fetch_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=240.0,
    show_default=True,
    help="Seconds one weight fetch may take, every retry included, before LoadWeights fails "
    "with DEADLINE_EXCEEDED (raise it for large models over slow links).",
)
@_metrics_and_log_level()
def serve_raas(
    dataflow: str,
    engine: str,
    engine_url: str,
    engine_args: str,
    engine_python: str,
    engine_logprobs_mode: str,
    served_model_name: str,
    hot_loaded: bool,
    model: str,
    policies: tuple[str, ...],
    workflows: tuple[str, ...],
    rewards: tuple[str, ...],
    host: str,
    port: int,
    capacity: int,
    instance_id: str,
    labels: tuple[str, ...],
    state_dir: str,
    device: str,
    on_swap: str,
    weights_receive: str,
    fetch_timeout_s: float,
    agent_command: str,
    agent_timeout_s: float,
    verifiers_env: str,
    workflow_options: str,
    metrics_port: int | None,
    log_level: str,
) -> None:
    """Run a rollout service (built-in torch engine, or vLLM / SGLang / OpenAI over HTTP)."""
    from astra.servers.raas_serve import RaasOptions
    from astra.servers.raas_serve import serve_raas as serve

    parsed = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--label")
        parsed[key] = value
    try:
        options = json.loads(workflow_options) if workflow_options else {}
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--workflow-options") from None
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise click.BadParameter(
            "a JSON object of objects, by workflow name", param_hint="--workflow-options"
        )
    _logging(log_level)
    opts = RaasOptions(
        dataflow=dataflow,
        model=model,
        policies=list(policies) or ["policy"],
        workflows=list(workflows) or ["single_turn"],
        rewards=list(rewards) or None,
        host=host,
        port=port,
        capacity=capacity,
        instance_id=instance_id,
        labels=parsed,
        state_dir=state_dir,
        device=device,
        on_swap=on_swap,
        weights_receive=weights_receive,
        fetch_timeout_s=fetch_timeout_s,
        agent_command=shlex.split(agent_command),
        agent_timeout_s=agent_timeout_s,
        verifiers_env=_json_object(verifiers_env, "--verifiers-env"),
        workflow_options=options,
        engine=engine,
        engine_url=engine_url,
        engine_args=engine_args,
        engine_python=engine_python,
        engine_logprobs_mode=engine_logprobs_mode,
        served_model_name=served_model_name,
        hot_loaded=hot_loaded,
        metrics_port=metrics_port,
    )
    from astra.errors import AstraError

    if engine == "vllm" and not engine_url:  # before anything starts: exit 2, one line
        from astra.engine.http.vllm_env import vllm_python

        try:
            opts.engine_python = vllm_python(engine_python)
        except AstraError as exc:
            raise click.UsageError(exc.message) from None
    try:
        asyncio_run(serve(opts))
    except AstraError as exc:  # at start-up: a model or engine that cannot start
        raise click.ClickException(exc.message) from None


@serve.command("weights")
@click.option(
    "--store",
    "store_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Version store directory.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=50052, show_default=True, help="0 picks one.")
@click.option(
    "--full-every",
    type=click.IntRange(1, 64),
    default=20,
    show_default=True,
    help="A full version every K versions.",
)
@click.option(
    "--max-chain",
    type=click.IntRange(1, 128),
    default=128,
    show_default=True,
    help="Most deltas a fetch plan bridges.",
)
@click.option(
    "--keep-versions",
    type=click.IntRange(1),
    default=8,
    show_default=True,
    help="Newest versions kept whatever receivers hold.",
)
@click.option(
    "--hot-gib",
    type=click.FloatRange(0),
    default=4.0,
    show_default=True,
    help="Keep a policy's current version in RAM when at most this large (GiB), so the next "
    "publish decodes against memory; up to twice this per policy while a publish runs. 0: never.",
)
@click.option(
    "--ram-stage-mib",
    type=click.FloatRange(0),
    default=64.0,
    show_default=True,
    help="A publish holds its tensors under 256 KiB in RAM, up to this much in all, and writes "
    "them as one file at the commit (an interrupted publish sends them again). 0: a file each.",
)
@_metrics_and_log_level()
def serve_weights(
    store_dir: str,
    host: str,
    port: int,
    full_every: int,
    max_chain: int,
    keep_versions: int,
    hot_gib: float,
    ram_stage_mib: float,
    metrics_port: int | None,
    log_level: str,
) -> None:
    """Run the WeightService over a version store."""
    from astra.weights.store import StoreConfig

    _logging(log_level)
    config = StoreConfig(
        full_every=full_every,
        max_chain=max_chain,
        keep_versions=keep_versions,
        hot_bytes=int(hot_gib * (1 << 30)),
        ram_stage_bytes=int(ram_stage_mib * (1 << 20)),
    )

    async def run() -> None:
        from astra.servers.weights_serve import serve_weights as serve

        await serve(store_dir, host, port, config=config, metrics_port=metrics_port)

    from astra.damage import exit_if_damaged
    from astra.statelock import acquire_or_exit

    held = acquire_or_exit(store_dir, "WeightService")  # one WeightService per store, for life
    with exit_if_damaged("weights"):
        asyncio_run(run())
    held.release()


def asyncio_run(coro) -> None:
    """Runs a server until it stops; an address it cannot listen on ends it with exit 2 and
    one line (not a traceback)."""
    import errno

    from astra.servers.runtime import PortUnavailable, install_event_loop_policy

    install_event_loop_policy()
    try:
        asyncio.run(coro)
    except PortUnavailable as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:  # the metrics port (an HTTP server), say
        if exc.errno != errno.EADDRINUSE:
            raise
        click.echo(f"Error: {exc}: give another --metrics-port (0: any free one)", err=True)
        sys.exit(2)


_add_subcommands()

if __name__ == "__main__":
    main()
