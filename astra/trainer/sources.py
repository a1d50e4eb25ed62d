"""Where the trainer's batches come from and where its versions go, behind two small protocols.

`BatchSource` (fetch / ack / current version / announce) is Dataflow in
production; `WeightSink` (latest version / publish) is the WeightService: both over gRPC in
astra.clients.trainer_sources, handed to the trainer by whoever starts it (`Connect`).
Custom loops and tests pass their own. Transport failures surface as `BatchNotReady` (retry
the same request id) or `RequestIdSpent` (use a new one); every other error propagates as
a domain error (astra.errors). Never imports gRPC.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from astra.common.v1 import rollout_pb2
from astra.errors import AstraError, Unavailable

log = logging.getLogger(__name__)
MAX_FILE_BYTES = 8 << 20  # the WeightService's bound on an extra file
T = TypeVar("T")


class BatchNotReady(Exception):
    """No batch now (not enough groups, or the service is unreachable): retry the same id."""


class RequestIdSpent(Exception):
    """The request id cannot return a batch any more (lease expired, reused): take a new id."""


@dataclass
class FetchedBatch:
    batch_id: str
    policy_version: int
    trajectories: list[rollout_pb2.Trajectory]
    max_staleness: int = 0
    lease_expire: float = 0.0  # seconds since the epoch; 0: the source has no leases


class BatchSource(Protocol):
    async def fetch(
        self, request_id: str, num_groups: int, trainer_version: int = 0
    ) -> FetchedBatch: ...

    async def ack(self, batch_id: str, untrained_reason: str = "") -> None: ...

    async def current_version(self) -> int | None: ...

    async def announce(
        self, version: int, identity: str, resumed: bool = False, resumed_from: int | None = None
    ) -> None: ...

    async def close(self) -> None: ...


class Connect(Protocol):
    """Builds rank 0's source and sink from the config (None where it names no service);
    `files`: what every published version carries beside its tensors (config.json and the
    tokenizer's, or a LoRA version's adapter_config.json)."""

    def source(self, config: Any) -> BatchSource | None: ...

    def sink(self, config: Any, files: Mapping[str, bytes]) -> WeightSink | None: ...


class WeightSink(Protocol):
    async def latest_version(self) -> int | None: ...

    async def publish(
        self, version: int, identity: str, tensors: Mapping[str, tuple[str, tuple, Any]]
    ) -> None: ...

    async def close(self) -> None: ...


def model_files(model: str, config: Mapping[str, Any]) -> dict[str, bytes]:
    """config.json plus the small files of a model directory (tokenizer, generation config)."""
    files = {"config.json": (json.dumps(dict(config), indent=2) + "\n").encode()}
    path = Path(model)
    if path.is_dir():
        for f in sorted(path.iterdir()):
            small = f.is_file() and f.stat().st_size <= MAX_FILE_BYTES
            if (
                small
                and f.suffix in (".json", ".txt", ".model", ".jinja")
                and "index" not in f.name
            ):
                files.setdefault(f.name, f.read_bytes())
    return files


async def retrying(call: Callable[[], Awaitable[T]], what: str, *, max_backoff_s: float = 5.0) -> T:
    """`call()` until it returns; retryable errors (a service restarting) are waited out."""
    backoff = 0.1
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_retryable(exc):
                raise
            log.warning("%s: %s; retrying in %.1fs", what, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff_s)


def is_retryable(exc: BaseException) -> bool:
    """Errors a background publish or announce waits out: a service restarting, or one that
    says when to come back (RESOURCE_EXHAUSTED with a retry delay: the WeightService's disk
    is full). Training then pauses on the full publish queue instead of the trainer dying
    and losing the steps since its checkpoint at every restart."""
    if isinstance(exc, (Unavailable, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, AstraError) and exc.code == "RESOURCE_EXHAUSTED":
        return exc.retry_after_s is not None
    return isinstance(exc, AstraError) and exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
