"""`sdvg serve`: the realtime websocket server's flags and run (docs/server.md; nothing heavy imported here)."""
from __future__ import annotations

import argparse
import sys

from sdvg.io import fps_type
from sdvg.serve.config import SESSION_SCHEDULERS, ServeConfig, check_port

_D = ServeConfig()


def port_number(text: str) -> int:
    """--port's type: an integer from 0 to 65535 (argparse refuses anything else: exit 2 before anything loads)."""
    try:
        return check_port(int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc) if text.strip().lstrip("-").isdigit() else
                                         f"{text!r} is not a port number (an integer from 0 to 65535)") from None


def add_parser(sub, config: dict | None) -> None:
    add_serve_parser(sub)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from sdvg.cli.args import add_generation_args

    p = subparsers.add_parser("serve", help="realtime websocket server speaking Krea Realtime Video's protocol, "
                                            "with a browser page (docs/server.md)")
    add_generation_args(p)  # generate's preset, model and device flags; the option flags are the server's defaults
    p.add_argument("--host", default=_D.host, help="address to bind (default: 127.0.0.1, loopback only; any "
                                                   "other needs --token)")
    p.add_argument("--port", type=port_number, default=_D.port,
                   help=f"TCP port, 0 to 65535, bound before any model loads (default: {_D.port}; 0: any free port, "
                        "the one bound is printed)")
    p.add_argument("--token", help="shared secret every HTTP request and websocket must carry (Authorization: "
                                   "Bearer T, ?token=T, or the cookie a browser gets from /?token=T); required beyond "
                                   "loopback. `ps` shows it: prefer --token-file or the SDVG_SERVE_TOKEN variable")
    p.add_argument("--token-file", metavar="FILE", help="read the token from this file's first line (at most 4 KiB)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page's origin (scheme://host[:port]) allowed to call this server from another origin; "
                        "repeat for more (default: none, same origin only)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name clients reach this server by, beyond its bind address (e.g. gpu1.example.com; "
                        ".example.com for a domain and its subdomains; '*' only behind a proxy that checks Host); "
                        "repeat for more. Requests naming any other Host get 400 (DNS rebinding)")
    p.add_argument("--static-dir", metavar="DIR", help="serve your own page at / instead of sdvg's: DIR/index.html "
                                                       "(e.g. Krea's release_demo.html) and the files beside it, "
                                                       "read-only, no dotfiles, no listing")
    p.add_argument("--max-sessions", type=int, default=_D.max_sessions,
                   help=f"generations at once, interleaved block by block (default: {_D.max_sessions})")
    p.add_argument("--no-batch-decode", dest="batch_decode", action="store_false",
                   help="with --session-scheduler batched: decode each session's blocks alone, so that every "
                        "session's video is bitwise its own (batched decodes differ by at most one uint8 level; "
                        "slower where the VAE dominates)")
    p.add_argument("--min-session-fps", type=float, default=_D.min_session_fps,
                   help="admit a session only while the measured cost of the worker's rounds says every admitted "
                        "session keeps this many frames/s; a session that would not fit waits in the queue (told "
                        "why), the first always runs (default: 0, admit by --max-sessions only)")
    p.add_argument("--session-scheduler", choices=SESSION_SCHEDULERS, default=_D.session_scheduler,
                   help="how the worker runs the sessions: 'batched' makes the next block of every runnable session "
                        "in one round, their denoising, commits and scoring batched (each video bitwise its own); "
                        f"'round_robin' one session's block at a time (default: {_D.session_scheduler})")
    p.add_argument("--max-queue", type=int, default=_D.max_queue,
                   help=f"sessions that wait for a slot, told their position; more get `busy` "
                        f"(default: {_D.max_queue})")
    p.add_argument("--idle-timeout", type=float, default=_D.idle_timeout_s,
                   help=f"seconds a socket may stay silent while nothing generates (default: {_D.idle_timeout_s:g})")
    p.add_argument("--first-message-timeout", type=float, default=_D.first_message_timeout_s,
                   help="seconds from a socket's opening to its parameters; messages refused meanwhile do not extend "
                        f"it (default: {_D.first_message_timeout_s:g})")
    p.add_argument("--header-timeout", type=float, default=_D.header_timeout_s,
                   help="seconds a new connection has to send its first request's headers; a silent or slow one is "
                        f"closed (default: {_D.header_timeout_s:g})")
    p.add_argument("--max-connections", type=int, default=_D.max_connections,
                   help="connections open at once, kept under the open-file limit; one more gets 503 and is closed, "
                        f"none already open is cut (default: {_D.max_connections})")
    p.add_argument("--max-connections-per-client", type=int, default=_D.max_connections_per_client,
                   help="connections open at once from one client address (behind a proxy every client has its "
                        f"address: raise it) (default: {_D.max_connections_per_client})")
    p.add_argument("--upload-min-rate", type=int, default=_D.upload_min_bytes_per_s, metavar="BYTES_PER_S",
                   help="an upload body's least average rate once 10 s have passed; slower gets 408 "
                        f"(default: {_D.upload_min_bytes_per_s})")
    p.add_argument("--upload-deadline", type=float, default=_D.upload_deadline_s,
                   help=f"seconds an upload body may take in all (default: {_D.upload_deadline_s:g})")
    p.add_argument("--max-pause-s", type=float, default=_D.max_pause_s,
                   help="seconds a paused run keeps its slot (pings do not extend it); then the run ends with "
                        f"`completed` and the next session starts (default: {_D.max_pause_s:g})")
    p.add_argument("--max-refused-messages", type=int, default=_D.flood_close_after,
                   help="messages refused on one socket, of any kind, before it is closed with 1008 "
                        f"(default: {_D.flood_close_after})")
    p.add_argument("--send-buffer-frames", type=int, default=_D.send_buffer_frames,
                   help=f"unsent frames per socket before the oldest is dropped (default: {_D.send_buffer_frames})")
    p.add_argument("--send-stall-s", type=float, default=_D.send_stall_s,
                   help="a socket whose one send has waited this long (its client stopped reading) is cut, its session "
                        f"leaves the worker's rotation, counted (default: {_D.send_stall_s:g})")
    p.add_argument("--max-message-bytes", type=int, default=_D.max_message_bytes,
                   help=f"largest websocket message (default: {_D.max_message_bytes})")
    p.add_argument("--max-upload-bytes", type=int, default=_D.max_upload_bytes,
                   help=f"largest POST /upload_video (default: {_D.max_upload_bytes})")
    p.add_argument("--max-upload-store-bytes", type=int, default=_D.max_upload_store_bytes,
                   help=f"uploads held on disk at once, claimed ones included; a POST past it gets 507 "
                        f"(default: {_D.max_upload_store_bytes})")
    p.add_argument("--max-concurrent-uploads", type=int, default=_D.max_concurrent_uploads,
                   help=f"POSTs received at once (each body is held in memory while read); more get 503 "
                        f"(default: {_D.max_concurrent_uploads})")
    p.add_argument("--max-input-video-pixels", type=int, default=_D.max_input_video_pixels,
                   help="largest width * height of an uploaded video's frames, read from its header at upload (no "
                        f"frame decoded); more gets 413 (default: {_D.max_input_video_pixels}, 1920x1080)")
    p.add_argument("--max-blocks", type=int, default=_D.max_blocks,
                   help=f"largest num_blocks a client may ask for (default: {_D.max_blocks})")
    p.add_argument("--max-steps", type=int, default=_D.max_steps,
                   help=f"largest num_denoising_steps a client may ask for (the target's steps, Krea's rule; "
                        f"default: {_D.max_steps})")
    p.add_argument("--max-pixels", type=int, default=_D.max_pixels,
                   help=f"largest width * height a client may ask for; any size the models make up to it, the "
                        f"preset's always (default: {_D.max_pixels}, Krea's 832x480)")
    p.add_argument("--updates-per-s", type=float, default=_D.updates_per_s,
                   help=f"mid-stream updates per second per socket (default: {_D.updates_per_s:g})")
    p.add_argument("--input-frames-per-s", type=float, default=_D.input_frames_per_s,
                   help=f"webcam `image` frames per second per socket (default: {_D.input_frames_per_s:g})")
    p.add_argument("--video-dir", help="folder of the session MP4s and uploads (default: a temporary folder)")
    p.add_argument("--fps", type=fps_type, default=_D.fps, help=f"frame rate of the MP4s (default: {_D.fps:g})")
    p.add_argument("--ray-replicas", type=int, default=0,
                   help="serve through Ray Serve with this many replicas, each its own pipeline (one per GPU pair; "
                        "the serve-ray extra; 0: no Ray, the default)")
    p.add_argument("--ray-gpus-per-replica", type=float, default=0.0,
                   help="GPUs Ray reserves per replica (2 for a drafter/target pair; default 0: CPU)")
    # --log-level (every command's, sdvg/cli/main.py) also sets uvicorn's
    p.add_argument("--quiet", action="store_true", help="no loading messages")
    p.set_defaults(func=run)
    return p


def config_of(args, environ=None) -> ServeConfig:
    """The server's config from the flags; the token from --token, --token-file or SDVG_SERVE_TOKEN."""
    import os

    from sdvg.serve.security import resolve_token

    token = resolve_token(args.token, args.token_file, os.environ if environ is None else environ)
    return ServeConfig(host=args.host, port=args.port, token=token, max_sessions=args.max_sessions,
                       session_scheduler=args.session_scheduler, min_session_fps=args.min_session_fps,
                       batch_decode=args.batch_decode,
                       max_queue=args.max_queue, idle_timeout_s=args.idle_timeout,
                       first_message_timeout_s=args.first_message_timeout, max_pause_s=args.max_pause_s,
                       header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                       max_connections_per_client=args.max_connections_per_client,
                       upload_min_bytes_per_s=args.upload_min_rate, upload_deadline_s=args.upload_deadline,
                       flood_close_after=args.max_refused_messages,
                       send_buffer_frames=args.send_buffer_frames, send_stall_s=args.send_stall_s,
                       max_message_bytes=args.max_message_bytes,
                       max_upload_bytes=args.max_upload_bytes, max_input_video_pixels=args.max_input_video_pixels,
                       max_upload_store_bytes=args.max_upload_store_bytes,
                       max_concurrent_uploads=args.max_concurrent_uploads, max_blocks=args.max_blocks,
                       max_steps=args.max_steps, max_pixels=args.max_pixels,
                       updates_per_s=args.updates_per_s, input_frames_per_s=args.input_frames_per_s,
                       video_dir=args.video_dir, fps=args.fps,
                       cors_origins=tuple(args.cors_origin), allowed_hosts=tuple(args.allowed_host),
                       static_dir=args.static_dir)


def run(args, load_pipeline=None) -> int:
    """`load_pipeline(args)`: the pipeline the server serves (default: from the preset, checkpoint and device
    flags, as `sdvg generate` builds it)."""
    from sdvg.options import options_from_args
    from sdvg.serve.listen import PortError, bind_socket, bound_url
    from sdvg.serve.protocol import ProtocolError
    from sdvg.serve.security import check_bind

    from sdvg.serve.static_site import check_static_dir

    cfg = config_of(args)
    check_bind(cfg.host, cfg.token)  # a ValueError: exit 2 before anything loads
    if cfg.static_dir is not None:
        check_static_dir(cfg.static_dir)
    defaults = options_from_args(args)
    if defaults.run_ahead or defaults.cuda_graphs and cfg.max_sessions > 1:
        raise ProtocolError("run_ahead" if defaults.run_ahead else "cuda_graphs",
                            "sessions are interleaved on one worker: drop --run-ahead; --cuda-graphs needs "
                            "--max-sessions 1")
    try:
        from sdvg.serve.app import create_app
        from sdvg.serve.server import serve
    except ImportError as exc:
        print(f"error: sdvg serve needs the serve extra: pip install 'sdvg[serve]' ({exc})", file=sys.stderr)
        return 2
    if load_pipeline is None:
        from sdvg.cli.pipelines import build_pipeline as load_pipeline
    if args.ray_replicas > 0:
        if cfg.port == 0:
            raise PortError("--port 0 with --ray-replicas: Ray's proxy binds the port itself and does not say which "
                            "one it took; give a port (e.g. --port 8000)")
        bind_socket(cfg.host, cfg.port).close()  # checked before any replica loads (Ray's proxy binds it again)
        try:
            from sdvg.serve.ray_app import run as run_ray
        except ImportError as exc:
            print(f"error: --ray-replicas needs the serve-ray extra: pip install 'sdvg[serve-ray]' ({exc})",
                  file=sys.stderr)
            return 2
        return run_ray(args, cfg, defaults, load_pipeline)

    sock = bind_socket(cfg.host, cfg.port)  # a taken or foreign address: exit 2 before any model loads
    try:
        pipe = load_pipeline(args)
        app = create_app(pipe, cfg, defaults)
        if not args.quiet:
            sessions = f"{cfg.max_sessions} session" + "s" * (cfg.max_sessions != 1)
            print(f"sdvg serve: {bound_url(sock)} (preset {args.preset}, at most {sessions})",
                  file=sys.stderr, flush=True)
        serve(app, cfg, args.log_level, sock)
    finally:
        sock.close()
    return 0
