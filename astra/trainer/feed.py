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
import contextlib
import inspect
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from astra.common.v1 import rollout_pb2
from astra.engine.model_config import ModelConfig
from astra.errors import Unavailable
from astra.trainer.batch import TrainBatch, build_batch
from astra.trainer.config import TrainerConfig
from astra.trainer.sources import BatchNotReady, BatchSource, FetchedBatch, RequestIdSpent

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 1.0
# How long an acknowledgement is retried while Dataflow is unreachable: as long as a batch
# lease lasts by default (leases.batch_lease_s), after which the ack could only be refused.
ACK_RETRY_S = 300.0
ACK_MAX_BACKOFF_S = 5.0
LEASE_MIN_WAIT_S = 0.25  # between lease extensions at the least
LEASE_MAX_WAIT_S = 30.0  # and at the most (batch leases are far longer by default: 300 s)
WAIT_LOG_EVERY_S = 30.0  # a trainer kept waiting for a batch says why, this often


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

    def _versioned(self) -> bool:
        """Whether the source's fetch takes trainer_version (one written before it may not)."""
        try:
            return "trainer_version" in inspect.signature(self.source.fetch).parameters
        except (TypeError, ValueError):
            return False

    def request_id(self, next_version: int) -> str:
        return f"{self.config.trainer_id}-v{next_version}-a{self.attempt}"

    async def fetch(self, next_version: int) -> FetchedBatch:
        """The batch for the next version; waits (serving `on_wait`) until one is ready."""
        if self.source is None:
            raise RuntimeError("no batch source: set config.dataflow or pass source=")
        backoff = 0.05
        waiting_since = logged = time.monotonic()
        while True:
            request_id = self.request_id(next_version)
            try:
                # The batch trains the weights of version next_version - 1: staleness counts
                # from there even while the announcement of that version is still on its way.
                extra = {"trainer_version": next_version - 1} if self._versioned() else {}
                batch = await self.source.fetch(request_id, self.config.batch.num_groups, **extra)
            except BatchNotReady as exc:
                self.counters["fetch_waits"] += 1
                now = time.monotonic()
                if now - logged >= WAIT_LOG_EVERY_S:  # the operator's "why is it not training"
                    logged = now
                    log.info("no batch for version %d after %.0f s: %s", next_version,
                             now - waiting_since, exc)  # fmt: skip
                else:
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

    async def ack(self, batch_id: str, untrained_reason: str = "") -> None:
        """AckBatch, retried while Dataflow cannot be reached (AckBatch is idempotent);
        `untrained_reason`: why no step was taken on the batch (empty: it was trained).

        A lost acknowledgement is not harmless: when the batch's lease ends its groups go
        back to the buffer and would be trained a second time. So an unreachable Dataflow
        (a restart, a network blip) is waited out for up to ACK_RETRY_S; a refusal (the
        lease already expired, an unknown batch) or giving up is logged and counted, not
        raised: the step is applied either way.
        """
        if self.source is None:
            return
        deadline = time.monotonic() + ACK_RETRY_S
        backoff = 0.2
        while True:
            try:
                await self.source.ack(batch_id, untrained_reason)
                return
            except Exception as exc:
                retry = _unreachable(exc) and time.monotonic() + backoff < deadline
                if not retry:
                    self.counters["ack_failures"] += 1
                    log.error(
                        "AckBatch %s failed: %s; if its lease ends, its groups are served again",
                        batch_id,
                        exc,
                    )
                    return
                self.counters["ack_retries"] += 1
                log.warning("AckBatch %s: %s; retrying in %.1f s", batch_id, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, ACK_MAX_BACKOFF_S)

    @contextlib.asynccontextmanager
    async def leased(self, batch: FetchedBatch):
        """While the body runs (the step), keeps the batch's lease from ending: extends it
        once half of what is left has passed, so a step longer than Dataflow's batch lease
        does not send the batch back to the buffer to be trained a second time."""
        extend = getattr(self.source, "extend_lease", None)
        if extend is None or not batch.lease_expire:
            yield
            return
        task = asyncio.create_task(self._keep_lease(extend, batch.batch_id, batch.lease_expire))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.wait({task})  # never raises: an outer cancellation still propagates

    async def _keep_lease(self, extend, batch_id: str, expire: float) -> None:
        while True:
            # Half of what is left by this host's clock, within bounds: Dataflow's clock may
            # differ, so the lease is renewed at least every LEASE_MAX_WAIT_S whatever it says.
            wait = (expire - time.time()) / 2
            await asyncio.sleep(min(LEASE_MAX_WAIT_S, max(LEASE_MIN_WAIT_S, wait)))
            try:
                expire = await extend(batch_id)
                self.counters["lease_extensions"] += 1
            except Exception as exc:
                if not _unreachable(exc):  # acknowledged or expired: nothing left to keep
                    log.warning("lease of batch %s not extended: %s", batch_id, exc)
                    return
                log.info("lease of batch %s: %s; trying again", batch_id, exc)


def _unreachable(exc: Exception) -> bool:
    """Dataflow did not answer (worth retrying), as opposed to answering no."""
    return isinstance(exc, (ConnectionError, TimeoutError, Unavailable))
