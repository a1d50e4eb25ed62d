"""The fault campaign: `astra run` under real faults, each run audited in Dataflow's own records.

    python tools/chaos/campaign.py [--steps N] [--only NAME ...] [--out DIR] [--list]
    make chaos

Each scenario runs the embedded default recipe (shortened) in a directory of its own, does
its faults with real signals to real processes, lets the run finish (with `--resume` where
the fault ends the supervisor) and then checks, whatever the fault:

- the run ended `completed` with every step trained (summary.json and exit 0);
- summary.json: groups_lost 0, groups_duplicated 0;
- Dataflow's own database (read-only, astra.run.summary.read_state): no group in two
  acknowledged batches, at least one acknowledged batch per step;
- no process left: nothing alive whose command line names the run directory.

It prints one row per scenario (PASS/FAIL with the failed checks) and exits 1 when any
failed. tests/test_chaos.py runs one short scenario so the tool keeps working; the whole
campaign takes about 11 minutes on two cores (60 steps per run). `power-cut-then-resume`
needs /dev/fuse and mount(2) (astra.testing.powercut); it is skipped, with the reason, without.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--set", "dataset.size=64", "--set", "observe.baseline_samples=8"]
SMALL += ["--set", "warmup.steps=20", "--set", "trainer.batch_groups=4"]
SMALL += ["--set", "supervision.stop_grace_s=10", "--set", "eval.every_steps=0"]
SMALL += ["--set", "supervision.restart_backoff_s=0.2", "--set", "trainer.checkpoint.every_steps=3"]
ROLES = {"dataflow", "weights", "raas", "trainer"}


class Run:
    """One `python -m astra.run` of the campaign (its output in RUN_DIR.out)."""

    def __init__(self, run_dir: Path, steps: int) -> None:
        self.run_dir, self.steps = run_dir.resolve(), steps
        self.proc: subprocess.Popen | None = None
        self.codes: list[int] = []
        self.notes: list[str] = []

    def start(self, *extra: str, resume: bool = False) -> None:
        where = ["--resume", str(self.run_dir)] if resume else ["--run-dir", str(self.run_dir)]
        cmd = [sys.executable, "-m", "astra.run", *where, *SMALL]
        cmd += ["--set", f"trainer.num_steps={self.steps}", *extra]
        out = (self.run_dir.parent / f"{self.run_dir.name}.out").open("ab")
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )
        out.close()

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.notes.append(f"still running after {timeout_s:.0f}s: SIGKILL")
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(30)
        self.codes.append(code)
        return code

    def children(self) -> dict[str, dict]:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((self.run_dir / "run.json").read_text())
            return {c["name"]: c for c in data["children"]}
        return {}

    def wait_for(self, roles: set[str], timeout_s: float = 120) -> dict[str, dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            children = self.children()
            if roles <= {c["role"] for c in children.values()} and all(
                c["address"] for c in children.values()
            ):
                return children
            time.sleep(0.2)
        raise RuntimeError(f"children {sorted(roles)} did not start in {timeout_s:.0f}s")

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return 0
        rows = path.read_text().splitlines()
        return max((json.loads(r).get("step", 0) for r in rows if r.strip()), default=0)

    def until_step(self, step: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.steps_done() < step:
            if self.proc is not None and self.proc.poll() is not None:
                return
            time.sleep(0.3)


def leftovers(run_dir: Path) -> list[str]:
    """Live processes (other than this one) whose command line names the run directory."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(run_dir) in cmd:
                found.append(f"{entry.name}: {cmd[:120]}")
    return found


def audit(run: Run) -> list[str]:
    """The checks every scenario ends with: what failed (empty: all held)."""
    from astra.run.summary import read_state

    failed = []
    if not run.codes or run.codes[-1] != 0:
        failed.append(f"exit codes {run.codes}")
    try:
        s = json.loads((run.run_dir / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        return [*failed, f"summary.json: {exc}"]
    if s.get("status") != "completed" or s.get("steps") != run.steps:
        failed.append(f"status {s.get('status')!r} at step {s.get('steps')}")
    for key in ("groups_lost", "groups_duplicated"):
        if s.get(key) != 0:
            failed.append(f"summary {key} = {s.get(key)}")
    state = read_state(run.run_dir / "state" / "dataflow")
    if state.get("duplicated", 0):
        failed.append(f"Dataflow's records: {state['duplicated']} groups trained twice")
    if state.get("acked_batches", 0) < run.steps:
        failed.append(f"Dataflow's records: {state.get('acked_batches')} batches < steps")
    deadline = time.monotonic() + 20
    while (left := leftovers(run.run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        failed.append(f"left running: {left}")
    return failed


# -- scenarios: each does its faults; the run must end completed (audit) ---------------------


def kill_each_service(run: Run) -> None:
    """SIGKILL of each service in turn, a few steps apart (each is restarted)."""
    run.start()
    children = run.wait_for(ROLES)
    for i, name in enumerate(["raas-1", "dataflow", "weights", "trainer-policy", "raas-0"]):
        run.until_step(2 + 3 * i)
        children = run.children()
        if name in children and children[name]["pid"]:
            os.kill(children[name]["pid"], signal.SIGKILL)
            run.notes.append(f"killed {name}")
        run.wait_for(ROLES)
    run.wait(600)


def random_kills(run: Run, seed: int = 7) -> None:
    """SIGKILL of a random child every 4-8 s until the run ends (it trains 8x the campaign's
    steps, so that several land: a run with fewer than two kills fails the scenario). The
    restart budget is raised to 20 a child: the scenario audits the kills, not the budget."""
    rng = random.Random(seed)
    run.steps *= 8
    run.start("--set", "supervision.max_restarts=20")
    run.wait_for(ROLES)
    while run.proc is not None and run.proc.poll() is None:
        time.sleep(rng.uniform(4, 8))
        victims = [c for c in run.children().values() if c["pid"] and c["address"]]
        if victims and run.proc.poll() is None:
            victim = rng.choice(victims)
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim["pid"], signal.SIGKILL)
                run.notes.append(f"killed {victim['name']}")
    run.wait(60)
    if (kills := sum(n.startswith("killed ") for n in run.notes)) < 2:
        raise RuntimeError(f"{kills} kill(s) before the run ended: give it more --steps")


def hang_raas(run: Run) -> None:
    """SIGSTOP of a RaaS for 20 s (a hung machine), then SIGCONT, while the run goes on: it
    trains 8x the campaign's steps, so that it outlasts the hang (60 steps take ~5 s)."""
    run.steps *= 8
    run.start()
    children = run.wait_for(ROLES)
    run.until_step(2)
    pid = children["raas-0"]["pid"]
    os.killpg(pid, signal.SIGSTOP)
    time.sleep(20)
    assert run.proc is not None
    if run.proc.poll() is not None:  # its supervisor killed the hung RaaS at the end
        raise RuntimeError("the run ended during the hang: give the scenario more --steps")
    os.killpg(pid, signal.SIGCONT)
    run.wait(600)


def kill_supervisor_then_resume(run: Run) -> None:
    """SIGKILL of `astra run` itself (the OOM killer): every child goes with it; --resume
    finishes the run."""
    run.start()
    children = run.wait_for(ROLES)
    run.until_step(4)
    assert run.proc is not None
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(10)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and leftovers(run.run_dir):
        time.sleep(0.5)
    if left := leftovers(run.run_dir):
        run.notes.append(f"orphans after the supervisor's death: {left}")
    run.notes.append(f"{len(children)} children gone with the supervisor")
    run.start(resume=True)
    run.wait(600)


def resume_while_live(run: Run) -> None:
    """`--resume` beside the live run is refused (exit 2); the live run finishes alone."""
    run.start()
    run.wait_for(ROLES)
    cmd = [sys.executable, "-m", "astra.run", "--resume", str(run.run_dir)]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    if second.returncode != 2:
        run.notes.append(f"second --resume exited {second.returncode}: not refused")
    run.wait(600)


def stop_then_resume(run: Run, sig: int = signal.SIGTERM) -> None:
    """SIGTERM (or SIGHUP) stops the run mid-way; --resume finishes it."""
    run.start()
    run.wait_for(ROLES)
    run.until_step(5)
    assert run.proc is not None
    run.proc.send_signal(sig)
    code = run.wait(120)
    if code != 128 + sig:
        run.notes.append(f"stop exited {code}")
    run.codes.clear()
    run.start(resume=True)
    run.wait(600)


def hangup_then_resume(run: Run) -> None:
    """SIGHUP (the terminal closes) stops the run mid-way; --resume finishes it."""
    stop_then_resume(run, signal.SIGHUP)


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _stop(run: Run, at_step: int) -> None:
    run.start()
    run.wait_for(ROLES)
    run.until_step(at_step)
    assert run.proc is not None
    run.proc.send_signal(signal.SIGTERM)
    run.wait(120)
    run.codes.clear()


def _doctor(run: Run, expect: int) -> None:
    cmd = [sys.executable, "-m", "astra.cli", "doctor", str(run.run_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    run.notes.append(f"doctor exit {done.returncode}")
    if done.returncode != expect:
        raise RuntimeError(f"astra doctor exited {done.returncode}, not {expect}: {done.stdout}")


def _counter(run: Run, name: str) -> int:
    rows = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    return int(json.loads(rows[-1])["dataflow"]["counters"].get(name, 0)) if rows else 0


def rot_blob_then_resume(run: Run) -> None:
    """A byte of a buffered rollout flipped on disk while the run is stopped: `astra doctor`
    finds it, --resume quarantines it (never trained) and generates its group again."""
    import sqlite3

    _stop(run, 6)
    state = run.run_dir / "state" / "dataflow"
    db = sqlite3.connect(f"file:{state / 'dataflow.sqlite'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT seg, off, len FROM groups WHERE batch_id IS NULL LIMIT 1")
        found = row.fetchone()
    finally:
        db.close()
    if found is None:
        raise RuntimeError("no buffered group to damage (the buffer was empty at the stop)")
    seg, off, length = found
    _flip(state / "blobs" / f"{seg:08d}.seg", off + length - 3)
    _doctor(run, 1)
    run.start(resume=True)
    run.wait(600)
    corrupt = _counter(run, "records_corrupt")
    run.notes.append(f"records_corrupt {corrupt}")
    if corrupt < 1:
        raise RuntimeError("the damaged record was not counted (records_corrupt 0)")


def rot_checkpoint_then_resume(run: Run) -> None:
    """A weight of the newest checkpoint changed on disk: --resume refuses it by name and
    starts from the one before."""
    _stop(run, 8)
    ckpts = sorted((run.run_dir / "checkpoints" / "policy").glob("step-*"))
    if len(ckpts) < 2:
        raise RuntimeError(f"{len(ckpts)} checkpoints: need two to fall back")
    weights = sorted((ckpts[-1] / "model").glob("*.safetensors"))[0]
    _flip(weights, weights.stat().st_size - 5)
    _doctor(run, 1)
    run.start(resume=True)
    run.wait(600)
    log = (run.run_dir / "logs" / "trainer-policy.log").read_text(errors="replace")
    if f"resumed from {ckpts[-2]}" not in log:
        raise RuntimeError(f"the trainer did not resume from {ckpts[-2].name}")
    run.notes.append(f"resumed from {ckpts[-2].name}, not {ckpts[-1].name}")


def acked_groups(run_dir: Path) -> dict[tuple[str, str], tuple[int, str]]:
    """(policy, group id) -> (batch version, untrained reason) of every group in a batch a
    trainer acknowledged, from Dataflow's database (read-only; closed before returning)."""
    import sqlite3

    from astra.dataflow.store_schema import batch_groups

    path = run_dir / "state" / "dataflow" / "dataflow.sqlite"
    if not path.is_file():
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT batch_id, policy_id, policy_version, groups, untrained_reason FROM batches"
            " WHERE state = 'acked'"
        ).fetchall()
    finally:
        db.close()
    return {(r[1], g[0]): (r[2], r[4]) for r in rows for g in batch_groups(*r[:4]) if not g[1]}


def resumed_versions(run_dir: Path) -> dict[str, int]:
    """Each trainer's version its last start resumed from, from its log; where its log has no
    such line (logs are not made durable: a power cut may take them, and a resumed run whose
    trainer had no step left starts none), the version of its newest checkpoint that
    verifies (astra.trainer.ckpt_verify); 0: no checkpoint."""
    from astra.trainer.ckpt_verify import newest_good

    found = {}
    for path in (run_dir / "logs").glob("trainer-*.log"):
        marks = re.findall(r"resumed from \S+ at step \d+, version (\d+)", path.read_text())
        if marks:
            found[path.stem.removeprefix("trainer-")] = int(marks[-1])
    for root in sorted((run_dir / "checkpoints").glob("*")):
        if root.name not in found and (good := newest_good(root)) is not None:
            found[root.name] = int(json.loads((good / "trainer.json").read_text())["version"])
    return found


def kill_everything(run: Run) -> list[int]:
    """SIGKILL of the supervisor and of every process naming the run directory, at once."""
    pids = [run.proc.pid] if run.proc is not None else []
    pids += [c["pid"] for c in run.children().values() if c.get("pid")]
    pids += [int(line.split(":")[0]) for line in leftovers(run.run_dir)]
    for pid in dict.fromkeys(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if run.proc is not None:
        run.proc.wait(30)
    return pids


def _no_power_cut() -> str | None:
    """Why the power-cut scenario cannot run here (no /dev/fuse), or None."""
    from astra.testing.powercut.control import unavailable_reason

    return unavailable_reason()


def power_cut_then_resume(run: Run, seed: int | None = None) -> None:
    """The power goes at a random moment of RL (every process SIGKILLed, then all that was
    not fsynced is lost: astra.testing.powercut over /dev/fuse); --resume on what survived.
    Every group a trainer had acknowledged must stay acknowledged."""
    import shutil

    from astra.testing.powercut import PowerCutMount

    seed = int(os.environ.get("ASTRA_POWERCUT_SEED", "0")) if seed is None else seed
    rng = random.Random(seed)
    at_step, extra_s = rng.randint(2, max(2, run.steps - 3)), rng.uniform(0.0, 1.0)
    run.notes.append(f"seed {seed}: cut after step {at_step} + {extra_s:.1f}s")
    print(f"power cut: seed {seed}, after step {at_step} + {extra_s:.1f}s", flush=True)
    with PowerCutMount(run.run_dir.parent / f"{run.run_dir.name}.mnt") as fs:
        live = Run(fs.path / "run", run.steps)
        try:
            live.start()
            live.wait_for(ROLES)
            live.until_step(at_step)
            time.sleep(extra_s)
            before = acked_groups(live.run_dir)
            time.sleep(0.5)  # an acknowledgement seen above has finished its fsync
            killed = kill_everything(live)
            run.notes.append(f"{len(set(killed))} processes killed at step {live.steps_done()}")
            started = time.monotonic()
            fs.cut()
            live.codes.clear()
            live.start(resume=True)
            live.wait(600)
            after = acked_groups(live.run_dir)
            run.notes.append(
                f"{len(before)} groups acked before the cut, {len(after)} after; "
                f"cut + resume {time.monotonic() - started:.0f}s"
            )
            deadline = time.monotonic() + 20
            while (left := leftovers(live.run_dir)) and time.monotonic() < deadline:
                time.sleep(0.5)
            if left:
                raise RuntimeError(f"left running: {left}")
        finally:
            if live.proc is not None and live.proc.poll() is None:
                kill_everything(live)
            if live.run_dir.is_dir():  # what the audit reads, off the mount
                shutil.copytree(live.run_dir, run.run_dir, symlinks=True, dirs_exist_ok=True)
            with contextlib.suppress(OSError):
                shutil.copyfile(fs.path / "run.out", run.run_dir.parent / f"{run.run_dir.name}.out")
    run.codes = live.codes
    if lost := before.keys() - after.keys():
        raise RuntimeError(f"{len(lost)} groups acknowledged before the cut are not any more")
    # A group acknowledged before the cut is in the weights the trainer resumed from (its
    # batch's version below the checkpoint's), or counted discarded: never silently lost.
    resumed = resumed_versions(run.run_dir)
    dropped = [k for k in before if after[k][0] >= resumed.get(k[0], 0) and not after[k][1]]
    if dropped:
        raise RuntimeError(
            f"{len(dropped)} groups acknowledged before the cut were trained into steps the "
            f"resumed trainer does not have (it resumed from {resumed}) and are not discarded; "
            f"exit codes {run.codes}; {'; '.join(run.notes)}"
        )
    run.notes.append(f"resumed from {resumed}")


SCENARIOS: dict[str, Callable[[Run], None]] = {
    "kill-each-service": kill_each_service,
    "random-kills": random_kills,
    "hang-raas": hang_raas,
    "kill-supervisor-then-resume": kill_supervisor_then_resume,
    "resume-while-live": resume_while_live,
    "sigterm-then-resume": stop_then_resume,
    "sighup-then-resume": hangup_then_resume,
    "rot-blob-then-resume": rot_blob_then_resume,
    "rot-checkpoint-then-resume": rot_checkpoint_then_resume,
    "power-cut-then-resume": power_cut_then_resume,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="trainer steps per run")
    ap.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="these scenarios")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, fn in SCENARIOS.items():
            print(f"{name:30s} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    rows = []
    for name in args.only or list(SCENARIOS):
        if name == "power-cut-then-resume" and (why := _no_power_cut()):
            print(f"{name}: SKIP ({why})", flush=True)
            continue
        run = Run(args.out / f"{stamp}-{name}", args.steps)
        run.run_dir.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            SCENARIOS[name](run)
            failed = audit(run)
        except Exception as exc:  # a scenario that could not do its faults is a failure too
            failed = [f"{type(exc).__name__}: {exc}"]
            if run.proc is not None and run.proc.poll() is None:
                os.killpg(run.proc.pid, signal.SIGKILL)
        rows.append((name, not failed, time.monotonic() - started, failed, run))
        print(f"{name}: {'PASS' if not failed else 'FAIL'} {failed}", flush=True)
    print("\n| scenario | result | seconds | faults | failed checks |\n|---|---|---|---|---|")
    for name, ok, secs, failed, run in rows:
        faults = "; ".join(run.notes) or "-"
        print(
            f"| {name} | {'PASS' if ok else 'FAIL'} | {secs:.0f} | {faults} | "
            f"{'; '.join(failed) or '-'} |"
        )
    return 0 if all(ok for _, ok, *_ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
