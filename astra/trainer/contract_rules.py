"""The trainer's side of the contract, as checks over what a checking Dataflow and
WeightService recorded (`astra trainer check`).

Each rule is a plain function of the recorded events: a name, a one-line
explanation and a verdict (pass, fail with what was seen, or skip when nothing it
speaks of happened). The rules are those the comments of dataflow_service.proto
and weight_service.proto state for a trainer. This module never touches the
network or a process: servers/trainer_check.py records, astra/trainer/check_cli.py
runs the trainer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

REASON = re.compile(r"[A-Za-z0-9_]{1,64}")
SPENT = ("REQUEST_ID_REUSED", "BATCH_LEASE_EXPIRED")  # FetchBatch: use a new request_id


@dataclass
class Event:
    """One call the trainer made (or a run starting or ending), at `t` (monotonic seconds)."""

    t: float
    run: int  # 1 for the first start of the trainer, 2 after a restart
    kind: str  # fetch | ack | extend | announce | publish | run_start | run_end
    info: dict = field(default_factory=dict)


@dataclass
class Verdict:
    name: str
    status: str  # "pass", "fail" or "skip"
    detail: str  # what was seen
    rule: str = ""  # the rule's one-line explanation


@dataclass
class Recording:
    """What the checker saw: the events in order, and what the run asked for."""

    events: list[Event]
    steps: int  # versions each run was to commit
    restarted: bool = False

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


class Failed(Exception):
    pass


class Skip(Exception):
    pass


def committed(events: list[Event], run: int) -> int:
    """Versions the run committed past the one current when it started (the initial weights'
    publish and a catch-up of a version published before a restart are not its steps)."""
    start = next(e for e in events if e.kind == "run_start" and e.run == run)
    base = start.info["current_version"]
    return sum(
        1
        for e in events
        if e.kind == "publish" and e.run == run and e.info["outcome"] == "committed"
        and e.info["version"] > base
    )  # fmt: skip


def trains(r: Recording) -> str:
    runs = sorted({e.run for e in r.of("run_start")})
    for run in runs:
        got = committed(r.events, run)
        if got < r.steps:
            raise Failed(f"run {run} committed {got} new versions, {r.steps} asked for")
    return f"{len(runs)} run(s), {r.steps} new versions committed in each"


def retry_reuses_request_id(r: Recording) -> str:
    fetches, seen = r.of("fetch"), 0
    for i, e in enumerate(fetches):
        if e.info["outcome"] != "broken":
            continue
        after = [f for f in fetches[i + 1 :] if f.run == e.run]
        if not after:
            continue
        seen += 1
        nxt = after[0].info
        if (nxt["request_id"], nxt["num_groups"]) != (e.info["request_id"], e.info["num_groups"]):
            raise Failed(
                f"stream of request {e.info['request_id']!r} broke; the retry asked "
                f"{nxt['request_id']!r} ({nxt['num_groups']} groups): a new batch, the leased one lost"
            )
    if not seen:
        raise Skip("no broken stream was retried")
    return f"{seen} broken stream(s) retried with the same request_id"


def spent_request_id_replaced(r: Recording) -> str:
    fetches, seen = r.of("fetch"), 0
    for i, e in enumerate(fetches):
        if e.info.get("reason") not in SPENT:
            continue
        after = [f for f in fetches[i + 1 :] if f.run == e.run]
        if not after:
            continue
        seen += 1
        if after[0].info["request_id"] == e.info["request_id"]:
            raise Failed(
                f"request_id {e.info['request_id']!r} refused {e.info['reason']}, then asked again"
            )
    if not seen:
        raise Skip("no fetch was refused for a spent request_id")
    return f"{seen} spent request id(s), each replaced by a new one"


def batches_acknowledged_in_lease(r: Recording) -> str:
    ends = {e.run: e.t for e in r.of("run_end")}
    whole = [e for e in r.of("fetch") if e.info["outcome"] == "batch"]
    done: dict[str, list[tuple]] = {}
    for e in r.events:  # the first accepted ack or extension after each lease grant
        if e.kind in ("ack", "extend") and e.info["outcome"] == "ok":
            done.setdefault(e.info["batch_id"], []).append((e.t, e.kind, e.info.get("expire")))
    for f in whole:
        bid, expire = f.info["batch_id"], f.info["expire"]
        for t, kind, new_expire in sorted(done.get(bid, [])):
            if t > expire:
                break
            if kind == "ack":
                expire = None
                break
            expire = new_expire
        if expire is None or ends.get(f.run, float("inf")) < expire:
            continue  # acknowledged, or the trainer's process ended with the lease running
        raise Failed(f"batch {bid} neither acknowledged nor extended before its lease ended")
    return f"{len(whole)} batches, each acknowledged within its lease"


def acks_name_delivered_batches(r: Recording) -> str:
    delivered = {e.info["batch_id"] for e in r.of("fetch") if e.info["outcome"] == "batch"}
    acks = r.of("ack")
    for e in acks:
        bid, why = e.info["batch_id"], e.info["untrained_reason"]
        if bid not in delivered:
            raise Failed(f"AckBatch of {bid!r}, a batch never delivered whole")
        if why and not REASON.fullmatch(why):
            raise Failed(f"AckBatch {bid}: untrained_reason {why!r} is not 1-64 letters, digits, _")
    return f"{len(acks)} acknowledgements, each of a delivered batch"


def ack_before_announce(r: Recording) -> str:
    starts = r.of("run_start")
    if not starts:
        raise Skip("the trainer never ran")
    base, acks, checked = starts[0].info["current_version"], 0, 0
    for e in r.events:
        if e.kind == "ack":
            acks += 1
        if e.kind == "announce" and e.info["outcome"] == "ok" and e.info["new"]:
            checked += 1
            v = e.info["version"]
            if acks < v - base:
                raise Failed(
                    f"version {v} announced after {acks} acknowledgements: the batch trained "
                    "into it was not acknowledged first"
                )
    return f"{checked} new versions, each after the acknowledgement of its batch"


def versions_step_by_one(r: Recording) -> str:
    for e in r.of("announce"):
        v, current = e.info["version"], e.info["current_before"]
        if v not in (current, current + 1):
            raise Failed(f"version {v} announced while {current} was current")
    return "each announce the current version or the next"


def announce_after_commit(r: Recording) -> str:
    n = 0
    for e in r.of("announce"):
        if e.info["outcome"] != "ok":
            continue
        n += 1
        v, held = e.info["version"], e.info["held"]  # identity the store holds at v, or None
        if held is None:
            raise Failed(f"version {v} announced before the WeightService committed it")
        if e.info["new"] and held != e.info["version_id"]:
            raise Failed(f"version {v} announced as {e.info['version_id']!r}; stored as {held!r}")
    return f"{n} announces, each of a committed version"


def publish_checksums_correct(r: Recording) -> str:
    publishes = r.of("publish")
    for e in publishes:
        if e.info.get("reason") in ("CHECKSUM_MISMATCH", "CORRUPT_DELTA"):
            raise Failed(f"publish of version {e.info['version']} refused: {e.info['detail']}")
    return f"{len(publishes)} publish streams, no checksum refused"


def restart_resumes(r: Recording) -> str:
    if not r.restarted:
        raise Skip("no restart (--restart)")
    for start in r.of("run_start")[1:]:
        first = next((e for e in r.events if e.run == start.run and e.kind == "fetch"), None)
        until = first.t if first is not None else float("inf")
        ok = [
            e
            for e in r.of("announce")
            if e.run == start.run and e.t <= until and e.info["resumed"]
            and e.info["resumed_from_version"] is not None and not e.info["new"]
        ]  # fmt: skip
        if not ok:
            raise Failed(
                f"run {start.run} fetched before announcing the current version with resumed "
                "and resumed_from_version set"
            )
    return "after the restart: the current version announced again, resumed"


Rule = tuple[str, str, Callable[[Recording], str]]
RULES: tuple[Rule, ...] = (
    ("trains", "each run commits the versions asked for (else the rules below see little)", trains),
    ("retry_reuses_request_id", "a broken FetchBatch stream is retried with the same request_id", retry_reuses_request_id),
    ("spent_request_id_replaced", "after REQUEST_ID_REUSED or BATCH_LEASE_EXPIRED a fetch takes a new request_id", spent_request_id_replaced),
    ("batches_acknowledged_in_lease", "every batch delivered is acknowledged (or extended) before its lease ends", batches_acknowledged_in_lease),
    ("acks_name_delivered_batches", "AckBatch names a delivered batch; untrained_reason is 1-64 [A-Za-z0-9_]", acks_name_delivered_batches),
    ("ack_before_announce", "the batch of a step is acknowledged before the version it made is announced", ack_before_announce),
    ("versions_step_by_one", "AnnounceVersion names the current version or current + 1", versions_step_by_one),
    ("announce_after_commit", "a version is announced only once the WeightService holds it, as published", announce_after_commit),
    ("publish_checksums_correct", "publish streams carry each tensor's correct Adler-32", publish_checksums_correct),
    ("restart_resumes", "a restarted trainer announces the current version resumed before it fetches", restart_resumes),
)  # fmt: skip


def evaluate(recording: Recording) -> list[Verdict]:
    out = []
    for name, text, rule in RULES:
        try:
            out.append(Verdict(name, "pass", rule(recording), text))
        except Failed as exc:
            out.append(Verdict(name, "fail", str(exc), text))
        except Skip as exc:
            out.append(Verdict(name, "skip", str(exc), text))
    return out


def summary(verdicts: list[Verdict]) -> dict:
    counts = {k: sum(v.status == k for v in verdicts) for k in ("pass", "fail", "skip")}
    return {"ok": counts["fail"] == 0, **counts, "checks": [asdict(v) for v in verdicts]}
