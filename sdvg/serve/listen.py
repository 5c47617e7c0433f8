"""The listening socket, bound before any model loads: `sdvg serve` fails on a taken or foreign address at
once (exit 2) and knows the real port of `--port 0`. It is bound, not listening: uvicorn listens on it once
the app is built, so until then a client's connection is refused, never left waiting. Standard library only
(the CLI checks the address before it imports the serve extra)."""
from __future__ import annotations

import socket


class PortError(ValueError):
    """The address cannot be bound (taken, not this machine's, not allowed); the message names the fix."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens on it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds (TIME_WAIT is no obstacle)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        raise PortError(f"--host {host} --port {port}: cannot listen there ({why}); choose another --port "
                        "(0: any free port) or stop what holds it") from None
    sock.set_inheritable(True)
    return sock


def bound_url(sock: socket.socket) -> str:
    """The page's URL on the bound socket (its real port: `--port 0` picks one)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
