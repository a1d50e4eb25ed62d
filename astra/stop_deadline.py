"""A stop that cannot hang: a process told to stop is gone within a deadline.

Under `astra run` a child that does not stop is SIGKILLed once supervision.stop_grace_s
runs out. When the supervisor itself died, its children get SIGTERM from the kernel
(astra.parent_death) and nobody is left to SIGKILL them: a process stuck in its stop would
keep its port, its state lock and its GPU until someone noticed. `arm(deadline_s, what)`,
called when the stop begins, starts a daemon thread; if the process is still there after
`deadline_s` it writes one CRITICAL line naming `what` and every thread's stack to stderr,
then exits with EXIT_STOP_HUNG at once, running no more Python clean-up. Nothing is lost by
that: every service keeps what it acknowledged durable and recovers from kill -9.

The line is written with the root handler's formatter (text or JSON, astra.logs) straight
to the stderr descriptor, not through `logging`, whose lock the hung thread may hold.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading

EXIT_STOP_HUNG = 70  # EX_SOFTWARE: the process's own stop failed
STOP_DEADLINE_S = 60.0  # past a service's drain period (its grace), for its own clean-up

log = logging.getLogger(__name__)


def arm(deadline_s: float, what: str) -> threading.Timer:
    """Ends the process `deadline_s` from now unless it has exited; returns the timer
    (`cancel()` disarms it)."""

    def expire() -> None:
        msg = (
            f"{what}: the stop did not finish within {deadline_s:.0f}s; exiting "
            f"({EXIT_STOP_HUNG}) with every thread's stack below"
        )
        _write_line(msg)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(EXIT_STOP_HUNG)

    timer = threading.Timer(deadline_s, expire)
    timer.name, timer.daemon = "stop-deadline", True
    timer.start()
    return timer


def _write_line(msg: str) -> None:
    record = log.makeRecord(log.name, logging.CRITICAL, __file__, 0, msg, (), None)
    handlers = logging.getLogger().handlers
    fmt = handlers[0].formatter if handlers and handlers[0].formatter else logging.Formatter()
    with contextlib.suppress(Exception):
        os.write(sys.stderr.fileno(), (fmt.format(record) + "\n").encode())
