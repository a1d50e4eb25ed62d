"""`HTTPEngine`: the api.InferenceEngine shared by every adapter to an engine server over HTTP.

One adapter serves one policy from one server (one model). A subclass says how
to ask the server for one continuation (`_segment_request`) and how to read
its answer (`_parse_segment`); swappable engines also say how to pause, load a
checkpoint directory and resume (`_pause`, `_load_from_disk`, `_resume`).

A request runs as one or more segments (`_run_segment`): a swap that aborts a
segment has it resubmitted as prompt + tokens so far, and each segment's
tokens carry the version they were produced by. How a swap runs, by pause or
live, and how each token's version is known: astra.engine.http.swap
(`WeightSwaps`, this class's swap half). How the segments make one
`Generation` (finish reason, client-side stops, text): astra.engine.http.result.

Weights for a swap arrive as a `WeightsDir` (a verified local Hugging Face
directory, readable by the server's host) in `state[policy]`; a plain tensor
mapping is refused (FailedPrecondition NEEDS_WEIGHTS_DIR). A policy in
`versions` but not in `state` is relabelled only, as in the built-in engine.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from typing import Any

from astra.engine.api import Generation, Sampling, Tokenizer
from astra.engine.http.client import engine_client
from astra.engine.http.launch import ServerProcess
from astra.engine.http.result import Segment, assemble
from astra.engine.http.swap import OnSwap, WeightSwaps, token_versions
from astra.engine.http.weights_dir import WeightsDir
from astra.engine.validate import check_request
from astra.errors import AstraError, FailedPrecondition, Unavailable, invalid_field

log = logging.getLogger(__name__)

NO_LIMIT = 2**31 - 1


class HTTPEngine(WeightSwaps):
    """Base of the HTTP adapters (see the module docstring); one policy per instance."""

    name = "http"
    swappable = False
    # What `Generation.logprobs` means for this server; subclasses state it exactly.
    logprob_convention = "as reported by the server"

    def __init__(
        self,
        base_url: str,
        policy_id: str,
        tokenizer: Tokenizer,
        *,
        version: int = 0,
        api_key: str | None = None,
        max_seq_len: int | None = None,
        max_running: int = 256,
        request_timeout_s: float = 600.0,
        on_swap: OnSwap = "continue",
        drain_timeout_s: float = 10.0,
        process: ServerProcess | None = None,
    ) -> None:
        self._init_swaps(on_swap, drain_timeout_s)  # refuses a bad on_swap first
        self.client = engine_client(
            base_url, api_key=api_key, request_timeout_s=request_timeout_s, max_running=max_running
        )
        self.policy_ids = (policy_id,)
        self._policy_id = policy_id
        self._tok = tokenizer
        self._version = int(version)
        self._max_seq_len = max_seq_len
        self._max_running = max_running
        self.process = process
        self._running = 0  # generate calls in progress
        self._failed = None
        self._closed = False

    # -- api.InferenceEngine ---------------------------------------------------------

    def _policy(self, policy_id: str, field_name: str = "policy_id") -> str:
        if policy_id != self._policy_id:
            raise invalid_field(
                field_name, f"unknown policy {policy_id!r}", reason="UNKNOWN_POLICY"
            )
        return policy_id

    def tokenizer(self, policy_id: str) -> Tokenizer:
        self._policy(policy_id)
        return self._tok

    def version(self, policy_id: str) -> int:
        self._policy(policy_id)
        return self._version

    def max_seq_len(self, policy_id: str) -> int:
        self._policy(policy_id)
        return self._max_seq_len or NO_LIMIT

    def stats(self) -> dict[str, int]:
        """running, waiting, max_batch, free_slots, as the built-in engine reports them."""
        return {
            "running": self._running,
            "waiting": self._waiting,
            "max_batch": self._max_running,
            "free_slots": max(0, self._max_running - self._running),
        }

    @property
    def failure(self) -> str | None:
        """Why this engine stopped serving (a failed resume or reload), or None."""
        return self._failed

    @property
    def healthy(self) -> bool:
        if self._failed is not None or self._closed:
            return False
        return self.process is None or self.process.alive

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Waits for a launched server to answer (an attached one is checked once), then
        takes the context length from `GET /v1/models` (`max_model_len`) unless one was given."""
        if self.process is not None:
            await self.process.wait_ready(timeout_s)
        else:
            await self._probe()
        if self._max_seq_len is None:
            try:
                models = await self.client.request("GET", "/v1/models", timeout_s=10.0)
                found = models["data"][0]["max_model_len"]
                self._max_seq_len = int(found)
            except (AstraError, KeyError, IndexError, TypeError, ValueError):
                log.info(
                    "%s: no max_model_len from /v1/models; the server checks lengths", self.name
                )

    async def _probe(self) -> None:
        await self.client.request("GET", "/health", expect_json=False, timeout_s=10.0)

    async def generate(
        self, policy_id: str, prompt_ids: list[int], sampling: Sampling
    ) -> Generation:
        """Samples one continuation through the server; bad input -> InvalidArgument naming
        the field; an unreachable or failing server -> Unavailable."""
        self._policy(policy_id)
        check_request(
            prompt_ids,
            sampling,
            vocab_size=self._tok.vocab_size,
            max_seq_len=self._max_seq_len or NO_LIMIT,
        )
        self._check_sampling(sampling)
        if self._closed:
            raise Unavailable(f"{self.name} engine is closed", reason="ENGINE_CLOSED")
        prompt = [int(t) for t in prompt_ids]
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        meta: dict[str, Any] = {
            "policy_id": policy_id,
            "engine": self.name,
            "prompt_tokens": len(prompt),
            "logprob_convention": self.logprob_convention,
            "segments": 0,
        }
        if sampling.seed is not None:
            meta["seed"] = sampling.seed
        self._running += 1
        try:
            while True:
                remaining = sampling.max_new_tokens - len(tokens)
                seg, labels, preempted = await self._run_segment(
                    prompt + tokens, sampling, remaining
                )
                tokens += seg.token_ids
                logprobs += seg.logprobs
                versions += labels
                meta["segments"] += 1
                meta.update(seg.meta)
                if seg.finish == "abort" and preempted and len(tokens) < sampling.max_new_tokens:
                    continue  # our own swap cut it short: carry on with the new weights
                break
        finally:
            self._running -= 1
        return assemble(self._tok, tokens, logprobs, versions, seg, sampling, meta)

    async def swap_weights(
        self, versions: Mapping[str, int], state: Mapping[str, Mapping[str, object]]
    ) -> None:
        """Installs `state[policy]` (a WeightsDir) as `versions[policy]`; see the module docstring
        and astra.engine.http.swap."""
        for policy in (*versions, *state):
            self._policy(policy, "versions")
        if any(not isinstance(v, int) or isinstance(v, bool) for v in versions.values()):
            raise invalid_field("versions", "versions must be integers")
        if set(state) - set(versions):
            raise invalid_field("state", "names a policy without a version", reason="NO_VERSION")
        if self._policy_id not in versions:
            return
        new_version = int(versions[self._policy_id])
        weights = state.get(self._policy_id)
        if weights is None:
            self._version = new_version  # relabel only
            return
        await self._install(new_version, weights)

    async def _install(self, version: int, weights: Mapping[str, object]) -> None:
        """Swaps to `weights` as `version`; an engine that takes other kinds overrides it."""
        if not isinstance(weights, WeightsDir):
            raise FailedPrecondition(
                f"{self.name} engine for policy {self._policy_id!r} loads weights from a local "
                "checkpoint directory: pass astra.engine.http.WeightsDir(path) as state[policy]",
                reason="NEEDS_WEIGHTS_DIR",
            )
        await self._swap_from_disk(version, weights.path)

    async def close(self) -> None:
        """Stops a launched server (requests in flight fail Unavailable); releases threads."""
        self._closed = True
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
        await self.client.close()

    # -- segments ----------------------------------------------------------------------

    async def _run_segment(
        self, context: list[int], sampling: Sampling, max_new: int
    ) -> tuple[Segment, list[int], bool]:
        """One request to the server; returns (segment, each token's version, aborted by
        our swap)."""
        if not self._gate.is_set():
            self._waiting += 1
            try:
                await self._gate.wait()
            finally:
                self._waiting -= 1
        swap_seq, load_seq, version = self._swap_seq, self._load_seq, self._version
        marker: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._in_flight.add(marker)
        rid = f"astra-{uuid.uuid4().hex}"
        starts = self._flights[rid] = [(0, version)]
        try:
            path, body = self._segment_request(context, sampling, max_new, rid)
            try:
                answer = await self.client.request("POST", path, body)
            except asyncio.CancelledError:
                await self._cancel_request(rid)
                raise
            except AstraError:
                if self._swap_seq != swap_seq:  # cut off by our own pause: retry after it
                    return Segment([], [], "abort"), [], True
                raise
            seg = self._parse_segment(answer, sampling)
            await self._committed.wait()  # a live commit under way says where we split
        finally:
            self._flights.pop(rid, None)
            self._in_flight.discard(marker)
            if not marker.done():
                marker.set_result(None)
        if self._load_seq != load_seq:  # still running when the load began: new weights
            starts = [(0, self._version)]
        return seg, token_versions(starts, len(seg.token_ids)), self._swap_seq != swap_seq

    async def _cancel_request(self, rid: str) -> None:
        """Best effort: tells the server to drop request `rid` (the socket is closed anyway)."""

    # -- what a subclass provides --------------------------------------------------------

    def _check_sampling(self, sampling: Sampling) -> None:
        """Raises InvalidArgument for settings this server cannot honour."""

    def _segment_request(
        self, context: list[int], sampling: Sampling, max_new: int, rid: str
    ) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _parse_segment(self, answer: Any, sampling: Sampling) -> Segment:
        raise NotImplementedError
