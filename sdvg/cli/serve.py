"""`sdvg serve`: the realtime websocket server (its flags and run live in `sdvg.serve.cli`; docs/server.md)."""
from __future__ import annotations


def add_parser(sub, config: dict | None) -> None:
    from sdvg.serve.cli import add_serve_parser

    add_serve_parser(sub).set_defaults(func=run)


def run(args, load_pipeline) -> int:
    from sdvg.serve.cli import run_serve

    return run_serve(args, load_pipeline)
