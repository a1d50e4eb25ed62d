"""Requests to a running `astra run` (`astra raas add|remove`), as files under <run>/control/.

The CLI writes requests/<id>.json under a temporary name and renames it, so the
supervisor never reads half a request; the supervisor looks every `POLL_S`,
takes each request (reads it, then deletes it), acts on it, and writes
answers/<id>.json the same way; the CLI waits for that answer (bounded), prints
it and deletes it. A CLI that gives up deletes its request first: when that
succeeds the request was never taken, and nothing happens. Whether the run is
running is run.json's `supervisor` entry: its pid alive and its state "running".
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from astra.run.layout import RunDir

POLL_S = 0.5


class ControlError(RuntimeError):
    """A request that could not be made or was not answered; the message says why."""


def _requests(rd: RunDir) -> Path:
    return rd.control / "requests"


def _answers(rd: RunDir) -> Path:
    return rd.control / "answers"


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """Writes JSON to `path` by rename: readers see no file or the whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def supervisor_entry(rd: RunDir) -> dict[str, Any]:
    """run.json's `supervisor` entry ({} when there is none yet)."""
    try:
        data = json.loads(rd.run_json.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    entry = data.get("supervisor") if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) else {}


def check_running(rd: RunDir) -> dict[str, Any]:
    """The supervisor entry of a run that takes requests now; ControlError otherwise."""
    if not rd.recipe.is_file():
        raise ControlError(f"{rd.root}: not a run directory (no recipe.yaml)")
    entry = supervisor_entry(rd)
    pid, state = entry.get("pid"), entry.get("state")
    if not isinstance(pid, int) or not pid_alive(pid):
        raise ControlError(f"the run in {rd.root} is not running (no live supervisor)")
    if state == "starting":
        raise ControlError(
            f"the run in {rd.root} is still starting (warm-up or services): "
            "try again once its trainers run"
        )
    if state != "running":
        raise ControlError(f"the run in {rd.root} is not running (state {state!r})")
    return entry


def new_id() -> str:
    return f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(3)}"


def submit(rd: RunDir, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Makes a request of the running supervisor and waits for its answer."""
    entry = check_running(rd)
    rid = new_id()
    path = _requests(rd) / f"{rid}.json"
    write_atomic(path, {"id": rid, **request})
    answer = _answers(rd) / f"{rid}.json"
    deadline = time.monotonic() + timeout_s
    while True:
        if answer.is_file():
            data = json.loads(answer.read_text())
            answer.unlink(missing_ok=True)
            return data
        if not pid_alive(int(entry["pid"])):
            path.unlink(missing_ok=True)
            raise ControlError(f"the run in {rd.root} ended before answering")
        if time.monotonic() > deadline:
            try:
                path.unlink()
            except FileNotFoundError:
                raise ControlError(
                    f"the run took the request but did not answer within {timeout_s:g}s: "
                    f"see {rd.run_json} and {rd.log('supervisor')}"
                ) from None
            raise ControlError(
                f"the run did not take the request within {timeout_s:g}s (withdrawn)"
            )
        time.sleep(0.1)


def take_requests(rd: RunDir) -> list[dict[str, Any]]:
    """The requests waiting, oldest first, each deleted as it is taken. One that is not a JSON
    object comes back as {"id": ..., "error": ...} so that it is answered too."""
    folder = _requests(rd)
    if not folder.is_dir():
        return []
    taken = []
    for path in sorted(folder.glob("*.json")):
        try:
            text = path.read_text()
            path.unlink()
        except FileNotFoundError:  # withdrawn by a CLI that gave up
            continue
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            data = {"error": f"unreadable request: {exc}"}
        data["id"] = path.stem
        taken.append(data)
    return taken


def answer(rd: RunDir, rid: str, data: dict[str, Any]) -> None:
    write_atomic(_answers(rd) / f"{rid}.json", data)


def clear(rd: RunDir) -> None:
    """Drops requests and answers left from an earlier invocation of the run."""
    for folder in (_requests(rd), _answers(rd)):
        if folder.is_dir():
            for path in folder.iterdir():
                with contextlib.suppress(OSError):
                    path.unlink()
