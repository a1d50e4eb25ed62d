"""Trainers first: while a batch streams to a trainer, collection, ingest and dispatch wait.

The trainer is the scarce resource, so FetchBatch gets the event loop (and more of the CPU)
to itself while it serves a batch. `TrainerTurns` counts the batches being served; the
background loops call `after_trainers` before each slice of work, which waits at most
TRAINER_FIRST_MAX_S so a stream that never closes stalls nothing. Knows nothing of what the
loops do, nor of gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib

from astra.waits import wait_set

TRAINER_FIRST_MAX_S = 0.5


class TrainerTurn:
    """One hold that can be taken and given back more than once (a stream of batches)."""

    __slots__ = ("held", "turns")

    def __init__(self, turns: TrainerTurns) -> None:
        self.turns = turns
        self.held = False

    def hold(self) -> None:
        if not self.held:
            self.held = True
            self.turns.streaming += 1
            self.turns.idle.clear()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.turns.streaming -= 1
            if self.turns.streaming == 0:
                self.turns.idle.set()


class TrainerTurns:
    def __init__(self) -> None:
        self.idle = asyncio.Event()  # set while no batch is being streamed to a trainer
        self.idle.set()
        self.streaming = 0

    def turn(self) -> TrainerTurn:
        return TrainerTurn(self)

    @contextlib.asynccontextmanager
    async def first(self):
        """Held for the duration of the block."""
        turn = self.turn()
        turn.hold()
        try:
            yield
        finally:
            turn.release()

    async def after_trainers(self) -> None:
        """Waits while a batch is being served (at most TRAINER_FIRST_MAX_S)."""
        if not self.idle.is_set():
            await wait_set(self.idle, TRAINER_FIRST_MAX_S)
