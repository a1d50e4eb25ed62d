"""The error of a weight transfer that did not finish in time (gRPC DEADLINE_EXCEEDED).

A fetch or a LoadWeights that cannot complete must end within a bounded time
with this error, never wait on a silent peer forever. Never touches gRPC.
"""

from __future__ import annotations

from astra.errors import AstraError


class DeadlineExceeded(AstraError):
    code = "DEADLINE_EXCEEDED"
