"""Bytes at rest found damaged: the one error every service reports them with.

A service that finds its own durable state damaged at start-up (Dataflow's
database or blob log, a trainer's checkpoints) raises `Damaged`; its command
line prints `str(exc)`, one line naming the file, what is wrong and what to
do, and exits with EXIT_DAMAGED instead of a traceback. `astra doctor`
reports the same findings offline. Never imports gRPC.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

EXIT_DAMAGED = 65  # EX_DATAERR: restarting does not help; a person has to act


class Damaged(Exception):
    """`path`: the damaged file or directory; `what`: what is wrong; `fix`: what to do."""

    def __init__(self, path: str | os.PathLike[str], what: str, fix: str) -> None:
        self.path, self.what, self.fix = str(path), what, fix
        super().__init__(f"{self.path}: {what}; {fix}")

    def line(self, service: str) -> str:
        """The one line a command prints before it exits with EXIT_DAMAGED."""
        return f"{service}: damaged state: {self}".replace("\n", " ")


@contextlib.contextmanager
def exit_if_damaged(service: str) -> Iterator[None]:
    """Damaged state at start-up: one line on stderr and EXIT_DAMAGED, not a traceback."""
    try:
        yield
    except Damaged as exc:
        print(exc.line(service), file=sys.stderr, flush=True)
        sys.exit(EXIT_DAMAGED)
