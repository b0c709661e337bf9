"""The HTTP server around the app: uvicorn with the limits that keep it answering whatever its clients do.
At most `max_connections` connections are open at once, and a request's head (request line and headers)
must arrive within `header_timeout` seconds; the body's own time limit is the app's (app.BodyLimit, where
a 408 can be answered). No model loading and no app here (app.py, serve.py).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from starlette.types import ASGIApp

MAX_CONNECTIONS = 1000
HEADER_TIMEOUT = 10.0  # seconds
KEEP_ALIVE = 5  # seconds an idle keep-alive connection stays open (uvicorn's default)
# The listen queue, and so the most connections asyncio accepts in one turn of its loop, before
# GuardedH11Protocol can refuse any: the file descriptors above MAX_CONNECTIONS that a burst can take.
BACKLOG = 128


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold. A connection beyond `max_connections` gets 503 and is closed at once;
    one whose request head is not whole `header_timeout` seconds after the connection opened or the
    previous response ended is closed; an idle keep-alive connection is closed after `keep_alive`
    seconds. A head is also at most 16 KiB (h11's default)."""

    max_connections: int = MAX_CONNECTIONS
    header_timeout: float = HEADER_TIMEOUT
    keep_alive: int = KEEP_ALIVE

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if not self.header_timeout > 0 or not self.keep_alive > 0:
            raise ValueError(f"timeouts must be above 0 seconds, got {self.header_timeout} and {self.keep_alive}")


def _refusal(limit: int) -> bytes:
    body = json.dumps({"error": f"the server has its most connections open ({limit}): try again shortly"}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the two guards uvicorn lacks. uvicorn times out only a keep-alive
    connection that is idle after a response, so a client that sends half a request head (or nothing)
    holds its connection, and a file descriptor, for ever; and its `limit_concurrency` counts
    connections only when a request head is whole, so such connections escape it too, until the
    process runs out of file descriptors and accepts no one. Here the head has a deadline, and a
    connection beyond the limit gets 503 as it is accepted, before it could send anything, and is closed."""

    limits: ClassVar[ServerLimits] = ServerLimits()
    _head_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(_refusal(self.limits.max_connections))
            transport.close()
            return
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

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


def make_room_for_connections(connections: int) -> int:
    """Raise this process's soft limit on open files so that `connections` fit beside the model's own
    files (macOS starts processes at 256, many Linux sessions at 1,024): a server out of file
    descriptors accepts no one, and a limit on connections above it protects nothing. Returns the
    connections that fit. For the script that owns the process (serve.py), as runtime.set_threads."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return connections
    spare = 64 + 2 * BACKLOG  # the model, its libraries and the log; a burst of connections being refused
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < connections + spare:
        wanted = connections + spare if hard == resource.RLIM_INFINITY else min(connections + spare, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # e.g. macOS refuses more than its kern.maxfilesperproc
            pass
    if soft == resource.RLIM_INFINITY:
        return connections
    return max(1, min(connections, max(soft - spare, soft // 4)))


def build_server(app: ASGIApp, limits: ServerLimits = ServerLimits(), log_level: str | None = None) -> uvicorn.Server:
    """uvicorn serving `app` under `limits`; start it with `server.run(sockets=[listen(host, port)])`.
    uvicorn's `limit_concurrency` is left unset: it answers 503 to a request that arrives while that many
    connections are open, the requesting one included, which GuardedH11Protocol's cap already keeps from
    happening, and it never stops a connection from being accepted."""
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
    config = uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.keep_alive, backlog=BACKLOG,
                            log_level=log_level)
    return uvicorn.Server(config)


__all__ = ["MAX_CONNECTIONS", "HEADER_TIMEOUT", "KEEP_ALIVE", "BACKLOG", "ServerLimits", "GuardedH11Protocol", "listen",
           "make_room_for_connections", "build_server"]
