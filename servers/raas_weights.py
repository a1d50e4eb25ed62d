"""RaaS side of weight loading: fetch a version from a WeightService into local disk.

Implements astra.raas.engine_backend.WeightLoader over the streaming
`Receiver`: one receiver directory per policy under the RaaS's state
directory, so later versions arrive as deltas against what it holds. The
receiver verifies every tensor before the version becomes current; the
engine then swaps from those verified files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astra.clients.weights_stream import Receiver
from astra.raas.backend import VersionSpec


class ReceiverWeightLoader:
    def __init__(self, root: str | Path, *, receiver_prefix: str = "raas") -> None:
        self.root = Path(root)
        self.receiver_prefix = receiver_prefix
        self._receivers: dict[tuple[str, str], Receiver] = {}

    def _receiver(self, policy_id: str, address: str) -> Receiver:
        key = (policy_id, address)
        rec = self._receivers.get(key)
        if rec is None:
            rec = self._receivers[key] = Receiver(
                address,
                policy_id,
                self.root / policy_id,
                receiver_id=f"{self.receiver_prefix}/{policy_id}",
            )
        return rec

    async def fetch(
        self, policy_id: str, version: VersionSpec, weights_address: str
    ) -> tuple[dict[str, Any], int]:
        from astra.engine.http import WeightsDir

        receiver = self._receiver(policy_id, weights_address)
        result = await receiver.fetch(version.version_id or str(version.version))
        # A verified local directory: HTTP engines load it by path, the torch engine
        # reads its tensors lazily on its own worker thread.
        return WeightsDir(result.path), result.bytes_received

    async def close(self) -> None:
        for rec in self._receivers.values():
            await rec.close()
        self._receivers.clear()
