"""A token bucket that caps one stream's bytes per second, for thin links.

Sends may overdraw the bucket (a chunk larger than the burst still goes) and
the sender then sleeps off the debt, so the long-run rate equals the cap
whatever the chunk size. Knows nothing of gRPC or weights.
"""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """`await take(n)` before sending n bytes."""

    def __init__(self, bytes_per_second: float, burst_bytes: float | None = None) -> None:
        if bytes_per_second <= 0:
            raise ValueError("bytes_per_second must be positive")
        self.rate = float(bytes_per_second)
        self.burst = float(burst_bytes if burst_bytes is not None else self.rate / 10)
        self.tokens = self.burst
        self._last = time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self._last) * self.rate)
        self._last = now
        self.tokens -= n
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)
