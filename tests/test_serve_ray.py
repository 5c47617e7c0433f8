"""The Ray Serve deployment (the serve-ray extra) on CPU: a local Ray instance, two replicas of tiny,
two websocket sessions through Ray's proxy, each pinned to its own replica."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
ray = pytest.importorskip("ray", reason="the serve-ray extra (ray[serve]) is not installed")
pytest.importorskip("ray.serve")

from serve_harness import free_port, run_session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_sessions_on_two_replicas(tmp_path):
    from ray import serve

    from sdvg.cli import build_parser, build_pipeline
    from sdvg.options import GenerationOptions
    from sdvg.serve.config import ServeConfig
    from sdvg.serve.ray_app import deployment

    port = free_port()
    args = build_parser().parse_args(["serve", "--preset", "tiny", "--quiet"])
    cfg = ServeConfig(port=port, max_sessions=1, max_queue=0, video_dir=None)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # one socket per replica at a time: the second session must go to the other replica
        serve.run(deployment(args, cfg, GenerationOptions(), replicas=2, gpus_per_replica=0,
                             max_ongoing_requests=1, load_pipeline=build_pipeline), name="sdvg", route_prefix="/")

        async def both():
            params = {"prompt": "a fox", "num_blocks": 1, "seed": 3}
            ready, both_ready = [], asyncio.Event()

            async def after_ready():  # both sockets held before either generates: neither can end first
                ready.append(1)
                if len(ready) == 2:
                    both_ready.set()
                await asyncio.wait_for(both_ready.wait(), 120)

            return await asyncio.gather(*(run_session(f"127.0.0.1:{port}", params, fmt="raw", superset=True,
                                                      session_id=sid, after_ready=after_ready)
                                          for sid in ("ray-a", "ray-b")))

        a, b = asyncio.run(both())
    finally:
        serve.shutdown()
        ray.shutdown()
    for out in (a, b):
        assert out["texts"][-1]["status"] == "completed" and len(out["frames"]) == 9
    assert a["ready"]["replica"] != b["ready"]["replica"]  # two replicas, each socket pinned to one
    assert (a["frames"][0] == b["frames"][0]).all()  # same weights seed, same parameters: the same video
