"""Connections below HTTP: how many are open, from whom, and for how long one may stay silent.

- **Caps on new connections**: at most `max_connections` open at once, and `max_per_client` from one client
  address. A connection past a cap is answered `503` (`Retry-After: 1`) and closed as it arrives; one already
  admitted is never cut for another (a running session keeps its socket). The total is also kept under the
  process's open-file limit (`fd_budget`), so a flood cannot starve the server of descriptors.
- **Header timeout**: a connection must complete its first request's headers within `header_timeout_s` (a silent
  or slow-header client is closed); after that uvicorn's keep-alive timeout and the app's own timeouts apply.
  A websocket upgrade has left HTTP by then and is not touched.
- **Cutting a connection** (`ConnectionGuard.abort`): the app's way to drop a websocket whose client stopped
  reading (`sdvg.serve.connection`), which a close could not end: its close frame would wait behind the unsent bytes.
- **The open-file limit** is raised to its hard limit at start (`raise_fd_limit`).
- **Accept failures and other event-loop errors** are logged once per interval with a count of the ones left
  out (`ThrottledLoopErrors`), not once per connection.

`guarded_protocol(base, guard)` is uvicorn's HTTP protocol class (h11 or httptools) with these rules; the
server passes it as uvicorn's `http=`."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

LOG = logging.getLogger("sdvg.serve")
FD_RESERVE = 64  # descriptors kept for the server itself (model files, the MP4 writers' pipes, uploads, logs)
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: text/plain\r\nContent-Length: 36\r\n"
           b"Connection: close\r\n\r\ntoo many connections; retry shortly\n")


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one; the soft limit now in force (0 where unknown)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return 0 if soft == resource.RLIM_INFINITY else int(soft)


def fd_budget(max_connections: int, nofile: int) -> int:
    """Connections allowed at once: `max_connections`, lowered to leave FD_RESERVE descriptors of `nofile` (the
    open-file limit; 0: unknown) to the server, at least 8."""
    if nofile <= 0:
        return max_connections
    return max(8, min(max_connections, nofile - FD_RESERVE))


class ConnectionGuard:
    """Open connections in all and per client address (their transports, pruned once closed). `refused(reason)`
    counts each refusal: 'connections', 'client_connections' or 'header_timeout'."""

    def __init__(self, max_connections: int, max_per_client: int, header_timeout_s: float,
                 refused: Callable[[str], None] | None = None, clock=time.monotonic):
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.header_timeout_s = header_timeout_s
        self.refused = refused or (lambda reason: None)
        self.open: dict[object, str] = {}  # transport -> client address
        self.log = RateLimitedLog(LOG, 10.0, clock)

    def admit(self, transport, client: str) -> str | None:
        """None when `transport` may stay (it is counted), else why it may not."""
        self.open = {t: c for t, c in self.open.items() if not t.is_closing()}
        if len(self.open) >= self.max_connections:
            why = "connections"
        elif sum(c == client for c in self.open.values()) >= self.max_per_client:
            why = "client_connections"
        else:
            self.open[transport] = client
            return None
        self.refused(why)
        self.log.warning(why, "sdvg serve: refused a connection from %s: %d open (at most %d in all, %d per client; "
                         "--max-connections, --max-connections-per-client)", client, len(self.open),
                         self.max_connections, self.max_per_client)
        return why

    def abort(self, peer: tuple) -> bool:
        """Cut the open connection from `peer` ((host, port), the ASGI scope's `client`) at once, its unsent bytes
        dropped: a client that stopped reading, whose close would wait behind them for ever. False when none is open
        from there."""
        for transport in self.open:
            name = transport.get_extra_info("peername")
            if isinstance(name, (tuple, list)) and tuple(name[:2]) == tuple(peer[:2]):
                transport.abort()
                return True
        return False


class RateLimitedLog:
    """Log one line per key and interval; the lines left out are counted into the next one."""

    def __init__(self, logger: logging.Logger, interval_s: float, clock=time.monotonic):
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self.last: dict[str, float] = {}
        self.skipped: dict[str, int] = {}

    def warning(self, key: str, message: str, *args, exc_info=None) -> bool:
        now = self.clock()
        if key in self.last and now - self.last[key] < self.interval_s:
            self.skipped[key] = self.skipped.get(key, 0) + 1
            return False
        self.last[key] = now
        skipped = self.skipped.pop(key, 0)
        if skipped:
            message += f" ({skipped} more like it in the last {self.interval_s:g} s not logged)"
        self.logger.warning(message, *args, exc_info=exc_info)
        return True


class ThrottledLoopErrors:
    """An event-loop exception handler: each kind of error (its message and exception type; e.g. asyncio's
    'socket.accept() out of system resource') logged once per interval with its traceback, the rest counted."""

    def __init__(self, interval_s: float = 10.0, clock=time.monotonic):
        self.log = RateLimitedLog(logging.getLogger("sdvg.serve.loop"), interval_s, clock)

    def __call__(self, loop, context: dict) -> None:
        exc = context.get("exception")
        key = f"{context.get('message', '')}|{type(exc).__name__ if exc else ''}"
        self.log.warning(key, "%s", context.get("message", "event loop error"),
                         exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)


def guarded_protocol(base: type, guard: ConnectionGuard) -> type:
    """uvicorn's HTTP protocol class `base` with the guard's caps and header timeout."""

    class GuardedProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
            if guard.admit(transport, client) is not None:
                try:
                    transport.write(REFUSAL)
                finally:
                    transport.close()
                return
            self._sdvg_header_timer = asyncio.get_running_loop().call_later(guard.header_timeout_s,
                                                                            self._sdvg_header_timeout)

        def _sdvg_header_timeout(self) -> None:
            # still this protocol's (not upgraded to a websocket), and no request's headers completed yet
            if self.cycle is None and self.transport.get_protocol() is self and not self.transport.is_closing():
                guard.refused("header_timeout")
                guard.log.warning("header_timeout", "sdvg serve: closed a connection that sent no complete request "
                                  "within %g s (--header-timeout)", guard.header_timeout_s)
                self.transport.close()

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_sdvg_header_timer", None)
            if timer is not None:
                timer.cancel()
            super().connection_lost(exc)

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol
