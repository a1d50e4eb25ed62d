"""`TorchEngine`: the built-in api.InferenceEngine, on CPU or GPU, for one or more policies.

The asyncio front validates a request, hands it to the worker thread of
astra.engine.scheduler (continuous batching, KV cache, swaps between decode
steps) and awaits its result; model compute never runs on the event loop.

Log-probs (also written into every `Generation.meta["logprob_convention"]`):
`Generation.logprobs[i]` is log_softmax(logits / temperature) of the sampled
token over the whole vocabulary, before top-k/top-p, with temperature 0
counted as 1: the policy at temperature, as the trainer recomputes it from the
same weights. `meta["sampling_logprobs"]` holds the log-probs under the cut,
renormalised distribution actually sampled from (see astra.engine.sampler).

Reproducibility: a request's randomness is its own CPU generator seeded by
`Sampling.seed` (a fresh random seed, reported in `meta["seed"]`, when None),
one draw per sampled token. Same seed + weights + prompt + settings on the
same device and dtype -> the same tokens, whatever else is in the batch, up to
floating-point differences of batched kernels: a batch of a different shape
may round logits differently in the last bits, which can flip a token only at
a near-exact tie (tests check batch independence on CPU fp32). Not reproducible
across devices, dtypes or torch versions, nor across a "continue" swap whose
timing differs between runs.

Stops: eos (the tokenizer's and config.json's eos ids), `stop_token_ids`, and
`stop_strings` searched in the decoded generated text; the stopping token is
kept in token_ids, and `text` ends right after a matched stop string;
`meta["stop"]` names what matched. Cancelling generate() frees its slot at
once (capacity counts drop immediately, the cache row before the next step).
"""

from __future__ import annotations

import asyncio
import copy
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import torch

from astra.engine.api import Generation, Sampling, Tokenizer
from astra.engine.batch import Sequence
from astra.engine.loop_calls import deliverer, teller
from astra.engine.model import CausalLM
from astra.engine.scheduler import OnSwap, Scheduler, SwapOrder
from astra.engine.torch_weights import as_torch_state
from astra.engine.validate import check_request
from astra.errors import FailedPrecondition, invalid_field
from astra.lora import serving as lora
from astra.lora.multi import BasePool, PolicyModel, held_bytes

ON_SWAP = ("continue", "finish_old")


class TorchEngine:
    """Serves policies from in-memory `CausalLM`s; see the module docstring for conventions.

    The engine owns the model objects it is given: a "continue" swap overwrites
    their parameters in place (LoRA policies with the same base end up on one of
    them, astra.lora.multi), and a worker failure (say, a device error) fails
    every pending request with Unavailable(ENGINE_FAILED) and sets `healthy` False.
    """

    name = "torch"

    serves_adapters = True  # LoRA adapter versions, unmerged (astra.lora.serving)
    streams_tokens = True  # generate(..., on_token=f): f(token) as each is sampled

    def __init__(
        self,
        models: Mapping[str, tuple[CausalLM, Tokenizer]],
        device: torch.device | str = "cpu",
        *,
        max_batch: int = 64,
        max_seq_len: int | None = None,
        max_prefill_tokens: int = 4096,
        on_swap: OnSwap = "continue",
        versions: Mapping[str, int] | None = None,
        num_threads: int | None = None,
    ) -> None:
        """Starts the worker thread.

        `max_batch`: sequences decoded together (more wait, FIFO); `max_seq_len`:
        prompt + new tokens (default and cap: the model's max_position_embeddings);
        `max_prefill_tokens`: padded prompt tokens per prefill forward;
        `num_threads`: if set, torch.set_num_threads (process-wide) at worker start.
        """
        if on_swap not in ON_SWAP:
            raise ValueError(f"on_swap must be one of {ON_SWAP}, not {on_swap!r}")
        if not models or max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError("need at least one model, max_batch >= 1, max_prefill_tokens >= 1")
        if len({id(m) for m, _ in models.values()}) < len(models):
            raise ValueError("each policy needs its own model object (swaps change weights)")
        self.policy_ids = tuple(models)
        self.on_swap: OnSwap = on_swap
        self._tokenizers = {p: tok for p, (_, tok) in models.items()}
        placed = {p: m.to(device).eval() for p, (m, _) in models.items()}
        self._cfgs = {p: m.cfg for p, m in placed.items()}  # no model refs: swaps replace them
        self._limits = {
            p: min(max_seq_len or c.max_position_embeddings, c.max_position_embeddings)
            for p, c in self._cfgs.items()
        }
        self._eos = {
            p: frozenset({self._tokenizers[p].eos_id, *c.eos_token_ids})
            for p, c in self._cfgs.items()
        }
        start = {p: int((versions or {}).get(p, 0)) for p in self.policy_ids}
        self._sched = Scheduler(
            placed,
            start,
            max_batch=max_batch,
            max_prefill_tokens=max_prefill_tokens,
            on_swap=on_swap,
            num_threads=num_threads,
        )
        self._swap_lock = asyncio.Lock()
        self._pool = BasePool()  # adapter policies' shared bases (astra.lora.multi)

    def _policy(self, policy_id: str, field: str = "policy_id") -> str:
        if policy_id not in self._cfgs:
            raise invalid_field(field, f"unknown policy {policy_id!r}", reason="UNKNOWN_POLICY")
        return policy_id

    def tokenizer(self, policy_id: str) -> Tokenizer:
        return self._tokenizers[self._policy(policy_id)]

    def version(self, policy_id: str) -> int:
        return self._sched.versions[self._policy(policy_id)]

    def max_seq_len(self, policy_id: str) -> int:
        """Longest prompt + max_new_tokens this engine accepts for the policy."""
        return self._limits[self._policy(policy_id)]

    def stats(self) -> dict[str, int]:
        """running, waiting, max_batch, free_slots (max_batch minus running and waiting)."""
        return self._sched.stats()

    @property
    def swap_pause_s(self) -> float:
        """Seconds decoding stood still while weight swaps were installed, in all."""
        return self._sched.swap_pause_s

    def held_bytes(self) -> int:
        """Bytes of the weights the served models hold (a shared base counted once)."""
        return held_bytes([b.model for b in self._sched.current.values()])

    @property
    def healthy(self) -> bool:
        return self._sched.error is None

    async def generate(
        self,
        policy_id: str,
        prompt_ids: list[int],
        sampling: Sampling,
        *,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """Samples one continuation; raises InvalidArgument (field named) for bad input.
        `on_token` (see `streams_tokens`) is called on the caller's loop with each token
        as it is sampled, before the result is returned."""
        cfg = self._cfgs[self._policy(policy_id)]
        check_request(
            prompt_ids, sampling, vocab_size=cfg.vocab_size, max_seq_len=self._limits[policy_id]
        )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Generation] = loop.create_future()
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        gen = torch.Generator().manual_seed(seed) if sampling.temperature > 0 else None
        seq = Sequence(
            policy=policy_id,
            prompt=[int(t) for t in prompt_ids],
            sampling=sampling,
            seed=seed,
            tokenizer=self._tokenizers[policy_id],
            stop_ids=self._eos[policy_id] | frozenset(sampling.stop_token_ids),
            deliver=deliverer(loop, fut),
            generator=gen,
            on_token=teller(loop, on_token) if on_token is not None else None,
        )
        self._sched.submit(seq)
        try:
            return await fut
        except asyncio.CancelledError:
            self._sched.cancel(seq)
            raise

    def _prepare(
        self, versions: Mapping[str, int], state: Mapping[str, Mapping[str, Any]]
    ) -> SwapOrder:
        """Validates and converts off the event loop; builds new model objects for finish_old.

        An adapter version is checked against the policy's base and installed unmerged, on
        one base shared by every policy with the same base digest (astra.lora.multi); a
        policy that serves an adapter takes no full version."""
        states, models, adapters = {}, {}, {}
        for policy in versions:
            model = self._sched.current[policy].model
            given = state.get(policy, {})
            if isinstance(given, lora.AdapterVersion):
                if self.on_swap == "finish_old":  # a copy per policy, as for full versions
                    models[policy] = copy.deepcopy(model)
                    lora.install(models[policy], self._pool.plan(policy, model, given))
                else:  # on the policy's shared base (astra.lora.multi)
                    adapters[policy] = self._pool.plan_shared(policy, model, given)
                continue
            tensors = as_torch_state(given)
            if tensors and (isinstance(model, PolicyModel) or lora.serves_adapters(model)):
                raise FailedPrecondition(
                    f"policy {policy!r} serves a LoRA adapter: a full version would change "
                    "the base it was trained on",
                    reason="ADAPTER_POLICY",
                    metadata={"field": "versions", "policy": policy},
                )
            model.check_state(tensors, partial=True)
            own = dict(model.named_parameters(remove_duplicate=False))
            states[policy] = {
                n: t.to(device=own[n].device, dtype=own[n].dtype) for n, t in tensors.items()
            }
            if self.on_swap == "finish_old" and tensors:
                models[policy] = copy.deepcopy(model)
                models[policy].load_weights(states[policy], partial=True)
        return SwapOrder(versions, states, models, done=lambda exc: None, adapters=adapters)

    async def swap_weights(
        self, versions: Mapping[str, int], state: Mapping[str, Mapping[str, object]]
    ) -> None:
        """Installs all given policies' weights together between two decode steps.

        `state[policy]` maps Hugging Face tensor names to torch tensors (or raw
        (dtype, shape, bytes) tensors); names left out keep their values, so a
        partial state is allowed. A policy in `versions` but not in `state` is
        relabelled only. Unknown names or shapes raise InvalidArgument before
        anything changes. Returns once the swap is installed; cancelling the call
        does not cancel a swap already handed to the worker.
        """
        for policy in (*versions, *state):
            self._policy(policy, "versions")
        if any(not isinstance(v, int) or isinstance(v, bool) for v in versions.values()):
            raise invalid_field("versions", "versions must be integers")
        if set(state) - set(versions):
            raise invalid_field("state", "names a policy without a version", reason="NO_VERSION")
        await self._swap_lock.acquire()
        try:
            order = await asyncio.to_thread(self._prepare, dict(versions), state)
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            order.done = deliverer(loop, fut)
            self._sched.swap(order)
        except BaseException:
            self._swap_lock.release()
            raise
        # Held until installed, even if this caller is cancelled: the next swap builds on it.
        fut.add_done_callback(lambda _: self._swap_lock.release())
        await asyncio.shield(fut)

    async def close(self) -> None:
        """Stops the worker; requests still running end with finish_reason "aborted"."""
        self._sched.close()
        await asyncio.to_thread(self._sched.join)
