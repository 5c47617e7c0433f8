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


def uvicorn_config(app, cfg, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn's config, its logs with every `token=` value redacted (`access.TokenRedaction`)."""
    from sdvg.serve.access import redact_uvicorn_logs

    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, ws="websockets-sansio",
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
