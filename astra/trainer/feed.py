"""Rank 0's side of the batch stream: stable request ids, waiting, validation, acknowledgement.

The request id of a fetch is `<trainer>-v<next version>-a<attempt>`: a retry
(a broken stream, a restart before the step was applied) asks for the same
batch again, and Dataflow returns it. The attempt moves on only when the
batch under the current id was consumed without an update (rejected, or a
non-finite loss) or the id can no longer be served. Rejected batches are
acknowledged, so a poisonous batch is not served again, and counted by reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from astra.common.v1 import rollout_pb2
from astra.engine.model_config import ModelConfig
from astra.trainer.batch import TrainBatch, build_batch
from astra.trainer.config import TrainerConfig
from astra.trainer.sources import BatchNotReady, BatchSource, FetchedBatch, RequestIdSpent

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 1.0


class Feed:
    def __init__(
        self,
        config: TrainerConfig,
        counters: Counter[str],
        *,
        on_wait: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.config, self.counters = config, counters
        self.model_cfg: ModelConfig | None = None  # set once the model is loaded
        self.source: BatchSource | None = None
        self.attempt = 0
        self.on_wait = on_wait

    def request_id(self, next_version: int) -> str:
        return f"{self.config.trainer_id}-v{next_version}-a{self.attempt}"

    async def fetch(self, next_version: int) -> FetchedBatch:
        """The batch for the next version; waits (serving `on_wait`) until one is ready."""
        if self.source is None:
            raise RuntimeError("no batch source: set config.dataflow or pass source=")
        backoff = 0.05
        while True:
            request_id = self.request_id(next_version)
            try:
                batch = await self.source.fetch(request_id, self.config.batch.num_groups)
            except BatchNotReady as exc:
                self.counters["fetch_waits"] += 1
                log.debug("batch not ready: %s", exc)
                if self.on_wait is not None:
                    await self.on_wait()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            except RequestIdSpent as exc:
                log.info("request %s spent (%s); next attempt", request_id, exc)
                self.attempt += 1
                continue
            self.counters["batches_fetched"] += 1
            return batch

    def build(self, trajectories: list[rollout_pb2.Trajectory]) -> TrainBatch:
        """Validated tensors (raises BatchRejected); deterministic, so every rank may call it."""
        c, m = self.config, self.model_cfg
        assert m is not None, "the model is not loaded yet"
        return build_batch(
            trajectories,
            c.policy_id,
            vocab_size=m.vocab_size,
            max_seq_len=c.batch.max_seq_len or m.max_position_embeddings,
            advantages=c.batch.advantages,
            std_normalize=c.batch.std_normalize,
            adv_eps=c.batch.adv_eps,
        )

    def consumed_without_update(self, reason: str) -> None:
        self.counters[f"skipped_{reason}"] += 1
        self.attempt += 1

    async def ack(self, batch_id: str) -> None:
        """AckBatch; a failure (lease expired, service down) is logged and counted, not raised."""
        if self.source is None:
            return
        try:
            await self.source.ack(batch_id)
        except Exception as exc:
            self.counters["ack_failures"] += 1
            log.warning("AckBatch %s failed: %s", batch_id, exc)
