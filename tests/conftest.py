"""Shared fixtures: datasets, Dataflow configs, in-process servers on port 0."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from astra.dataflow.config import DataflowConfig

BENCH_DIR = Path(__file__).resolve().parent.parent / "tools" / "bench"


@contextmanager
def bench_module(script: str, name: str) -> Iterator[ModuleType]:
    """tools/bench/<script> imported as module `name`, with tools/bench on sys.path for its own
    imports (engine, report, ...) while the context lasts."""
    sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(BENCH_DIR))


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n")
    return path


def pytest_terminal_summary(terminalreporter) -> None:
    """Says so when the disk the tests write to ran short: a Dataflow below
    storage.min_free_bytes (256 MiB by default) pauses by design, which shows as a hung run."""
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < 2 << 30:
        terminalreporter.write_line(
            f"LOW DISK: {free / 2**20:.0f} MiB free in {tempfile.gettempdir()} at the end "
            "(Dataflow pauses below storage.min_free_bytes)"
        )


def free_port() -> int:
    """A loopback port free a moment ago (for a server that must come back on the same one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_config(dataset: Path, state_dir: Path, **over) -> DataflowConfig:
    raw = {
        "port": 0,
        "state_dir": str(state_dir),
        "grace_s": 1.0,
        "policies": [{"id": "policy", "batch_groups": 2, "buffer": {"drop_equal_rewards": False}}],
        "streams": [
            {
                "name": "s",
                "dataset": {"path": str(dataset), "num_epochs": 1},
                "policy_ids": ["policy"],
                "group_size": 4,
                "sampling": {"max_new_tokens": 8},
            }
        ],
        "pool": {
            "heartbeat_interval_s": 0.2,
            "probe_interval_s": 0.1,
            "confirm_failures": 2,
            "collect_wait_s": 0.1,
            "call_timeout_s": 2.0,
        },
        "gate": {"max_version_lag": None},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return DataflowConfig.model_validate(raw)


@pytest.fixture
def config(dataset: Path, tmp_path: Path) -> DataflowConfig:
    return make_config(dataset, tmp_path / "state")


@asynccontextmanager
async def running_dataflow(config: DataflowConfig):
    """A real Dataflow gRPC server on 127.0.0.1:0 and a client to it."""
    from astra.clients.dataflow import DataflowClient
    from astra.servers.dataflow_serve import start_dataflow

    server, df, metrics = await start_dataflow(config)
    client = DataflowClient(server.address, timeout_s=5.0)
    try:
        yield server, df, client
    finally:
        await client.close()
        await server.stop(0)
        await df.stop()
        if metrics is not None:
            metrics.shutdown()


def save_tiny_trainer_model(path: Path) -> Path:
    """A random tiny model of the scripted RaaS's vocabulary, saved for a trainer to start from."""
    from astra.engine.tiny import TINY_CONFIG, random_model, save_model
    from astra.raas.scripted import VOCAB_SIZE

    cfg = {**TINY_CONFIG, "vocab_size": VOCAB_SIZE}
    save_model(path, random_model(cfg, 1), cfg)
    return path


async def start_two_rank_trainer(df_server, weights, model: Path, *more: str, **popen):
    """`python -m astra.trainer --nproc 2` (torchrun) against a `scripted_system`; `more`
    flags after the common ones, `popen` for asyncio.create_subprocess_exec (stdout piped)."""
    import asyncio
    import sys

    args = ["--nproc", "2", "--dataflow", df_server.address, "--weights", weights.address]
    args += ["--policy", "policy", "--model", str(model), "--port", "0", *more]
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "astra.trainer", *args, stdout=asyncio.subprocess.PIPE, **popen
    )


@asynccontextmanager
async def scripted_system(tmp_path: Path, dataset: Path):
    """What a trainer process needs, in process: a WeightService (not durable), a Dataflow and
    a scripted RaaS registered with it. Yields (Dataflow server, Dataflow client, weights)."""
    from astra.raas.scripted import ScriptedGenerator
    from astra.servers.raas_serve import start_raas
    from astra.servers.weights_serve import start_weights
    from astra.weights.store import StoreConfig

    weights = await start_weights(tmp_path / "store", config=StoreConfig(durable=False))
    try:
        async with running_dataflow(make_config(dataset, tmp_path / "df", grace_s=0.1)) as (
            df_server,
            _,
            client,
        ):
            server, _, registrar = await start_raas(
                ScriptedGenerator(delay_s=0.01),
                capacity=16,
                dataflow_address=df_server.address,
                instance_id="raas",
                grace_s=0.1,
            )
            try:
                yield df_server, client, weights
            finally:
                await registrar.stop()
                await server.stop(0)
    finally:
        await weights.stop(0)


def error_info(exc: grpc.aio.AioRpcError) -> tuple[error_details_pb2.ErrorInfo | None, list]:
    """The ErrorInfo and the other details of a failed call."""
    raw = dict(exc.trailing_metadata() or ()).get("grpc-status-details-bin")
    if raw is None:
        return None, []
    status = status_pb2.Status.FromString(raw)
    info, others = None, []
    for any_msg in status.details:
        if any_msg.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            any_msg.Unpack(info)
        elif any_msg.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            any_msg.Unpack(br)
            others.append(br)
        elif any_msg.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            ri = error_details_pb2.RetryInfo()
            any_msg.Unpack(ri)
            others.append(ri)
    return info, others


@pytest.fixture
def runs(tmp_path: Path) -> Iterator:
    """`runs(*args)` starts `python -m astra.run` (tests.test_run.Run); all are killed at the end."""
    from tests.test_run import Run

    made: list[Run] = []

    def make(*args: str) -> Run:
        made.append(Run(tmp_path / f"run{len(made)}", *args))
        return made[-1]

    yield make
    for r in made:
        r.cleanup()


def entry_point_package(
    root: Path, dist: str, module: str, source: str, group: str, entries: dict[str, str]
) -> Path:
    """Writes `module`.py and an installed-looking `dist`-1.0.dist-info declaring `entries`
    (name -> "module:attribute") in the entry-point `group`; put `root` on sys.path to
    install it. Returns `root`."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
    return root
