"""What `sdvg generate` writes and where: the output names (an existing output kept, this run's outputs
numbered, unless --overwrite), the check of a stats file it resumes, the timeline and early-exit map
PNGs, the note on unread early-exit flags, and the summary line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from sdvg.cli.video import video_path


def files_of(bases: dict, indices, many: bool) -> dict[str, Path]:
    """Every file a run writes (flag -> path) from its base names (out, stats, timeline, exit_map)."""
    from sdvg.io.outputs import generate_outputs

    videos = {i: video_path(Path(bases["out"]), i, many) for i in indices}
    return generate_outputs(Path(bases["stats"]), videos, bases["timeline"], bases["exit_map"], many)


def output_names(args, indices, many: bool) -> tuple[Path, Path]:
    """(--out, the stats path) this run writes, every file of the run checked (`check_output_paths`). An
    existing output is kept: unless --overwrite (or --resume, which continues the files it finds), this
    run's outputs take the first free numbered names, said on stderr (--timeline and --exit-map in `args`
    are renamed alike). What cannot be an output at all (a folder, a device, two flags naming one file) is
    refused as given, not renamed around."""
    from sdvg.io.outputs import check_output_paths, unused_outputs

    out = Path(args.out)
    if out.suffix.lower() != ".mp4":
        raise ValueError(f"--out {out} must end in .mp4")
    stats = Path(args.stats) if args.stats else out.with_suffix(".jsonl" if many else ".json")
    given = dict(out=out, stats=stats, timeline=args.timeline, exit_map=args.exit_map)
    check_output_paths(**files_of(given, indices, many))
    if args.overwrite or args.resume:
        return out, stats
    chosen, existing = unused_outputs(given, lambda bases: files_of(bases, indices, many))
    if existing:
        check_output_paths(**files_of(chosen, indices, many))
        args.timeline = None if chosen["timeline"] is None else str(chosen["timeline"])
        args.exit_map = None if chosen["exit_map"] is None else str(chosen["exit_map"])
        video = chosen["out"].with_name(f"{chosen['out'].stem}_NNNN.mp4") if many else chosen["out"]
        more = f" (and {len(existing) - 1} more of this run's outputs)" if len(existing) > 1 else ""
        print(f"{existing[0]} exists{more}: kept; this run writes {video} and {chosen['stats']} instead "
              "(--overwrite replaces the old ones)", file=sys.stderr)
    return chosen["out"], chosen["stats"]


def done_prompts(stats_path: Path, prompts: dict[int, str], options: dict) -> set[int]:
    """Prompts a JSON Lines stats file already holds complete records of. A record counts for prompt i
    only if its text (hash) is line i's and its options are this run's; a file written for another
    prompts file or other options is refused, naming what differs (nothing is overwritten). Records of every
    schema are read (`read_stats`: the grouped schema 9, the flat 1-8), one of a newer schema refused."""
    from sdvg.generation.types import read_stats
    from sdvg.io.outputs import prompt_sha256, stored_option_matches

    done = set()
    if not stats_path.is_file():
        return done
    for n, line in enumerate(stats_path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{stats_path} line {n} is not JSON; the file is damaged: move it away or pass "
                             "another --stats") from None
        try:
            rec = read_stats(rec)
        except ValueError as exc:
            raise ValueError(f"{stats_path} line {n}: {exc}") from None
        cli, video, stored = rec.get("cli", {}), rec["video"], rec["options"]
        i = cli.get("prompt_index")
        if i not in prompts or video.get("interrupted"):
            continue
        if cli.get("prompt_sha256", prompt_sha256(video.get("prompt", ""))) != prompt_sha256(prompts[i]):
            raise ValueError(f"{stats_path} line {n}: prompt {i} was {video.get('prompt', '?')!r:.60}, the prompts "
                             f"file now has {prompts[i]!r:.60} (edited?); pass another --stats or drop --resume")
        infinite = cli.get("infinite_options")
        differ = sorted(k for k, v in options.items() if k in stored
                        and not stored_option_matches(stored, infinite, k, v))
        if differ:
            raise ValueError(f"{stats_path} line {n}: prompt {i} was generated with other options ("
                             + ", ".join(f"{k}={stored[k]!r} now {options[k]!r}" for k in differ[:6])
                             + "); pass another --stats or the same options")
        done.add(i)
    return done


def timeline(args, stats, index: int, many: bool) -> None:
    """--timeline: the PNG of every stage call of the traced run."""
    if not args.timeline or not stats.trace:
        return  # an interrupted video keeps no trace
    from sdvg.evaluation.timeline import decisions_of, plot_timeline

    rec = stats.as_dict()
    opts, res = rec["options"], rec["result"]
    acc = res["acceptance_rate"]
    title = (f"{opts['mode']}, {opts['scheduler']}{' run-ahead' if opts['run_ahead'] else ''}: "
             f"{res['scheduler_wall_s']:.2f} s (the traced run)" + ("" if acc is None else f" at {acc:.0%} acceptance"))
    plot_timeline([{"title": title, "trace": rec["trace"], "decisions": decisions_of(rec["blocks"])}],
                  video_path(Path(args.timeline), index, many))


def warn_unused_exit_flags(args, opts) -> None:
    """Say up front which early-exit flags this run will not read (no early exit asked for)."""
    if opts.early_exit != "none":
        return
    from sdvg.options import DEFAULTS, flag_of

    unused = [flag_of(n) for n in ("exit_verifier", "exit_eps", "exit_thresholds", "exit_head", "exit_pattern_steps")
              if getattr(opts, n) != getattr(DEFAULTS, n)]
    if getattr(args, "exit_map", None):
        unused.append("--exit-map")
    if unused:
        print(f"note: {', '.join(unused)} have no effect without --early-exit target|drafter|both", file=sys.stderr)


def exit_map_collector(args, maps: list):
    """on_block callback gathering each block's early-exit step map (only with --exit-map)."""
    if not args.exit_map:
        return None

    def collect(block):
        steps = None if block.exits is None else block.exits.steps_map
        maps.append({"index": block.index, "decision": block.decision,
                     "steps": None if steps is None else steps.numpy()})
    return collect


def exit_map(args, stats, maps: list, index: int, many: bool) -> None:
    """--exit-map: the heat map of the denoising steps each token of each emitted block took."""
    if not args.exit_map or not maps:
        return
    from sdvg.evaluation.exit_map import plot_exit_map

    opts = stats.options
    ks = [b["exit"][b["exit"]["producer"]]["num_steps"] for b in stats.blocks
          if "exit" in b and b["exit"]["producer"] in b["exit"]]
    if not ks:
        print(f"--exit-map: no emitted block was denoised with early exit (--early-exit {opts.early_exit}); no "
              "map written", file=sys.stderr)
        return
    drawn = [m for m in maps if m["steps"] is not None]
    k_drawn = sum(float(m["steps"].mean()) for m in drawn) / len(drawn)
    title = (f"{opts.mode}, early exit {opts.early_exit} ({opts.exit_verifier}): {len(drawn)} of {len(maps)} "
             f"blocks made with early exit, k_bar {k_drawn:.2f} over them "
             f"({stats.exit_summary()['mean_steps']:.2f} over the video)")
    plot_exit_map(maps, max(ks), video_path(Path(args.exit_map), index, many), title)


def summary(stats, path: Path) -> None:
    """The one line a single video ends with; an interrupted run says so, by which signal and where. `stats`: a
    `RunStats` or its record (schema 9)."""
    rec = stats.as_dict() if hasattr(stats, "as_dict") else stats
    video, res, cli = rec["video"], rec["result"], rec.get("cli", {})
    acc = res["acceptance_rate"]
    acc_s = "n/a" if acc is None else f"{acc:.1%}"
    wall = float("nan") if res["wall_s"] is None else res["wall_s"]
    line = (f"{cli.get('video_path') or 'no video (no block was emitted)'}: {video['frames']} frames, acceptance {acc_s}, "
            f"wall {wall:.2f} s; stats in {path}")
    if video["interrupted"]:
        line = (f"interrupted ({cli.get('interrupted_by') or 'stopped'}) after {video['blocks_done']} of "
                f"{rec['options']['num_blocks']} blocks: " + line)
    print(line, file=sys.stderr)
