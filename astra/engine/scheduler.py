"""The engine's worker thread: continuous batching and weight swaps between decode steps.

One loop, on its own thread so the asyncio loop of a gRPC server is never
blocked by model compute. Each round: install queued weight swaps (all
policies of one swap together, before any further step), drop cancelled
sequences, admit waiting ones FIFO while fewer than `max_batch` run
(prefilled into the batch of their policy's current weights), then one decode
step for every batch; finished sequences leave and their rows are reused.

Swaps (`on_swap`):
- "continue": parameters are overwritten in place; running sequences go on
  with the new weights, and their KV cache, computed by the old weights, is
  kept (slime's partial rollouts do the same). Tokens sampled after the swap
  carry the new version, so the mix is always on record.
- "finish_old": the old model object keeps serving the sequences that started
  on it until they finish (its batch is retired); sequences admitted after the
  swap, including ones already waiting, run on the new model object.

Callers' threads only touch the inbox, the swap queue and the cancelled flag
(under `_cond`); batches, models and the waiting queue belong to the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from astra.engine.api import FinishReason
from astra.engine.batch import Batch, Sequence
from astra.engine.model import CausalLM
from astra.errors import Unavailable

log = logging.getLogger(__name__)
OnSwap = Literal["continue", "finish_old"]


@dataclass
class SwapOrder:
    """Prepared weights for some policies, installed together by the worker."""

    versions: Mapping[str, int]
    states: Mapping[str, Mapping[str, torch.Tensor]]  # continue: converted tensors to copy in
    models: Mapping[str, CausalLM]  # finish_old: new model objects, already loaded
    done: Callable[[BaseException | None], None]
    # continue: LoRA adapters (astra.lora.multi.SharedPlan) to install on a shared base
    adapters: Mapping[str, Any] = field(default_factory=dict)


class Scheduler:
    """Owns the batches and runs the worker thread; thread-safe submit/cancel/swap/close."""

    def __init__(
        self,
        models: Mapping[str, CausalLM],
        versions: Mapping[str, int],
        *,
        max_batch: int,
        max_prefill_tokens: int,
        on_swap: OnSwap,
        num_threads: int | None = None,
    ) -> None:
        self.max_batch, self.on_swap = max_batch, on_swap
        self._num_threads = num_threads
        self._prefill_tokens = max_prefill_tokens
        self.versions = dict(versions)
        self.current = {
            p: Batch(p, m, self.versions[p], max_prefill_tokens) for p, m in models.items()
        }
        self._batches = list(self.current.values())
        self._waiting: deque[Sequence] = deque()
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._swaps: list[SwapOrder] = []
        self._live = 0  # submitted, not finished, not cancelled
        self._closing = False
        self.error: BaseException | None = None
        # Decoding stopped while swaps were installed (seconds, all swaps): what a weight
        # sync costs generation here; the fetch before it runs beside decoding.
        self.swap_pause_s = 0.0
        self._thread = threading.Thread(target=self._run, name="astra-torch-engine", daemon=True)
        self._thread.start()

    def _refuse_if_stopped(self) -> None:
        if self.error is not None:
            raise Unavailable(f"engine failed: {self.error!r}", reason="ENGINE_FAILED")
        if self._closing:
            raise Unavailable("engine is closed", reason="ENGINE_CLOSED")

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            self._refuse_if_stopped()
            self._inbox.append(seq)
            self._live += 1
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        """Frees the sequence's slot now; the worker drops its row before the next step."""
        with self._cond:
            if not (seq.done or seq.cancelled):
                seq.cancelled = True
                self._live -= 1
                self._cond.notify()

    def swap(self, order: SwapOrder) -> None:
        with self._cond:
            self._refuse_if_stopped()
            self._swaps.append(order)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stats(self) -> dict[str, int]:
        running = sum(not s.cancelled for b in list(self._batches) for s in list(b.seqs))
        live = self._live
        return {
            "running": running,
            "waiting": max(0, live - running),
            "max_batch": self.max_batch,
            "free_slots": max(0, self.max_batch - live),
        }

    def _finish(self, seq: Sequence, outcome: FinishReason | BaseException) -> None:
        with self._cond:
            seq.done = True
            if seq.cancelled:
                return
            self._live -= 1
        if not isinstance(outcome, BaseException):
            try:
                outcome = seq.result(outcome)
            except Exception as exc:  # one request's tokenizer failing must not stop the engine
                log.exception("building the result of a %s request failed", seq.policy)
                outcome = exc
        seq.deliver(outcome)

    def _run(self) -> None:
        try:
            if self._num_threads:
                torch.set_num_threads(self._num_threads)
            with torch.inference_mode():
                while self._next_round():
                    self._step()
        except BaseException as exc:
            log.exception("torch engine worker failed")
            self.error = exc
        finally:
            self._shutdown()

    def _has_work(self) -> bool:
        return bool(self._waiting) or any(b.seqs for b in self._batches)

    def _next_round(self) -> bool:
        with self._cond:
            while not (self._inbox or self._swaps or self._closing or self._has_work()):
                self._cond.wait()
            if self._closing:
                return False
            new, self._inbox = self._inbox, []
            swaps, self._swaps = self._swaps, []
        self._waiting.extend(new)
        for order in swaps:
            self._install(order)
        return True

    def _install(self, order: SwapOrder) -> None:
        started = time.perf_counter()
        try:
            for policy, version in order.versions.items():
                batch = self.current[policy]
                if self.on_swap == "continue" and policy in order.adapters:
                    batch.model = order.adapters[policy].install()  # astra.lora.multi
                    batch.version = version
                elif self.on_swap == "continue":
                    batch.model.load_weights(order.states.get(policy, {}), partial=True)
                    batch.version = version
                elif policy in order.models:
                    batch.retired = True
                    batch = Batch(policy, order.models[policy], version, self._prefill_tokens)
                    self.current[policy] = batch
                    self._batches.append(batch)
                else:  # a version with no new tensors: the same weights, relabelled
                    batch.version = version
                self.versions[policy] = version
        except BaseException as exc:
            order.done(exc)
            raise  # weights may be half-copied: the engine must stop serving
        self.swap_pause_s += time.perf_counter() - started  # counted before the caller hears
        order.done(None)

    def _step(self) -> None:
        for batch in self._batches:
            batch.remove({s for s in batch.seqs if s.cancelled})
        self._retire(self._admit())
        finished: list[tuple[Sequence, FinishReason]] = []
        for batch in self._batches:
            if batch.seqs:
                finished += batch.decode()
        self._retire(finished)
        self._batches = [b for b in self._batches if b.seqs or not b.retired]

    def _retire(self, finished: list[tuple[Sequence, FinishReason]]) -> None:
        doomed = {seq for seq, _ in finished}
        for batch in self._batches:
            batch.remove(doomed)
        for seq, reason in finished:
            self._finish(seq, reason)

    def _admit(self) -> list[tuple[Sequence, FinishReason]]:
        running = sum(len(b.seqs) for b in self._batches)
        joining: dict[str, list[Sequence]] = {}
        while self._waiting and running < self.max_batch:
            seq = self._waiting.popleft()
            if not seq.cancelled:
                joining.setdefault(seq.policy, []).append(seq)
                running += 1
        finished: list[tuple[Sequence, FinishReason]] = []
        try:
            for policy, seqs in joining.items():
                finished += self.current[policy].prefill(seqs)
        except BaseException:
            # Sequences taken off the queue but not yet in a batch are in neither place
            # _shutdown looks: put them back so their callers get the engine's failure.
            placed = {s for b in self._batches for s in b.seqs}
            for seq in reversed([s for seqs in joining.values() for s in seqs]):
                if seq not in placed:
                    self._waiting.appendleft(seq)
            raise
        return finished

    def _shutdown(self) -> None:
        with self._cond:
            self._closing = True
            pending = self._inbox + list(self._waiting) + [s for b in self._batches for s in b.seqs]
            swaps, self._inbox, self._swaps = self._swaps, [], []
        self._waiting.clear()
        failure = None
        if self.error is not None:
            failure = Unavailable(f"engine failed: {self.error!r}", reason="ENGINE_FAILED")
        for seq in pending:
            if not seq.done:
                self._finish(seq, failure or "aborted")
        for order in swaps:
            order.done(failure or Unavailable("engine is closed", reason="ENGINE_CLOSED"))
