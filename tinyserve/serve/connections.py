"""Connections: how long the server waits for a client, and uvicorn's settings in one place.

uvicorn closes a keep-alive connection left idle between requests (``timeout_keep_alive``) and
answers requests past ``limit_concurrency`` with a 503, but it never times out a connection that
sends nothing, half a request head, or a body nobody reads: enough of them use up the process's
file descriptors, and then no one else gets in. ``TimedH11Protocol``, uvicorn's h11 protocol with
two timers, closes them:

- a request head must be complete within ``header_timeout_s`` of the connection opening (or of
  its first byte after an idle keep-alive: between requests uvicorn's own timer runs). A trickle
  of bytes does not restart the clock.
- its body must then be complete within ``body_timeout_s``. A body the app is waiting for gets a
  408 from ``guard.Guard`` at that moment; this timer, a second later, closes the connection
  whatever happens, say when the app answered early and nobody reads the rest of the body.

Once the request is in, nothing here limits how long its answer takes to produce, but a third
timer bounds how long the client may leave it unread (``stall_timeout_s``). Every answer, a
plain one as much as a stream, goes into the transport's buffer, and whatever the kernel does
not take waits there. A client that reads nothing would keep that buffer, and its connection,
for ever: closing a transport waits for its buffer to drain, so even the keep-alive timer frees
nothing. So whenever bytes wait for the client (the answer is complete, or the buffer is past
its high-water mark), they are timed: a client that has taken less than ``STALL_PROGRESS_BYTES``
(or all that waits) within ``stall_timeout_s`` has its connection aborted, the buffer dropped,
and its slot freed. A stream's writes wait on the same buffer and have their own guard too
(``streaming.StallGuardedStream``, which aborts the request).

``uvicorn_options`` gives both the command line and ``app.ServerThread`` the same uvicorn
settings; ``fit_open_files`` makes room for ``max_connections`` under the process's open-file limit.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tinyserve.serve import floodlog
from tinyserve.serve.settings import ServerSettings

BODY_GRACE_S = 1.0  # so that the app's 408 for a late body goes out before this closes the connection
OPEN_FILES_HEADROOM = 64  # descriptors the process needs besides its connections: model files, logs, pipes
# What a client must take of a waiting answer in each stall timeout (or all of it, if less waits):
# asyncio's span between its high- and low-water marks, what a stream's blocked write needs.
STALL_PROGRESS_BYTES = 48 * 1024

log = logging.getLogger("tinyserve.serve")


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head or body is late, or
    whose client leaves its answer unread.

    It relies on uvicorn's ``data_received``, ``on_response_complete``, ``pause_writing``,
    ``resume_writing``, ``connection_lost``, ``conn`` (the h11 connection) and
    ``timeout_keep_alive_task``; tests/test_serve_guard.py and tests/test_serve_body_stall.py
    fail if an upgrade changes them."""

    header_timeout_s: float = ServerSettings.header_timeout_s
    body_timeout_s: float = ServerSettings.body_timeout_s
    stall_timeout_s: float = ServerSettings.stall_timeout_s

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "head" or "body": what the timer runs for
        self._stall_timer: asyncio.TimerHandle | None = None  # runs while answer bytes wait for the client
        self._stall_mark = 0  # bytes waiting when the stall timer started
        self._resumed = False  # the buffer fell below its low-water mark since then
        self._lost = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()
        self._watch_writes()  # the answer is all in the buffer: the client must now take it

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes()  # past the high-water mark: the client is behind

    def resume_writing(self) -> None:
        super().resume_writing()
        self._resumed = True

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._wait_for(None)
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Time whatever the connection now waits for from the client."""
        state = self.conn.their_state
        if self.transport.is_closing():
            waiting = None
        elif state is h11.IDLE:  # no request head yet; between requests, uvicorn's keep-alive timer runs
            waiting = None if self.timeout_keep_alive_task is not None else "head"
        elif state is h11.SEND_BODY:
            waiting = "body"
        else:  # the request is in (DONE), or the connection is closing
            waiting = None
        self._wait_for(waiting)

    def _wait_for(self, what: str | None) -> None:
        if what == self._waiting_for:
            return  # already timing it: more bytes of the same head or body do not restart the clock
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiting_for = what
        if what is not None:
            delay = self.header_timeout_s if what == "head" else self.body_timeout_s + BODY_GRACE_S
            self._timer = self.loop.call_later(delay, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.logger.debug("closing a connection whose request %s was late", self._waiting_for)
            self.transport.close()  # connection_lost tells a running app its client is gone

    def _watch_writes(self) -> None:
        """Time the client's reading, if answer bytes wait for it and no timer runs yet."""
        if self._stall_timer is None and not self._lost and self.transport.get_write_buffer_size() > 0:
            self._stall_mark, self._resumed = self.transport.get_write_buffer_size(), False
            self._stall_timer = self.loop.call_later(self.stall_timeout_s, self._stalled_or_not)

    def _stalled_or_not(self) -> None:
        self._stall_timer = None
        if self._lost:
            return
        left = self.transport.get_write_buffer_size()
        if left == 0:
            return  # all taken; the next pause or answer starts the timer again
        if self._resumed or self._stall_mark - left >= min(self._stall_mark, STALL_PROGRESS_BYTES):
            self._watch_writes()  # the client is reading: time the next stretch
            return
        log.warning("closed a connection whose client left %d bytes of its answer unread for %.0f s", left,
                    self.stall_timeout_s)
        # Not close(): that would wait for the buffer to drain, which is what never happens.
        self.transport.abort()  # connection_lost follows: the slot is freed, a running app sees a disconnect


def timed_protocol(settings: ServerSettings) -> type[TimedH11Protocol]:
    """``TimedH11Protocol`` with the timeouts of ``settings`` (uvicorn takes a class, not an instance)."""
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": settings.header_timeout_s,
                                                           "body_timeout_s": settings.body_timeout_s,
                                                           "stall_timeout_s": settings.stall_timeout_s})


def uvicorn_options(settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
                    log_level: str = "info") -> dict:
    """Keyword arguments for ``uvicorn.Config`` (or ``uvicorn.run``) that apply ``settings``.

    It also puts ``floodlog``'s filter on the loggers a flood of connections would fill."""
    floodlog.install()
    return {
        "host": host, "port": port, "log_level": log_level,
        "http": timed_protocol(settings),
        "ws": "none",  # nothing here speaks WebSocket; an upgraded connection would escape the timers
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        # uvicorn refuses a request once the open connections, its own included, reach the limit:
        # N would serve N - 1. One more lets N connections in, and the N + 1st gets the 503.
        "limit_concurrency": settings.max_connections + 1,
        # Ctrl-C waits this long for open requests, then cancels them; the engine loop then aborts
        # whatever is left. Without it uvicorn waits for every connection, forever.
        "timeout_graceful_shutdown": settings.shutdown_timeout_s,
        # uvicorn reads X-Forwarded-For from 127.0.0.1 unless told not to, so that any local
        # client could claim any address: only behind a proxy that sets it, and only when asked.
        "proxy_headers": settings.trust_forwarded_for,
    }


def fit_open_files(max_connections: int) -> str | None:
    """Raise the soft open-file limit so that ``max_connections`` fit (vLLM raises it too), as far
    as the hard limit allows; a warning to log when it does not."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + OPEN_FILES_HEADROOM
    if soft == resource.RLIM_INFINITY or soft >= want:
        return None
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        new = soft
    if new >= want:
        return None
    # Past the limit accept() fails, and nobody gets in until idle connections time out.
    return (f"the open-file limit ({new}) leaves room for about {max(new - OPEN_FILES_HEADROOM, 0)} connections, "
            f"fewer than --max-connections {max_connections}: raise `ulimit -n` or lower --max-connections")
