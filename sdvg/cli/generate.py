"""`sdvg generate`: one video per prompt (--prompt, or each line of --prompts-file), the MP4 written as
blocks arrive, the stats as JSON (JSON Lines for a prompts file, resumable)."""
from __future__ import annotations

import sys
from pathlib import Path

from sdvg.config import PRESETS
from sdvg.io import DEFAULT_CRF, DEFAULT_FPS, fps_type
from sdvg.io.outputs import record_fields, write_text_atomic
from sdvg.io.text_input import check_prompt
from sdvg.options import options_from_args

from sdvg.cli import generate_outputs as outputs
from sdvg.cli.args import add_config, add_generation_args, bar, count, in_flags
from sdvg.cli.pipelines import announce_protocol
from sdvg.cli.prompts import read_prompts
from sdvg.cli.video import exit_code, run_one, video_path


def add_parser(sub, config: dict | None) -> None:
    g = sub.add_parser("generate", help="generate videos (MP4 written as blocks arrive)")
    add_generation_args(g)
    g.add_argument("--prompt", help="one text prompt (or --prompts-file)")
    g.add_argument("--prompt-schedule", metavar="FILE",
                   help="a JSON/YAML list of {block, prompt, interp_blocks} replacing --prompt (docs/live.md)")
    g.add_argument("--prompts-file", help="one prompt per line (e.g. sdvg/data/MovieGenVideoBench.txt)")
    g.add_argument("--input-video", metavar="FILE",
                   help="video-to-video: the input video, resampled to 16 frames/s, scaled and centre-cropped to the "
                        "preset's size, noised to --strength (docs/live.md)")
    g.add_argument("--start-frame", metavar="IMAGE",
                   help="an image (JPEG, PNG or WebP) every model sees as clean context before block 0, encoded as "
                        "--kv-cache-frames latent frames (Krea's start_frame; docs/live.md)")
    g.add_argument("--offset", type=count(0), default=0, help="skip the first N prompts of --prompts-file")
    g.add_argument("--limit", type=count(0), default=0, help="at most N prompts (0 = all)")
    g.add_argument("--out", default=DEFAULT_OUT, help=f"the MP4 (default: {DEFAULT_OUT} in the current folder; with "
                                                       "--prompts-file: <stem>_<line>.mp4 per prompt)")
    g.add_argument("--stats", help="statistics (docs/stats.md): JSON, or JSON Lines with --prompts-file; "
                                   "default: --out with .json / .jsonl")
    g.add_argument("--overwrite", action="store_true",
                   help="replace outputs that exist; without it an existing output is kept and this run's outputs "
                        "take the next free numbered names (video-1.mp4, video-1.json, ...), said on stderr")
    g.add_argument("--create-dirs", action="store_true",
                   help="create the outputs' missing folders (without it a missing folder is refused)")
    g.add_argument("--fps", type=fps_type, default=DEFAULT_FPS,
                   help=f"frames per second of the MP4 (default: {DEFAULT_FPS}, Wan2.1's)")
    g.add_argument("--crf", type=count(0, 51), default=DEFAULT_CRF,
                   help=f"libx264 quality, 0 (lossless) to 51 (default: {DEFAULT_CRF})")
    g.add_argument("--resume", action="store_true", help="skip prompts already in the stats JSONL")
    g.add_argument("--timeline", help="PNG of every stage call on the drafter / VAE+reward / target lanes "
                                      "(one per prompt with --prompts-file)")
    g.add_argument("--exit-map", help="PNG heat map of the denoising steps each token of each emitted block took "
                                      "(with --early-exit; with --prompts-file: <stem>_<line>.png per prompt)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=run)
    add_config(g, config)


DEFAULT_OUT = "video.mp4"


def run(args, load_pipeline) -> int:
    from sdvg.live.updates import cli_prompt

    if args.prompt is None and args.prompts_file is None and args.prompt_schedule is None:
        raise ValueError("give --prompt TEXT, --prompts-file FILE or --prompt-schedule FILE")
    args.prompt = cli_prompt(args)  # --prompt-schedule FILE: the first prompt, carrying the schedule
    from sdvg.io.locks import lock_outputs

    if (args.prompt is None) == (args.prompts_file is None):
        raise ValueError("give either --prompt TEXT or --prompts-file FILE")
    if args.prompt is not None:
        check_prompt(args.prompt)  # valid text for the tokenizer, before any model loads
    if args.prompt is not None:
        prompts, first = [args.prompt], 0
    else:
        every = read_prompts(args.prompts_file)
        first = args.offset
        prompts = every[first:first + args.limit] if args.limit else every[first:]
        if not prompts:
            raise ValueError(f"--offset {args.offset} leaves no prompt of the {len(every)} in {args.prompts_file}")
    many = args.prompts_file is not None  # a prompts file: one video per line, <out>_<line>.mp4, JSON Lines stats
    out, stats_path = outputs.output_names(args, range(first, first + len(prompts)), many)  # checked; none lost
    opts = options_from_args(args)
    outputs.warn_unused_exit_flags(args, opts)
    _check_input_video(args, opts)
    if args.preset in PRESETS:  # the rules that need the preset (video length, windows), before any model loads
        from sdvg.config import get_preset

        resolved = opts.resolved(get_preset(args.preset))
        if args.start_frame is not None:
            from sdvg.generation.prepare import start_frame_conflict

            why = start_frame_conflict(resolved)
            if why:
                raise ValueError(in_flags(why))
    with lock_outputs(stats_path, out, args.timeline, args.exit_map):
        if many:
            return _generate_many(args, load_pipeline, prompts, first, out, stats_path, opts)
        pipe = load_pipeline(args)
        announce_protocol(args, pipe.preset, opts)
        maps: list = []
        stats = run_one(pipe, prompts[0], opts, out, progress=not args.quiet, fps=args.fps, crf=args.crf,
                        on_block=outputs.exit_map_collector(args, maps), input_video=args.input_video,
                        start_frame=args.start_frame)
        stats.extra.update(record_fields(args.protocol, pipe.resolve(opts).as_dict()))
        stats.argv = getattr(args, "command_line", None)
        write_text_atomic(stats_path, stats.to_json(indent=2))
        outputs.timeline(args, stats, 0, many=False)
        outputs.exit_map(args, stats, maps, 0, many=False)
        outputs.summary(stats, stats_path)
        return exit_code(stats)


def _check_input_video(args, opts) -> None:
    """--input-video, --strength, --start-frame and --exit-head, before any model loads: the files are there (the
    exit head a regular file); strength needs an input."""
    if args.input_video is None and opts.strength != 1.0:
        raise ValueError(f"--strength {opts.strength} sets how much of an input video is kept; give "
                         "--input-video FILE (or leave --strength at 1.0)")
    if opts.exit_head is not None:  # read at the first block: a named pipe there would block it forever
        from sdvg.io.safe_files import check_regular_input

        check_regular_input(opts.exit_head, "--exit-head", "give the head's .safetensors file (`sdvg train-exit-head` "
                                                           "writes head.safetensors in its --out)")
    if args.start_frame is not None and not Path(args.start_frame).is_file():
        raise ValueError(f"--start-frame {args.start_frame} does not exist or is not a file; give an image file "
                         "(JPEG, PNG or WebP)")
    if args.input_video is None:
        return
    if not Path(args.input_video).is_file():
        raise ValueError(f"--input-video {args.input_video} does not exist or is not a file; give a video file "
                         "(e.g. an MP4)")


def _generate_many(args, load_pipeline, prompts: list[str], first: int, out: Path, stats_path: Path, opts) -> int:
    """One video per line of the prompts file, the stats appended line by line (resumable)."""
    from sdvg.io.outputs import append_jsonl, prompt_sha256, repair_jsonl

    by_index = dict(enumerate(prompts, start=first))
    if args.resume:
        cut = repair_jsonl(stats_path)
        if cut:
            print(f"{stats_path}: cut {cut} bytes of a record torn by an earlier crash (that prompt is redone)",
                  file=sys.stderr)
    elif stats_path.exists():
        stats_path.unlink()
    from sdvg.config import get_preset

    resolved = opts.resolved(get_preset(args.preset)).as_dict()  # from the preset alone: no model loaded yet
    resolved.pop("backend", None)  # how stages ran does not change the video
    done = outputs.done_prompts(stats_path, by_index, resolved) if args.resume else set()
    if done and len(done) == len(by_index):  # nothing to do: said before any model loads
        print(f"every prompt ({len(done)}) is in {stats_path} already; nothing to resume", file=sys.stderr)
        return 0
    pipe = load_pipeline(args)
    announce_protocol(args, pipe.preset, opts)
    stats_path.parent.mkdir(parents=True, exist_ok=True)
    videos = bar(args, len(by_index), "prompts", "video", initial=len(done))  # the outer bar, with its ETA
    try:
        for i, prompt in by_index.items():  # i: the prompt's line in the file (0-based)
            if i in done:
                continue
            maps: list = []
            stats = run_one(pipe, prompt, opts, video_path(out, i, True), progress=not args.quiet, fps=args.fps,
                            crf=args.crf, on_block=outputs.exit_map_collector(args, maps), nested=True,
                            input_video=args.input_video, start_frame=args.start_frame)
            stats.extra["prompt_index"] = i
            stats.extra.update(record_fields(args.protocol, resolved))
            stats.extra["prompt_sha256"] = prompt_sha256(prompt)
            stats.argv = getattr(args, "command_line", None)
            append_jsonl(stats_path, stats.to_json())
            outputs.timeline(args, stats, i, many=True)
            outputs.exit_map(args, stats, maps, i, many=True)
            if stats.interrupted:
                videos.close()
                print(f"interrupted ({stats.extra.get('interrupted_by') or 'stopped'}) at prompt {i} after "
                      f"{len(stats.blocks)} of {stats.options.num_blocks} blocks; its partial video and stats are "
                      f"written; rerun with --resume to continue", file=sys.stderr)
                return exit_code(stats)
            videos.update(1)
    finally:
        videos.close()
    written = sum(i not in done for i in by_index)
    print(f"wrote {written} video(s); stats in {stats_path}", file=sys.stderr)
    return 0
