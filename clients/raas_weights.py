"""RaaS side of weight loading: fetch a version from a WeightService into memory or local disk.

Implements astra.raas.engine_backend.WeightLoader over the streaming
`Receiver`, one per policy, so later versions arrive as deltas against what
it holds. The receiver verifies every tensor before the version becomes
current. On disk (what HTTP engines load by path) each policy has a receiver
directory under the RaaS's state directory and the engine swaps from those
verified files; in memory (`in_memory`, for the built-in torch engine) the
version stays in the receiver's buffers and the engine copies from them, with
no disk round trip; a restarted RaaS then fetches a full copy.

One receiver per policy: when Dataflow names another WeightService address
(the service restarted on a new port) the old receiver is closed and a new
one opens on the same directory, so what is held and staged carries over.
Every fetch is bounded: it ends within `fetch_timeout_s` (DeadlineExceeded)
and a stream on which the service stays silent for `idle_timeout_s` is
dropped and resumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astra.clients.weights_stream import Receiver
from astra.raas.backend import VersionSpec

FETCH_TIMEOUT_S = 240.0  # one fetch, every attempt; below LoadWeights' own deadline
IDLE_TIMEOUT_S = 30.0  # service silence (while the receiver waits on it) that drops a stream


class ReceiverWeightLoader:
    def __init__(
        self,
        root: str | Path,
        *,
        receiver_prefix: str = "raas",
        fetch_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        durable: bool = True,
        in_memory: bool = False,
    ) -> None:
        self.root, self.in_memory = Path(root), in_memory
        self.receiver_prefix = receiver_prefix
        self.fetch_timeout_s = fetch_timeout_s if fetch_timeout_s is not None else FETCH_TIMEOUT_S
        self.idle_timeout_s = idle_timeout_s if idle_timeout_s is not None else IDLE_TIMEOUT_S
        self.durable = durable
        self._receivers: dict[str, Receiver] = {}

    async def _receiver(self, policy_id: str, address: str) -> Receiver:
        rec = self._receivers.get(policy_id)
        held: Any = True  # an in-memory receiver at a new address keeps what the old one held
        if rec is not None and rec.address != address:
            del self._receivers[policy_id]
            await rec.close()
            held, rec = rec.local, None
        if rec is None:
            where: dict[str, Any] = (
                {"directory": None, "in_memory": held, "keep_versions": 1}
                if self.in_memory
                else {"directory": self.root / policy_id, "durable": self.durable}
            )
            rec = self._receivers[policy_id] = Receiver(
                address,
                policy_id,
                receiver_id=f"{self.receiver_prefix}/{policy_id}",
                timeout_s=self.fetch_timeout_s,
                idle_timeout_s=self.idle_timeout_s,
                **where,
            )
        return rec

    async def fetch(
        self, policy_id: str, version: VersionSpec, weights_address: str
    ) -> tuple[dict[str, Any], int]:
        from astra.engine.http import WeightsDir
        from astra.lora.format import ADAPTER_FILE
        from astra.lora.serving import as_version

        receiver = await self._receiver(policy_id, weights_address)
        result = await receiver.fetch(version.version_id or str(version.version))
        if result.held is not None:
            from astra.engine.torch_weights import from_memory

            tensors = from_memory(result.held)
            return as_version(tensors, result.held.files.get(ADAPTER_FILE)), result.bytes_received
        # A verified local directory: HTTP engines load it by path, the torch engine
        # reads its tensors lazily on its own worker thread. A LoRA version carries
        # adapter_config.json: an AdapterVersion over the directory's tensors.
        assert result.path is not None
        adapter = result.path / ADAPTER_FILE
        text = adapter.read_bytes() if adapter.is_file() else None
        return as_version(WeightsDir(result.path), text), result.bytes_received

    async def close(self) -> None:
        for rec in self._receivers.values():
            await rec.close()
        self._receivers.clear()
