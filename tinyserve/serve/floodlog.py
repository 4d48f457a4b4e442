"""Log floods: one line for a burst of the same trouble, not one line per connection.

When the process runs out of file descriptors, asyncio's accept loop (Python 3.11) logs
"socket.accept() out of system resource", with a traceback, on each of its 2,048 tries a round
(one per slot of uvicorn's listen backlog), schedules a retry for each, and goes again a second
later: a flood of idle connections once wrote 264k lines (107 MB) in 15 s while nobody could
connect. When the server shuts down, every retry still pending fails with a traceback of its own
("Exception in callback ..._start_serving"). uvicorn, too, warns once per request refused past
the connection limit and once per malformed request, so a hostile client chooses how much the
server logs.

``FloodFilter`` lets the first record of each such kind through, then at most one per
``window_s``, which says how many it held back. Every other record passes untouched.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable

# What accept() fails with when the process or the machine is out of descriptors or memory.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# uvicorn's warnings that a client triggers at will, one per request.
PER_REQUEST_WARNINGS = frozenset({"Exceeded concurrency limit.", "Invalid HTTP request received."})
# The loggers those records come from: asyncio's accept loop and uvicorn's protocol.
FLOOD_LOGGERS = ("asyncio", "uvicorn.error")


def flood_kind(record: logging.LogRecord) -> tuple | None:
    """What kind of flood ``record`` belongs to, or None for an ordinary record."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
        return record.name, exc.errno
    if record.msg in PER_REQUEST_WARNINGS:
        return record.name, record.msg
    if record.name == "asyncio" and "._start_serving(" in record.getMessage():  # the retries accept() left
        return record.name, "_start_serving"
    return None


class FloodFilter(logging.Filter):
    """Pass the first record of each flood kind, then one per ``window_s`` with a count of the rest."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s, self.clock = window_s, clock
        self._last: dict[tuple, float] = {}  # when each kind was last let through
        self._held: dict[tuple, int] = {}  # how many of each kind were held back since
        self._lock = threading.Lock()  # the engine's threads log too

    def filter(self, record: logging.LogRecord) -> bool:
        kind = flood_kind(record)
        if kind is None:
            return True
        now = self.clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.window_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return False
            self._last[kind] = now
            held = self._held.pop(kind, 0)
        if held:
            record.msg = f"{record.getMessage()}\n({held} more like this in the last {self.window_s:g} s not logged)"
            record.args = ()
        return True


def install(window_s: float = 10.0) -> None:
    """Put a ``FloodFilter`` on the loggers that floods come from (once; calling again does nothing)."""
    for name in FLOOD_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, FloodFilter) for f in logger.filters):
            logger.addFilter(FloodFilter(window_s))
