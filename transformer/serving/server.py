"""The HTTP server around the app: uvicorn with the limits that keep it answering whatever its clients do.
At most `max_connections` connections are open at once, sized at start-up to the open files the process
may still open (`limits_for_open_files`); a request's head (request line and headers) must arrive within
`header_timeout` seconds; the body's own time limit is the app's (app.BodyLimit, where a 408 can be
answered); and when the server is full, a client silent for `yield_after` seconds gives its place to a
new one. No model loading and no app here (app.py, serve.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from starlette.types import ASGIApp

from transformer.errors import UserError

MAX_CONNECTIONS = 1000
HEADER_TIMEOUT = 10.0  # seconds
KEEP_ALIVE = 5  # seconds an idle keep-alive connection stays open (uvicorn's default)
# The listen queue, and so the most connections asyncio accepts in one turn of its loop, before
# GuardedH11Protocol can refuse any: the file descriptors above MAX_CONNECTIONS that a burst can take.
BACKLOG = 128
# Turns of asyncio's loop whose accepted connections can all be open before the first of them is refused
# and closed: accepting, making its transport and closing it each take a turn, while the next turn
# accepts a queue's worth again.
BURST_TURNS = 3
# Seconds a client that sends nothing keeps its connection when the server is full and another arrives:
# under a flood of stalled requests, new clients still get in.
YIELD_AFTER = 1.0
# Files kept free beside the connections: what the app and its libraries still open while it serves.
SPARE_FILES = 64
# Seconds a stopping server still waits for its connections to finish before it cancels their tasks: the
# app has answered what it held by then (build_server's on_stop), so only a client still sending lingers.
STOP_GRACE = 1.0


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold. A connection beyond `max_connections` takes the place of the one
    whose client has sent nothing for longest, at least `yield_after` seconds, while the server waits
    for its request (its head, or its body, which then gets 408), or else gets 503 and is closed at
    once; one whose request head is not whole `header_timeout` seconds after the connection opened or
    the previous response ended is closed; an idle keep-alive connection is closed after `keep_alive`
    seconds. A head is also at most 16 KiB (h11's default). `backlog`: the listen queue.
    `open_files`: the process's limit on open files these were sized to, None where there is none."""

    max_connections: int = MAX_CONNECTIONS
    header_timeout: float = HEADER_TIMEOUT
    keep_alive: int = KEEP_ALIVE
    yield_after: float = YIELD_AFTER
    backlog: int = BACKLOG
    open_files: int | None = None

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.backlog < 1:
            raise ValueError(f"max_connections and backlog must be at least 1, got {self.max_connections} and "
                             f"{self.backlog}")
        if not self.header_timeout > 0 or not self.keep_alive > 0:
            raise ValueError(f"timeouts must be above 0 seconds, got {self.header_timeout} and {self.keep_alive}")
        if not self.yield_after >= 0:
            raise ValueError(f"yield_after must be 0 seconds or more, got {self.yield_after}")


def _answer(status: bytes, error: str) -> bytes:
    """A whole HTTP response with the app's JSON error body, written below h11 just before a close."""
    body = json.dumps({"error": error}).encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, len(body), body))


def _refusal(limit: int) -> bytes:
    return _answer(b"503 Service Unavailable", f"the server has its most connections open ({limit}): try again shortly")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the two guards uvicorn lacks. uvicorn times out only a keep-alive
    connection that is idle after a response, so a client that sends half a request head (or nothing)
    holds its connection, and a file descriptor, for ever; and its `limit_concurrency` counts
    connections only when a request head is whole, so such connections escape it too, until the
    process runs out of file descriptors and accepts no one. Here the head has a deadline, and a
    connection beyond the limit takes the place of a silent client's, or else gets 503 as it is
    accepted, before it could send anything, and is closed."""

    limits: ClassVar[ServerLimits] = ServerLimits()
    _head_timer = None
    _last_heard = 0.0  # the loop's time when the client last sent something (or connected)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._last_heard = self.loop.time()
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            transport.write(_refusal(self.limits.max_connections))
            transport.close()
            return
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        self._last_heard = self.loop.time()
        super().data_received(data)
        self._watch_head()

    def _waits_for_client(self) -> bool:
        """Whether the server waits for this client's request (its head, or the rest of its body) and has
        begun no answer: closing it then loses nothing the server did."""
        return (not self.transport.is_closing() and self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
                and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and not self.flow.read_paused)

    def _make_room(self) -> bool:
        """Close the connection whose client has been silent longest, if at least `yield_after` seconds,
        while the server waits for it: a flood of stalled requests then cannot keep new clients out
        until its deadlines pass. False when none qualifies."""
        silent_since = self.loop.time() - self.limits.yield_after
        waiting = [other for other in self.connections if isinstance(other, GuardedH11Protocol) and other is not self
                   and other._last_heard <= silent_since and other._waits_for_client()]
        if not waiting:
            return False
        min(waiting, key=lambda other: other._last_heard)._give_way()
        return True

    def _give_way(self) -> None:
        if self.conn.their_state is h11.SEND_BODY:  # a request in progress gets an answer; half a head gets none
            self.transport.write(_answer(b"408 Request Timeout", "the request body stalled while the server was full "
                                                                 "and another client was waiting: send it again"))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """The head's deadline runs while the connection waits for a request head (h11: the client is
        IDLE), from the moment it started waiting; it stops once the head is whole."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)
        elif not waiting:
            self._stop_head_timer()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def listen(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """A TCP socket listening on `host`:`port` (0: a free port), as uvicorn would open it; OSError when
    it cannot (e.g. EADDRINUSE). Opened before the model loads, so that a port in use costs no wait."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait for TIME_WAIT
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def open_descriptors() -> int | None:
    """How many files this process has open, where the system lists them (Linux, macOS); else None."""
    for listing in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(listing)) - 1  # the listing's own descriptor
        except OSError:
            continue
    return None


def limits_for_open_files(connections: int = MAX_CONNECTIONS) -> ServerLimits:
    """The limits that fit this process's open-file limit, found now, after the model loaded: the soft
    limit is first raised towards what `connections` need (up to the hard limit; macOS starts processes
    at 256, many Linux sessions at 1,024), then the connections and the listen queue are sized to the
    files still free, so that a burst of connections never finds the process out of descriptors (it
    would accept no one, /health included). A UserError when too few are free for one connection. For
    the script that owns the process (serve.py), as runtime.set_threads."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return ServerLimits(max_connections=connections)
    in_use = open_descriptors()
    in_use = SPARE_FILES if in_use is None else in_use
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = in_use + SPARE_FILES + connections + BURST_TURNS * BACKLOG
    if soft != resource.RLIM_INFINITY and soft < needed:
        wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # e.g. macOS refuses more than its kern.maxfilesperproc
            pass
    if soft == resource.RLIM_INFINITY:
        return ServerLimits(max_connections=connections)
    free = soft - in_use - SPARE_FILES
    backlog = max(1, min(BACKLOG, free // (4 * BURST_TURNS)))
    fitting = min(connections, free - BURST_TURNS * backlog)
    if fitting < 1:
        raise UserError(f"the open-file limit ({soft}) leaves no room for connections beside the {in_use} files this "
                        f"server has open: raise it (ulimit -n {needed})")
    return ServerLimits(max_connections=fitting, backlog=backlog, open_files=soft)


def make_room_for_connections(connections: int) -> int:
    """How many of `connections` fit this process's open-file limit (raised towards them first); see
    `limits_for_open_files`."""
    return limits_for_open_files(connections).max_connections


class StoppingServer(uvicorn.Server):
    """uvicorn's server, stopping within about STOP_GRACE seconds when told to (Ctrl-C, SIGTERM, and the other
    `signals` given): uvicorn itself waits, without a bound by default, for every connection to finish its
    request, and a request being translated may hold one for minutes. `on_stop` runs first, so that the app
    answers what it still holds; connections then have STOP_GRACE seconds to close before their tasks are
    cancelled. Once stopped, the first signal is raised again for the caller's handler, as uvicorn does."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None] | None = None,
                 signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        super().__init__(config)
        self.on_stop, self.signals = on_stop, signals
        self._received: list[int] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, for `signals` (uvicorn's own are SIGINT and SIGTERM alone)."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {signum: signal.signal(signum, self._stop_signal) for signum in self.signals}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if self._received:
            signal.raise_signal(self._received[0])

    def _stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received.append(signum)
        self.handle_exit(signum, frame)  # uvicorn's: the first stops, a second Ctrl-C forces

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_stop is not None:
            self.on_stop()
        await super().shutdown(sockets)


def build_server(app: ASGIApp, limits: ServerLimits = ServerLimits(), log_level: str | None = None,
                 access_log: bool = True, on_stop: Callable[[], None] | None = None,
                 signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> uvicorn.Server:
    """uvicorn serving `app` under `limits`; start it with `server.run(sockets=[listen(host, port)])`.
    uvicorn's `limit_concurrency` is left unset: it answers 503 to a request that arrives while that many
    connections are open, the requesting one included, which GuardedH11Protocol's cap already keeps from
    happening, and it never stops a connection from being accepted. `access_log`: uvicorn's line per
    request, on standard output. `on_stop`: what the app does first when the server is told to stop by one
    of `signals` (StoppingServer)."""
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
    config = uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.keep_alive, backlog=limits.backlog,
                            log_level=log_level, access_log=access_log, timeout_graceful_shutdown=STOP_GRACE)
    return StoppingServer(config, on_stop, signals)


__all__ = ["MAX_CONNECTIONS", "HEADER_TIMEOUT", "KEEP_ALIVE", "BACKLOG", "YIELD_AFTER", "STOP_GRACE", "ServerLimits",
           "GuardedH11Protocol", "StoppingServer", "listen", "open_descriptors", "limits_for_open_files",
           "make_room_for_connections", "build_server"]
