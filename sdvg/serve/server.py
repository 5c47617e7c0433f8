"""uvicorn, with a shutdown that drains first: on SIGTERM / SIGINT the block in progress ends,
every session's MP4 is finished, each socket gets `{"status": "completed"}` and is closed (1001),
and only then does uvicorn close connections.

`serve` takes the socket `sdvg.serve.listen.bind_socket` bound before any model loaded."""
from __future__ import annotations

import socket

import uvicorn


class DrainingServer(uvicorn.Server):
    async def shutdown(self, sockets=None) -> None:
        await self.config.app.state.drain()
        await super().shutdown(sockets)


def http_protocol(app, cfg) -> type:
    """uvicorn's HTTP protocol (httptools where installed, else h11: uvicorn's own choice) under the connection
    caps and header timeout (`connections.ConnectionGuard`), the total kept under the open-file limit raised now."""
    import importlib.util

    from sdvg.serve.connections import ConnectionGuard, fd_budget, guarded_protocol, raise_fd_limit

    if importlib.util.find_spec("httptools") is not None:  # uvicorn's `auto` picks it where installed
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    state = getattr(app, "state", None)  # sdvg's app keeps its metrics and the guard there
    metrics = getattr(state, "metrics", None)
    guard = ConnectionGuard(fd_budget(cfg.max_connections, raise_fd_limit()), cfg.max_connections_per_client,
                            cfg.header_timeout_s,
                            refused=None if metrics is None else metrics.count_refused)
    if state is not None:
        state.connections = guard
    return guarded_protocol(base, guard)


def uvicorn_config(app, cfg, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn's config, its logs with every `token=` value redacted (`access.TokenRedaction`)."""
    from sdvg.serve.access import redact_uvicorn_logs

    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, ws="websockets-sansio",
                            http=http_protocol(app, cfg),
                            ws_max_size=cfg.max_message_bytes, ws_ping_interval=20.0, ws_ping_timeout=20.0,
                            timeout_graceful_shutdown=cfg.drain_timeout_s, lifespan="on")
    redact_uvicorn_logs()  # after uvicorn configured its loggers
    return config


def serve(app, cfg, log_level: str = "warning", sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM / SIGINT, on `sock` (from `listen.bind_socket`; None: uvicorn binds cfg's address). A server
    that never started (its lifespan failed) raises RuntimeError."""
    server = DrainingServer(uvicorn_config(app, cfg, log_level))
    server.run(sockets=None if sock is None else [sock])
    if not server.started:
        raise RuntimeError("the server did not start (its log above says why)")
