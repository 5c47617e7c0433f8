"""uvicorn, with a shutdown that drains first: on SIGTERM / SIGINT the block in progress ends,
every session's MP4 is finished, each socket gets `{"status": "completed"}` and is closed (1001),
and only then does uvicorn close connections."""
from __future__ import annotations

import uvicorn


class DrainingServer(uvicorn.Server):
    async def shutdown(self, sockets=None) -> None:
        await self.config.app.state.drain()
        await super().shutdown(sockets)


def uvicorn_config(app, cfg, log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, ws="websockets-sansio",
                          ws_max_size=cfg.max_message_bytes, ws_ping_interval=20.0, ws_ping_timeout=20.0,
                          timeout_graceful_shutdown=cfg.drain_timeout_s, lifespan="on")


def serve(app, cfg, log_level: str = "warning") -> None:
    DrainingServer(uvicorn_config(app, cfg, log_level)).run()
