"""The held-out evaluations of a run (the recipe's `eval:`), as `astra run` records them.

Dataflow runs the evaluations (astra.dataflow.evals) and reports them in
GetStatus `evals`; the observer hands each poll's list to `EvalLog.update`,
which appends every newly finished one to <run>/evals.jsonl (one JSON row:
time, elapsed_s, stream, policy, version, mean_reward, solved_share, samples,
failed_samples, groups, token_versions) and to TensorBoard (`<stream>/mean_reward`,
`<stream>/solved_share` at step = version, in the policy's event file: `eval/...` for a
run that evaluates one stream). Rows
already in evals.jsonl (a --resume) are not written again. `summary()` is
summary.json's `eval` block. No grpc here: the poller converts the messages.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("astra.run")


class EvalLog:
    def __init__(
        self, path: Path, *, every_steps: int, streams: dict[str, list[str]] | None = None
    ) -> None:
        """streams: the run's evaluation streams -> their policies (summary.json leads with
        the first stream's first policy)."""
        self.path, self.every_steps = path, every_steps
        self.streams = dict(streams or {"eval": []})
        self.started = time.monotonic()
        self.rows: list[dict[str, Any]] = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    self.rows.append(json.loads(line))
                except ValueError:
                    continue  # a line cut short by a kill
        self.seen = {(r.get("stream"), r.get("version"), r.get("policy")) for r in self.rows}

    def update(self, evals: list[dict[str, Any]], tensorboard: Any = None) -> list[dict[str, Any]]:
        """Records the finished evaluations not seen before (and in `tensorboard`, a
        astra.run.tboard.TensorBoardSink, when given); returns their rows."""
        new = []
        for e in evals:
            key = (e["stream"], e["version"], e["policy_id"])
            if not e["complete"] or key in self.seen:
                continue
            self.seen.add(key)
            samples = e["samples"]
            row = {
                "time": round(time.time(), 3),
                "elapsed_s": round(time.monotonic() - self.started, 3),
                "stream": e["stream"],
                "policy": e["policy_id"],
                "version": e["version"],
                "mean_reward": round(e["mean_reward"], 6) if samples else None,
                "solved_share": round(e["solved_groups"] / e["groups"], 6) if e["groups"] else None,
                "samples": samples,
                "failed_samples": e["failed_samples"],
                "groups": e["groups"],
                "token_versions": [e["min_token_version"], e["max_token_version"]],
            }
            new.append(row)
            self.rows.append(row)
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            log.info(
                "%s of %s at version %d: mean reward %s over %d samples",
                row["stream"],
                row["policy"],
                row["version"],
                row["mean_reward"],
                samples,
            )
            if tensorboard is not None:
                values = {
                    f"{row['stream']}/{k}": float(row[k])
                    for k in ("mean_reward", "solved_share")
                    if row[k] is not None
                }
                tensorboard.write_scalars(row["policy"], int(row["version"]), values)
        return new

    def newest(self, stream: str | None = None) -> int | None:
        """The newest version evaluated (by `stream`, or by any)."""
        return max(
            (int(r["version"]) for r in self.rows if stream is None or r.get("stream") == stream),
            default=None,
        )

    def lead(self) -> tuple[str, str | None]:
        """(stream, policy) of the evaluation summary.json leads with: the first stream's
        first policy (None: whichever its rows name)."""
        stream, policies = next(iter(self.streams.items()))
        return stream, (policies[0] if policies else None)

    def summary(self) -> dict[str, Any]:
        """summary.json's `eval`: the first evaluation stream's figures (of its first policy;
        with several policies each one's under `policies`), and with several streams each
        one's under `streams`."""
        names = list(self.streams)
        out = self._stream_summary(names[0])
        if len(names) > 1:
            out["streams"] = {name: self._stream_summary(name) for name in names}
        return out

    def _stream_summary(self, stream: str) -> dict[str, Any]:
        rows = [r for r in self.rows if r.get("stream", stream) == stream]
        policies = list(self.streams.get(stream) or dict.fromkeys(r["policy"] for r in rows))
        out = {"stream": stream, **self._figures([r for r in rows if r["policy"] in policies[:1]])}
        if len(policies) > 1:
            out["policies"] = {
                p: self._figures([r for r in rows if r["policy"] == p]) for p in policies
            }
        return out

    def _figures(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        rows = sorted(rows, key=lambda r: r["version"])
        scored = [r for r in rows if r["mean_reward"] is not None]
        return {
            "every_steps": self.every_steps,
            "first": scored[0]["mean_reward"] if scored else None,
            "last": scored[-1]["mean_reward"] if scored else None,
            "last_version": scored[-1]["version"] if scored else None,
            "best": max((r["mean_reward"] for r in scored), default=None),
            "results": [
                {k: r[k] for k in ("version", "mean_reward", "solved_share", "samples")}
                for r in rows
            ],
            "method": "held-out problems (none in the RL or warm-up data) run by the RaaS at "
            "every every_steps-th version with the eval section's sampling (temperature 0: "
            "greedy), scored by the stream's reward (each policy on its own samples); "
            "mean_reward is accuracy for 0/1 rewards",
        }


def final_target(versions: dict[str, int], policy: str, every_steps: int) -> int | None:
    """The version whose evaluation ends the run: the last multiple of `every_steps` reached."""
    if every_steps <= 0 or policy not in versions:
        return None
    return versions[policy] // every_steps * every_steps
