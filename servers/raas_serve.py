"""`astra serve raas`: the built-in torch engine behind a RolloutService.

Loads the model for every policy, joins it to the workflows and the weight
loader, serves RolloutService (health NOT_SERVING until the model is loaded
and after an engine failure), registers with Dataflow and runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astra.clients.registrar import Registrar
from astra.raas.backend import RolloutBackend
from astra.raas.v1 import rollout_service_pb2 as pb
from astra.raas.v1 import rollout_service_pb2_grpc as pb_grpc
from astra.servers.raas import LOAD_TIMEOUT_S, RolloutServicer
from astra.servers.runtime import GrpcServer, with_raw_responses

log = logging.getLogger(__name__)

ENGINE_DIED_EXIT = 3  # the exit status of a RaaS whose launched engine server died


@dataclass
class RaasOptions:
    dataflow: str
    model: str = "tiny"
    policies: list[str] = field(default_factory=lambda: ["policy"])
    workflows: list[str] = field(default_factory=lambda: ["single_turn"])
    rewards: list[str] | None = None
    host: str = "127.0.0.1"
    port: int = 0
    capacity: int = 64
    instance_id: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    state_dir: str = "./astra-state/raas"
    device: str = "cpu"
    on_swap: str = "continue"
    weights_receive: str = "auto"  # memory | disk | auto (memory for the torch engine)
    fetch_timeout_s: float = 240.0  # one weight fetch, every retry (clients.raas_weights)
    # workflow `agent`: the program run per sample, its time limit (astra.workflows.agent)
    agent_command: list[str] = field(default_factory=list)
    agent_timeout_s: float = 60.0
    # workflow `verifiers`: verifiers' env config (astra.workflows.verifiers_env)
    verifiers_env: dict[str, Any] = field(default_factory=dict)
    # settings of the other served workflows by name (e.g. "openenv": astra.workflows.openenv_env)
    workflow_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    grace_s: float = 5.0
    engine: str = "torch"
    engine_url: str = ""
    engine_args: str = ""
    engine_python: str = ""
    engine_logprobs_mode: str = "raw_logprobs"  # what an attached vLLM/OpenAI server reports
    served_model_name: str = "policy"
    hot_loaded: bool = False
    metrics_port: int | None = None


async def start_agents(opts: RaasOptions, engine: Any) -> tuple[Any, Any]:
    """The agent endpoint (servers.agent_http) when the `agent` or `verifiers` workflow is
    served: (its Gateway, its server); (None, None) otherwise. A command that cannot run, or a
    verifiers environment that cannot be built, is refused now."""
    if "agent" not in opts.workflows and "verifiers" not in opts.workflows:
        return None, None
    from astra.agents.endpoint import AgentEndpoint, Gateway
    from astra.servers.agent_http import AgentHTTPServer
    from astra.workflows.agent import check_command

    if "agent" in opts.workflows:
        try:
            check_command(opts.agent_command)
        except ValueError as exc:
            raise ValueError(f"--agent-command: {exc}") from None
    if "verifiers" in opts.workflows:
        from astra.workflows.verifiers_env import load_env

        load_env(opts.verifiers_env)  # built once here; its error names `verifiers_env`
    endpoint = AgentEndpoint(engine)
    server = await AgentHTTPServer(endpoint, "127.0.0.1", 0).start()
    return Gateway(server.base_url, endpoint.episodes, server.unix_path), server


async def serve_raas(opts: RaasOptions) -> None:
    from astra.clients.raas_weights import ReceiverWeightLoader
    from astra.raas.engine_backend import EngineBackend
    from astra.servers.raas_engines import build_engine
    from astra.servers.runtime import serve_until_signal
    from astra.stop_deadline import STOP_DEADLINE_S

    if not opts.engine_python and opts.engine != "vllm":
        import sys

        opts.engine_python = sys.executable
    engine = await build_engine(opts)
    state = Path(opts.state_dir)
    if opts.weights_receive not in ("auto", "memory", "disk"):
        raise ValueError(f"weights_receive {opts.weights_receive!r}: auto, memory or disk")
    if opts.weights_receive == "memory" and opts.engine != "torch":
        raise ValueError(f"the {opts.engine} engine loads weights by path: weights_receive disk")
    in_memory = opts.weights_receive == "memory" or (
        opts.weights_receive == "auto" and opts.engine == "torch"
    )
    loader = ReceiverWeightLoader(
        state / "weights",
        receiver_prefix=opts.instance_id or "raas",
        in_memory=in_memory,
        fetch_timeout_s=opts.fetch_timeout_s,
    )
    agents, agent_server = await start_agents(opts, engine)
    backend = EngineBackend(
        engine,
        opts.workflows,
        loader,
        rewards=opts.rewards,
        agents=agents,
        workflow_options={
            **opts.workflow_options,
            "agent": {
                **opts.workflow_options.get("agent", {}),
                "command": opts.agent_command,
                "timeout_s": opts.agent_timeout_s,
            },
            "verifiers": {"env": opts.verifiers_env},
        },
    )
    server, servicer, registrar = await start_raas(
        backend,
        capacity=opts.capacity,
        dataflow_address=opts.dataflow or None,
        host=opts.host,
        port=opts.port,
        instance_id=opts.instance_id or None,
        labels=opts.labels,
        grace_s=opts.grace_s,
    )
    metrics = None
    if opts.metrics_port is not None:
        from astra.raas.metrics import RaasMetrics

        metrics = servicer.metrics = RaasMetrics(servicer)
        metrics.also(server.roles.metrics)
        metrics.serve(opts.host, opts.metrics_port)
    line: dict[str, object] = {
        "service": "raas",
        "address": server.address,
        "instance_id": servicer.instance_id,
    }
    line["metrics_port"] = metrics.port if metrics is not None else None
    print(json.dumps(line), flush=True)
    log.info("raas %s serving %s on %s", servicer.instance_id, opts.policies, server.address)

    engine_died = False

    async def watch_engine() -> None:
        """An engine that fails makes the RaaS NOT_SERVING. One whose server the RaaS
        launched (it exited, or failed a weight reload) also ends the RaaS (exit
        ENGINE_DIED_EXIT), so whoever supervises it (astra run, systemd, Kubernetes) starts
        both again; it deregisters first, so Dataflow dispatches what it held again at once.
        An attached server's owner restarts it: the RaaS stays NOT_SERVING."""
        nonlocal engine_died
        while True:
            await asyncio.sleep(1.0)
            if not engine.healthy:
                log.error("engine failed: serving NOT_SERVING so Dataflow routes away")
                servicer.unavailable = "its engine failed"
                await server.set_serving(False)
                process = getattr(engine, "process", None)
                if process is not None:  # launched here: start both again
                    why = (
                        f"exited ({process.proc.returncode})"
                        if not process.alive
                        else f"failed ({getattr(engine, 'failure', None)})"
                    )
                    log.error(
                        "engine server %s; stopping so the RaaS and its engine are started "
                        "again. Its log: %s",
                        why,
                        process.log_path,
                    )
                    engine_died = True
                    await server.stop()
                return

    watcher = asyncio.create_task(watch_engine())

    async def on_stop() -> None:
        watcher.cancel()
        if registrar is not None:
            await registrar.stop()
        await servicer.close()
        if agent_server is not None:
            await agent_server.stop()
        await loader.close()
        await engine.close()
        if metrics is not None:
            metrics.shutdown()

    await serve_until_signal(server, on_stop=on_stop, deadline_s=STOP_DEADLINE_S)
    if engine_died:
        raise SystemExit(ENGINE_DIED_EXIT)


async def start_raas(
    backend: RolloutBackend,
    *,
    capacity: int,
    dataflow_address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    instance_id: str | None = None,
    labels: dict[str, str] | None = None,
    initial_versions: dict[str, int] | None = None,
    grace_s: float = 5.0,
    load_timeout_s: float = LOAD_TIMEOUT_S,
) -> tuple[GrpcServer, RolloutServicer, Registrar | None]:
    """Starts a RolloutService on host:port (0 = any); registers with Dataflow when given.

    Health turns SERVING once the server listens. The Registrar (None
    without `dataflow_address`) keeps trying in the background; stop it
    before the server to deregister.
    """
    servicer = RolloutServicer(
        backend, capacity, initial_versions=initial_versions, load_timeout_s=load_timeout_s
    )
    server = GrpcServer(host, port, grace_s=grace_s)
    name = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
    add = with_raw_responses(
        pb_grpc.add_RolloutServiceServicer_to_server,
        name,
        ("CollectResults", "CollectResultBatch"),
    )
    server.add_service(add, servicer, name)
    await server.start(serving=False)
    servicer.instance_id = instance_id or f"raas-{server.address}-{time.time_ns() // 1_000_000}"
    await server.set_serving(True)
    registrar = None
    if dataflow_address:
        registrar = Registrar(dataflow_address, servicer, server.address, labels=labels)
        registrar.start()
    return server, servicer, registrar
