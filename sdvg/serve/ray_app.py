"""The same app as a Ray Serve deployment (the `serve-ray` extra): one replica per GPU pair, each with
its own pipeline (models loaded once per replica) and its own generation worker. Ray's HTTP proxy
routes each request to a replica; a websocket is one ASGI call, so it stays pinned to the replica
that accepted it for its whole life (its session, its MP4 and its `GET /download_video/{id}` live
there; see docs/server.md, "Ray Serve")."""
from __future__ import annotations

import argparse

from sdvg.serve.config import ServeConfig


def deployment(args: argparse.Namespace, cfg: ServeConfig, defaults, replicas: int, gpus_per_replica: float,
               max_ongoing_requests: int | None = None, *, load_pipeline):
    """A bound Ray Serve application: `replicas` copies of `create_app(load_pipeline(args), cfg, defaults)`
    (`load_pipeline`: a module-level function, pickled by name to each replica; the CLI passes its own).
    `max_ongoing_requests` (per replica; default: its sessions + queue + 8 for HTTP) is what makes Ray
    send the next socket to another replica."""
    from ray import serve

    ongoing = max_ongoing_requests or cfg.max_sessions + cfg.max_queue + 8

    @serve.deployment(name="sdvg", num_replicas=replicas, max_ongoing_requests=ongoing,
                      ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": 1})
    @serve.ingress()
    class SdvgServe:
        def __init__(self, args, cfg, defaults, load_pipeline):
            self.pipe = load_pipeline(args)  # each replica loads its own models once
            self.cfg, self.defaults = cfg, defaults

        def __serve_build_asgi_app__(self):
            from sdvg.serve.app import create_app

            return create_app(self.pipe, self.cfg, self.defaults)

    return SdvgServe.bind(args, cfg, defaults, load_pipeline)


def run(args: argparse.Namespace, cfg: ServeConfig, defaults, load_pipeline) -> int:
    """`sdvg serve --ray-replicas N`: a local Ray instance, Ray's proxy on --host/--port."""
    import time

    import ray
    from ray import serve

    ray.init(include_dashboard=False)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(deployment(args, cfg, defaults, args.ray_replicas, args.ray_gpus_per_replica,
                         load_pipeline=load_pipeline), name="sdvg",
              route_prefix="/")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
        ray.shutdown()
        raise
