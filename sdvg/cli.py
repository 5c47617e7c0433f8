"""Command line: `sdvg generate`, `sdvg memory`, `sdvg sweep`, `sdvg calibrate`, `sdvg calibrate-exit`,
`sdvg train-exit-head`.

The generation flags are derived from `sdvg.options.GenerationOptions` (one declaration); this
module imports no torch until a command runs, so `sdvg --help` is fast."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from sdvg.config import PRESETS, KVWindow, RoleContext
from sdvg.io import DEFAULT_CRF, DEFAULT_FPS
from sdvg.io.outputs import write_text_atomic
from sdvg.options import BACKENDS, PROTOCOLS, add_option_flags, option_type, options_from_args

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "MovieGenVideoBench.txt"


def _count(low: int, high: int | None = None):
    """argparse type: an integer >= low (and <= high)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"{v} must lie in [{low}, {high}]")
        return v

    return parse


def _real(low: float = -math.inf, high: float = math.inf):
    """argparse type: a finite number in [low, high] (NaN and infinities refused)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or not low <= v <= high:
            bounds = "a finite number" if (low, high) == (-math.inf, math.inf) else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text} must be {bounds}")
        return v

    return parse


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line, UTF-8; blank lines are an error (they would shift prompt indices)."""
    if not Path(path).is_file():
        raise ValueError(f"prompts file {path} is not a file; give a text file with one prompt per line")
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompts file {path} is not valid UTF-8 (byte {exc.start}); re-save it as UTF-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    blank = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if blank:
        raise ValueError(f"prompts file {path} has blank lines at {blank[:10]}; remove them")
    if not lines:
        raise ValueError(f"prompts file {path} holds no prompt")
    return [line.rstrip("\r") for line in lines]


def add_generation_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Model and placement flags, the memory budget, then one flag per generation option (minus `exclude`)."""
    add_model_args(p)
    p.add_argument("--memory-budget-gib", type=_real(0), default=None,
                   help="memory each device may hold for this pipeline in GiB (weights, KV caches, prompt K/V, as "
                        "`sdvg memory --budget-gib` counts), checked before each video allocates its KV caches; "
                        "default: each device's free memory (CUDA: free + PyTorch's cache; CPU: MemAvailable)")
    add_option_flags(p, exclude=exclude)


def add_model_args(p: argparse.ArgumentParser, engines: bool = True) -> None:
    """The preset, checkpoint and device flags (`python -m build_engines` takes the same ones, so an
    engine folder is built from the weights `generate` loads)."""
    random = sorted(k for k, v in PRESETS.items() if v.random_weights)
    real = sorted(k for k, v in PRESETS.items() if not v.random_weights)
    p.add_argument("--preset", default="tiny", help=f"random weights: {', '.join(random)}; real weights (from the "
                                                     f"HF cache, or the flags below): {', '.join(real)}")
    where = " (a local path or a hub repo org/name[@revision][/file]; default: the preset's)"
    p.add_argument("--drafter", help="drafter checkpoint: Self-Forcing .pt, .safetensors or diffusers folder" + where)
    p.add_argument("--target", help="target checkpoint: Krea .safetensors, original Wan or diffusers folder" + where)
    p.add_argument("--vae", help="Wan2.1 VAE: .pth or diffusers folder" + where)
    p.add_argument("--reward", help="ImageReward.pt" + where)
    p.add_argument("--reward-tokenizer", help="bert-base-uncased tokenizer folder" + where)
    p.add_argument("--text-encoder", help="umT5 encoder folder or a diffusers Wan folder" + where)
    if engines:
        p.add_argument("--engines", help="engine folder built by `python -m build_engines` from the same preset and "
                                         "checkpoint flags (backend tensorrt; onnxruntime with --format onnx; "
                                         "torch-tensorrt with --format torch-tensorrt)")
        from sdvg.options import TRT_RUNTIMES

        p.add_argument("--trt-runtime", choices=TRT_RUNTIMES, default=TRT_RUNTIMES[0],
                       help="how TensorRT plans run: torch (torch's current stream) or cuda-python (stream-ordered "
                            "engine memory on the executor's own stream; the tensorrt extra)")
        p.add_argument("--trt-cuda-graphs", action="store_true",
                       help="capture the static DiT stages in CUDA graphs (--trt-runtime cuda-python)")
    p.add_argument("--device", "--drafter-device", dest="device", default="cpu",
                   help="drafter, VAE and reward device")
    p.add_argument("--target-device", default=None, help="target device (default: --device)")


def build_pipeline(args):
    import time

    t0 = time.perf_counter()
    what = f"preset {args.preset!r}" + ("" if args.preset not in PRESETS or not PRESETS[args.preset].random_weights
                                        else " (random weights)")
    _progress(args, f"loading {what} ...")
    pipe = _build_pipeline(args)
    if getattr(args, "trt_runtime", None) is not None:
        pipe.set_engine_executor(args.trt_runtime, args.trt_cuda_graphs)
    _progress(args, f"loaded in {time.perf_counter() - t0:.1f} s")
    return pipe


def _build_pipeline(args):
    """Random weights for a random-weight preset without checkpoint flags; real weights otherwise (the
    preset's published files, each replaced by its flag when given)."""
    from sdvg.config import get_preset
    from sdvg.pipeline import SpeculativeVideoPipeline

    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    preset = get_preset(args.preset)
    paths = dict(drafter=args.drafter, target=args.target, vae=args.vae, text_encoder=args.text_encoder,
                 reward=args.reward, reward_tokenizer=args.reward_tokenizer)
    backend = args.backend or BACKENDS[0]
    if preset.random_weights and not any(paths.values()):
        return SpeculativeVideoPipeline.from_preset(preset, device=args.device, target_device=args.target_device,
                                                    backend=backend, engines=args.engines,
                                                    memory_budget_gib=getattr(args, "memory_budget_gib", None))
    return SpeculativeVideoPipeline.from_pretrained(preset, **paths, drafter_device=args.device,
                                                    target_device=args.target_device, backend=backend,
                                                    engines=args.engines,
                                                    memory_budget_gib=getattr(args, "memory_budget_gib", None))


def _video_path(out: Path, index: int, many: bool) -> Path:
    return out if not many else out.with_name(f"{out.stem}_{index:04d}{out.suffix}")


def _done_prompts(stats_path: Path, prompts: dict[int, str], options: dict) -> set[int]:
    """Prompts a JSON Lines stats file already holds complete records of. A record counts for prompt i
    only if its text (hash) is line i's and its options are this run's; a file written for another
    prompts file or other options is refused, naming what differs (nothing is overwritten)."""
    from sdvg.io.outputs import prompt_sha256

    done = set()
    if not stats_path.is_file():
        return done
    for n, line in enumerate(stats_path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{stats_path} line {n} is not JSON; the file is damaged: move it away or pass "
                             "another --stats") from None
        i = rec.get("prompt_index")
        if i not in prompts or rec.get("interrupted"):
            continue
        if rec.get("prompt_sha256", prompt_sha256(rec.get("prompt", ""))) != prompt_sha256(prompts[i]):
            raise ValueError(f"{stats_path} line {n}: prompt {i} was {rec.get('prompt', '?')!r:.60}, the prompts "
                             f"file now has {prompts[i]!r:.60} (edited?); pass another --stats or drop --resume")
        differ = sorted(k for k, v in options.items() if k in rec and rec[k] != v)
        if differ:
            raise ValueError(f"{stats_path} line {n}: prompt {i} was generated with other options ("
                             + ", ".join(f"{k}={rec[k]!r} now {options[k]!r}" for k in differ[:6])
                             + "); pass another --stats or the same options")
        done.add(i)
    return done


def run_one(pipe, prompt: str, opts, video: Path, progress: bool = True, fps: float = DEFAULT_FPS,
            crf: int = DEFAULT_CRF, on_block=None):
    """Generate one video, writing the MP4 as blocks arrive; returns its `RunStats`. On Ctrl-C, SIGTERM or
    SIGHUP the MP4 of the blocks emitted so far is closed (playable; no file when no block was emitted) and
    the stats (same fields) are marked interrupted, with `interrupted_by` naming the signal. A failed
    encode raises `VideoWriteError`."""
    from tqdm import tqdm

    from sdvg.io.interrupts import Interrupted, shielded, signals_interrupt
    from sdvg.io.video_writer import IncrementalMP4Writer

    opts = pipe.resolve(opts)
    bar = tqdm(total=opts.num_blocks, desc=video.name, unit="block", disable=not progress, file=sys.stderr)
    counts = {"forced": 0, "accepted": 0, "rejected": 0}
    writer = IncrementalMP4Writer(video, fps=fps, crf=crf)
    stream = pipe.run(prompt, opts)
    signum = None
    failed = True
    try:
        with signals_interrupt():
            try:
                for block in stream:
                    writer.write(block.frames)
                    if on_block is not None:
                        on_block(block)
                    if block.decision in counts:
                        counts[block.decision] += 1
                        bar.set_postfix(counts)
                    bar.update(1)
                failed = False
            except KeyboardInterrupt as exc:  # the stream is closed below: its stats are marked interrupted
                signum = exc.signum if isinstance(exc, Interrupted) else 2
                failed = False
    finally:
        with shielded() as later:  # a second Ctrl-C cannot cut the closing short
            bar.close()
            stream.close()  # stops the scheduler thread of an unfinished video
            if failed:
                writer._cleanup(keep=False)  # an error: no half-written file under the final name
            else:
                writer.close()
        if signum is None and later:
            signum = later[0]
    stats = stream.stats  # final: complete, or marked interrupted by close()
    import signal as _signal

    stats.extra["video"] = str(video) if writer.frames_written else None
    stats.extra["interrupted_by"] = None if signum is None else _signal.Signals(signum).name
    return stats


def _exit_code(stats) -> int:
    """0, or 128 + the signal that interrupted the run (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    import signal as _signal

    by = stats.extra.get("interrupted_by")
    return 0 if by is None else 128 + int(_signal.Signals[by])


def cmd_generate(args) -> int:
    from sdvg.io.outputs import OutputLock, check_output_paths

    from sdvg.live.updates import cli_prompt
    args.prompt = cli_prompt(args)  # --prompt-schedule FILE: the first prompt, carrying the schedule
    if (args.prompt is None) == (args.prompts_file is None):
        raise ValueError("give either --prompt TEXT or --prompts-file FILE")
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt is empty; give a non-empty prompt")
    if args.prompt is not None:
        prompts, first = [args.prompt], 0
    else:
        every = read_prompts(args.prompts_file)
        first = args.offset
        prompts = every[first:first + args.limit] if args.limit else every[first:]
        if not prompts:
            raise ValueError(f"--offset {args.offset} leaves no prompt of the {len(every)} in {args.prompts_file}")
    out = Path(args.out)
    many = args.prompts_file is not None  # a prompts file: one video per line, <out>_<line>.mp4, JSON Lines stats
    stats_path = Path(args.stats) if args.stats else out.with_suffix(".jsonl" if many else ".json")
    if out.suffix.lower() != ".mp4":
        raise ValueError(f"--out {out} must end in .mp4")
    videos = {i: _video_path(out, i, many) for i in range(first, first + len(prompts))}
    check_output_paths(stats=stats_path, timeline=args.timeline, exit_map=args.exit_map,
                       **{("out" if not many else f"out_{i}"): v for i, v in videos.items()})
    opts = options_from_args(args)
    _warn_unused_exit_flags(args, opts)
    if args.preset in PRESETS:  # the rules that need the preset (video length, windows), before any model loads
        from sdvg.config import get_preset

        opts.resolved(get_preset(args.preset))
    with OutputLock(stats_path):
        if not many:
            pipe = build_pipeline(args)
            _announce_protocol(args, pipe.preset, opts)
            maps: list = []
            stats = run_one(pipe, prompts[0], opts, out, progress=not args.quiet, fps=args.fps, crf=args.crf,
                            on_block=_exit_map_collector(args, maps))
            write_text_atomic(stats_path, stats.to_json(indent=2))
            _timeline(args, stats, 0, many=False)
            _exit_map(args, stats, maps, 0, many=False)
            _summary(stats, stats_path)
            return _exit_code(stats)
        return _generate_many(args, prompts, first, out, stats_path, opts)


def _generate_many(args, prompts: list[str], first: int, out: Path, stats_path: Path, opts) -> int:
    from sdvg.io.outputs import append_jsonl, prompt_sha256, repair_jsonl

    by_index = dict(enumerate(prompts, start=first))
    if args.resume:
        cut = repair_jsonl(stats_path)
        if cut:
            print(f"{stats_path}: cut {cut} bytes of a record torn by an earlier crash (that prompt is redone)",
                  file=sys.stderr)
    elif stats_path.exists():
        stats_path.unlink()
    pipe = build_pipeline(args)
    _announce_protocol(args, pipe.preset, opts)
    resolved = pipe.resolve(opts).as_dict()
    resolved.pop("backend", None)  # how stages ran does not change the video
    done = _done_prompts(stats_path, by_index, resolved) if args.resume else set()
    stats_path.parent.mkdir(parents=True, exist_ok=True)
    for i, prompt in by_index.items():  # i: the prompt's line in the file (0-based)
        if i in done:
            continue
        maps: list = []
        stats = run_one(pipe, prompt, opts, _video_path(out, i, True), progress=not args.quiet, fps=args.fps,
                        crf=args.crf, on_block=_exit_map_collector(args, maps))
        stats.extra["prompt_index"] = i
        stats.extra["prompt_sha256"] = prompt_sha256(prompt)
        append_jsonl(stats_path, stats.to_json())
        _timeline(args, stats, i, many=True)
        _exit_map(args, stats, maps, i, many=True)
        if stats.interrupted:
            print(f"interrupted at prompt {i}; rerun with --resume to continue", file=sys.stderr)
            return _exit_code(stats)
    written = sum(i not in done for i in by_index)
    print(f"wrote {written} video(s); stats in {stats_path}", file=sys.stderr)
    return 0


def _timeline(args, stats, index: int, many: bool) -> None:
    if not args.timeline or not stats.get("trace"):
        return  # an interrupted video keeps no trace
    from sdvg.evaluation.timeline import decisions_of, plot_timeline

    acc = stats.get("acceptance_rate")
    title = (f"{stats['mode']}, {stats.get('scheduler', '')}{' run-ahead' if stats.get('run_ahead') else ''}: "
             f"{stats['scheduler_wall_s']:.2f} s (the traced run)" + ("" if acc is None else f" at {acc:.0%} acceptance"))
    plot_timeline([{"title": title, "trace": stats["trace"], "decisions": decisions_of(stats.get("blocks", []))}],
                  _video_path(Path(args.timeline), index, many))


def _warn_unused_exit_flags(args, opts) -> None:
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


def _exit_map_collector(args, maps: list):
    """on_block callback gathering each block's early-exit step map (only with --exit-map)."""
    if not args.exit_map:
        return None

    def collect(block):
        steps = None if block.exits is None else block.exits.steps_map
        maps.append({"index": block.index, "decision": block.decision,
                     "steps": None if steps is None else steps.numpy()})
    return collect


def _exit_map(args, stats, maps: list, index: int, many: bool) -> None:
    if not args.exit_map or not maps:
        return
    from sdvg.evaluation.exit_map import plot_exit_map

    ks = [b["exit"][b["exit"]["producer"]]["num_steps"] for b in stats.get("blocks", [])
          if "exit" in b and b["exit"]["producer"] in b["exit"]]
    if not ks:
        print(f"--exit-map: no emitted block was denoised with early exit (--early-exit {stats['early_exit']}); no "
              "map written", file=sys.stderr)
        return
    drawn = [m for m in maps if m["steps"] is not None]
    k_drawn = sum(float(m["steps"].mean()) for m in drawn) / len(drawn)
    title = (f"{stats['mode']}, early exit {stats['early_exit']} ({stats['exit_verifier']}): {len(drawn)} of {len(maps)} "
             f"blocks made with early exit, k_bar {k_drawn:.2f} over them ({stats['mean_steps']:.2f} over the video)")
    plot_exit_map(maps, max(ks), _video_path(Path(args.exit_map), index, many), title)


def _summary(stats, path: Path) -> None:
    acc = stats.get("acceptance_rate")
    acc_s = "n/a" if acc is None else f"{acc:.1%}"
    print(f"{stats['video']}: {stats['frames']} frames, acceptance {acc_s}, "
          f"wall {stats.get('wall_s', float('nan')):.2f} s; stats in {path}", file=sys.stderr)


MEMORY_OPTIONS = ("mode", "num_blocks", "target_context", "drafter_cache", "kv_cache_frames", "keep_first_frame",
                  "window_frames", "sink_frames")


def cmd_memory(args) -> int:
    """The resident memory of a pipeline per device, before anything is allocated; both context modes' KV
    caches side by side; a per-device budget check (exit 2 when a device does not fit)."""
    from sdvg.config import get_preset
    from sdvg.models.memory import GIB, device_totals, format_plan, kv_bytes, plan_memory

    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    preset = get_preset(args.preset)
    opts = options_from_args(args).resolved(preset)
    roles = {"sdvg": ("drafter", "target"), "target": ("target",), "draft": ("drafter",)}[opts.mode]
    contexts = {role: opts.role_context(role) for role in roles}
    te_device = args.text_encoder_device or args.device
    items = plan_memory(preset, contexts, opts.num_blocks, args.device, args.target_device, te_device)
    modes = {}
    for role in roles:
        chosen = contexts[role]
        modes[role] = {}
        for mode in ("full", "recompute"):
            ctx = RoleContext(mode, chosen.kv_cache_frames, chosen.keep_first_frame,
                              chosen.window if mode == "full" else KVWindow())
            modes[role][mode] = kv_bytes(preset, role, ctx, opts.num_blocks)
    totals = device_totals(items)
    if args.json:
        print(json.dumps({"preset": preset.name, "precision": preset.precision, "num_blocks": opts.num_blocks,
                          "contexts": {r: c.mode for r, c in contexts.items()},
                          "kv_cache_gib_per_mode": {r: {m: v[0] / GIB for m, v in d.items()} for r, d in modes.items()},
                          "items": [{"device": it.device, "what": it.what, "gib": it.gib, "arithmetic": it.arithmetic}
                                    for it in items],
                          "device_total_gib": {d: t / GIB for d, t in totals.items()},
                          "budget_gib": args.budget_gib}, indent=2))
    else:
        frames = opts.num_blocks * preset.video.frames_per_block
        print(f"sdvg memory: preset {preset.name}, {preset.precision}, {opts.num_blocks} blocks ({frames} latent "
              f"frames); nothing allocated")
        print("KV cache per context mode (* = this run's):")
        for role, d in modes.items():
            for mode, (nbytes, how) in d.items():
                mark = "*" if contexts[role].mode == mode else " "
                print(f" {mark} {role:<8} {nbytes / GIB:8.2f} GiB   ({how})")
        for line in format_plan(items, args.budget_gib):
            print(line)
        print("(a 48 GB card holds 44.7 GiB; an 80 GB card 74.5 GiB; activations and CUDA context come on top)")
    if args.budget_gib is not None:
        over = {d: t / GIB for d, t in totals.items() if t / GIB > args.budget_gib}
        for device, gib in over.items():
            who = ", ".join(sorted({it.what.split()[0] for it in items if it.device == device}))
            print(f"error: device {device} ({who}) needs {gib:.2f} GiB > budget {args.budget_gib:g} GiB; use the "
                  "recompute target context, a local window, fewer blocks, --text-encoder-device cpu or a larger "
                  "device", file=sys.stderr)
        if over:
            return 2
    return 0


def _prompts_for_sweep(args) -> tuple[list[tuple[int, str]], dict]:
    """The selected (index, prompt) pairs and what identifies them (file, sha256, counts). Errors
    (missing or empty file, blank lines, nothing selected) raise ValueError: exit 2, before any model loads."""
    from sdvg.evaluation.sweep import sha256_file

    path = Path(args.prompts_file) if args.prompts_file else DEFAULT_PROMPTS
    if not path.is_file():
        raise ValueError(f"prompts file {path} not found; pass --prompts-file")
    prompts = read_prompts(path)
    selected = list(enumerate(prompts[: args.limit] if args.limit else prompts))
    if not selected:
        raise ValueError(f"no prompt selected from {path}")
    return selected, {"prompts_file": str(path), "prompts_sha256": sha256_file(path), "prompt_count": len(prompts),
                      "limit": args.limit}


def _taus(text: str) -> list[float]:
    """--taus: a comma list of numbers (inf / -inf allowed), or `paper` (the paper's seven values)."""
    from sdvg.evaluation.sweep import PAPER_TAUS

    if text.strip().lower() == "paper":
        return list(PAPER_TAUS)
    parse = option_type("tau")
    taus = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not taus:
        raise argparse.ArgumentTypeError(f"--taus {text!r} holds no value; e.g. --taus=-1.5,-0.7 or --taus paper")
    return list(dict.fromkeys(taus))


def _sweep_pipeline(args):
    """Under torchrun each process takes its own GPU pair (or GPU), unless devices are given."""
    import torch

    from sdvg.evaluation.sweep import dist_env

    rank, world, local = dist_env()
    if world > 1 and args.device == "cpu" and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n >= 2 * world:
            args.device, args.target_device = f"cuda:{2 * local}", f"cuda:{2 * local + 1}"
        else:
            args.device = f"cuda:{local % n}"
    return build_pipeline(args), rank, world


def _sweep_setup(args, opts):
    """Everything a sweep checks before any model loads: the prompts, the options, the folder's
    configuration (its manifest and records). Returns (prompts, manifest)."""
    import sdvg
    from sdvg.config import config_hash, get_preset
    from sdvg.evaluation.evaluators import check_evaluator
    from sdvg.evaluation.sweep import build_manifest, prepare_folder

    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    check_evaluator(args.evaluator)  # names, packages, weights: before the folder or any model
    prompts, source = _prompts_for_sweep(args)
    preset = get_preset(args.preset)
    opts = opts.resolved(preset, BACKENDS[0])
    _announce_protocol(args, preset, opts)
    flags = {k: getattr(args, k) for k in ("drafter", "target", "vae", "reward", "reward_tokenizer", "text_encoder",
                                           "engines", "device", "target_device")}
    manifest = build_manifest(opts, preset=args.preset, preset_fingerprint=config_hash(preset), checkpoint_flags=flags,
                              evaluator=args.evaluator, repeats=args.repeats, warmup=args.warmup,
                              sdvg_version=sdvg.__version__, **source)
    prepare_folder(Path(args.out), manifest, prompts)
    return prompts, opts


def _run_sweep(args, prompts, opts, taus, draft: bool, label: str):
    """Load the pipeline (once the folder is checked), then run the sweep's missing pairs."""
    from sdvg.evaluation.evaluators import load_evaluator
    from sdvg.evaluation.sweep import check_checkpoints, dist_env, missing_pairs, run_sweep

    out = Path(args.out)
    rank, world, _ = dist_env()
    if not missing_pairs(out, prompts, taus, rank, world, draft):
        _progress(args, f"{label}every (prompt, method) pair of this configuration is in {out} already")
        return rank, world
    pipe, rank, world = _sweep_pipeline(args)
    check_checkpoints(out, pipe.provenance())
    evaluator = load_evaluator(args.evaluator, pipe)

    def progress(r):
        acc = "n/a" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
        _progress(args, f"{label}[{r['prompt_index']}] {r['mode']}" + (f" tau={r['tau']:g}" if r["mode"] == "sdvg"
                                                                         else "")
                  + f": acceptance {acc}, {r['wall_s']:.2f} s (min {r['wall_s_min']:.2f}), quality {r['quality']:.4f}")

    run_sweep(pipe, prompts, taus, out, evaluator, opts, rank=rank, world=world, progress=progress,
              repeats=args.repeats, warmup=args.warmup, draft=draft, evaluator_name=args.evaluator)
    return rank, world


def _unpublished(taus: list[float]) -> list[float]:
    """Under `--taus paper`: its values that the paper does not publish (-1.25, -1.75, -2.0); else []."""
    from sdvg.evaluation.sweep import PAPER_TAUS, PUBLISHED_PAPER_TAUS

    return [t for t in taus if t not in PUBLISHED_PAPER_TAUS] if list(taus) == list(PAPER_TAUS) else []


def cmd_sweep(args) -> int:
    from sdvg.evaluation.report import write_reports
    from sdvg.evaluation.sweep import read_records, summarise

    out = Path(args.out)
    if not args.report_only:
        prompts, opts = _sweep_setup(args, options_from_args(args))
        if _unpublished(args.taus):
            _progress(args, f"note: taus {', '.join(f'{t:g}' for t in _unpublished(args.taus))} are not published "
                            "values (the paper names only -0.7, -1.0, -1.5 and -2.5 of its seven)")
        rank, world = _run_sweep(args, prompts, opts, args.taus, draft=True, label="")
        if world > 1 and rank != 0:
            return 0
    records = read_records(out)
    if not records:
        raise ValueError(f"{out} holds no sweep records")
    summary = summarise(records)
    paths = write_reports(summary, out)
    print(paths["report.md"].read_text(encoding="utf-8"))
    print(f"reports in {out}: " + ", ".join(p.name for p in paths.values()), file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from sdvg.evaluation.sweep import (calibrate_acceptance, calibrate_retention, read_records, retention_formula,
                                       retention_goal, summarise)
    from sdvg.generation.types import strict_json

    goals = [g for g in ("acceptance", "retention", "quality_drop") if getattr(args, g) is not None]
    if len(goals) != 1:
        raise ValueError("give exactly one of --acceptance A, --quality-drop D or --retention R")
    out = Path(args.out)
    if args.acceptance is not None:
        opts = options_from_args(args, mode="sdvg")
        if opts.router != "reward":
            raise ValueError(f"--acceptance calibrates tau, which only the reward router reads (not {opts.router!r})")
        prompts, _ = _prompts_for_sweep(args)
        out.mkdir(parents=True, exist_ok=True)
        pipe, _, _ = _sweep_pipeline(args)
        own = opts.drafter_context == "own"

        def run_all(tau: float, what: str) -> tuple[list[float], float | None]:
            """Every prompt at tau: the draft scores of blocks 1..B-1 and the mean acceptance."""
            scores, rates = [], []
            for n, (i, prompt) in enumerate(prompts):
                _progress(args, f"calibrate: {what} on prompt {n + 1}/{len(prompts)}")
                stats = pipe.generate(prompt, opts.replace(tau=tau)).stats
                scores += [b["score"] for b in stats.blocks[1:] if b["score"] is not None]
                rates += [] if stats.acceptance_rate is None else [stats.acceptance_rate]
            return scores, (sum(rates) / len(rates) if rates else None)

        scores, _ = run_all(-math.inf, "every draft scored, all accepted")
        rounds = []
        for k in range(3):  # re-derive tau from the scores of the drafts made under the last tau
            tau = calibrate_acceptance(scores, args.acceptance)
            if any(r["tau"] == tau for r in rounds):
                break
            n_scores = len(scores)
            scores, achieved = run_all(tau, f"check tau={tau:.4f}")
            rounds.append({"tau": tau, "draft_scores": n_scores, "achieved_acceptance": achieved})
            if achieved is not None and abs(achieved - args.acceptance) < 1e-9:
                break
        best = min(rounds, key=lambda r: math.inf if r["achieved_acceptance"] is None
                   else abs(r["achieved_acceptance"] - args.acceptance))
        note = ("under --drafter-context own the drafts do not depend on tau; their scores still do, slightly, "
                "through the VAE's causal cache (a draft is decoded after the previous emitted block), so tau was "
                "re-derived from the scores under the previous tau (rounds)"
                if own else
                "under --drafter-context committed a draft depends on the earlier decisions, so the scores shift "
                "with tau; tau was re-derived from the drafts made under the previous tau (rounds)")
        note += "; achieved_acceptance is what the chosen tau gives"
        result = {"goal": {"acceptance": args.acceptance}, "tau": best["tau"], "draft_scores": best["draft_scores"],
                  "drafter_context": opts.drafter_context, "drafts_independent_of_tau": own, "note": note,
                  "achieved_acceptance": best["achieved_acceptance"], "rounds": rounds, "prompts": len(prompts),
                  "options": opts.replace(tau=best["tau"]).as_dict()}
    else:
        prompts, opts = _sweep_setup(args, options_from_args(args, mode="sdvg"))
        _run_sweep(args, prompts, opts, args.taus, draft=False, label="calibrate: ")
        summary = summarise(read_records(out))
        best = calibrate_retention(summary, retention=args.retention, quality_drop=args.quality_drop)
        positive = summary["quality_positive"]
        goal = retention_goal(positive, args.retention, args.quality_drop)
        result = {"goal": {"retention": args.retention} if args.retention is not None else
                  {"quality_drop": args.quality_drop},
                  "retention_kind": summary["retention_kind"], "least_retention": goal, "tau": best["tau"],
                  "achieved": best, "prompts": summary["prompts"],
                  "note": f"retention is {summary.get('retention_formula') or retention_formula(positive)}"
                          + (" (the metric is declared positive)" if positive else
                             " (the metric's scores may be negative)"),
                  "unpublished_taus": _unpublished(args.taus)}
    (out / "calibration.json").write_text(strict_json(result, indent=2))
    print(strict_json(result, indent=2))
    if not args.quiet and "note" in result:
        print(result["note"], file=sys.stderr)
    return 0


EXIT_CALIBRATION_EXCLUDE = ("mode", "tau", "seed", "early_exit", "exit_verifier", "exit_thresholds", "exit_head",
                            "exit_pattern_steps")


def _seeds(text: str) -> list[int]:
    """--seeds: a comma list of seeds (integers >= 0)."""
    parse = option_type("seed")
    seeds = [parse(t.strip()) for t in text.split(",") if t.strip()]
    if not seeds:
        raise argparse.ArgumentTypeError(f"--seeds {text!r} holds no seed; e.g. --seeds 0,1")
    return list(dict.fromkeys(seeds))


def _exit_prompts(args, extra: int = 0) -> tuple[list[str], dict]:
    """The prompts of calibrate-exit / train-exit-head: --prompt (repeatable) or --num-prompts (+ `extra`)
    lines of --prompts-file from --offset. Errors raise ValueError (exit 2) before any model loads."""
    if getattr(args, "prompt", None):
        if args.prompts_file:
            raise ValueError("give either --prompt or --prompts-file")
        if any(not p.strip() for p in args.prompt):
            raise ValueError("--prompt is empty; give a non-empty prompt")
        return list(args.prompt), {"prompts": list(args.prompt)}
    from sdvg.evaluation.sweep import sha256_file

    path = Path(args.prompts_file) if args.prompts_file else DEFAULT_PROMPTS
    every = read_prompts(path)
    want = args.num_prompts + extra
    prompts = every[args.offset:args.offset + want]
    if len(prompts) < want:
        raise ValueError(f"{path} holds {len(every)} prompts: --offset {args.offset} leaves {len(prompts)}, "
                         f"{want} are needed")
    return prompts, {"prompts_file": str(path), "prompts_sha256": sha256_file(path), "offset": args.offset}


def _exit_base_options(args):
    """The generation options of the rollouts; the single-role mode's rules checked before any model loads."""
    from sdvg.config import get_preset
    from sdvg.evaluation.exit_calibration import role_options

    base = options_from_args(args)
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    role_options(base, args.role, 0).resolved(get_preset(args.preset))
    return base


def _bar(args, total: int, desc: str, unit: str, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=args.quiet, file=sys.stderr)


def _collect(args, pipe, prompts, seeds, base, keep_hidden: bool, what: str):
    from sdvg.evaluation.exit_calibration import collect

    bar = _bar(args, len(prompts) * len(seeds), what, "video")
    try:
        return collect(pipe, prompts, seeds, base, args.role, keep_hidden, progress=lambda done, total: bar.update(1))
    finally:
        bar.close()


def cmd_calibrate_exit(args) -> int:
    """Oracle rollouts on held-out prompts -> (tau_red, tau_stab) for --exit-eps, the per-step report, and
    the k_bar those thresholds give when generating (docs/early-exit.md, "Calibrating the thresholds")."""
    from sdvg.evaluation.exit_calibration import calibrate, measure_mean_steps
    from sdvg.generation.types import strict_json
    from sdvg.io.outputs import check_output_paths

    prompts, source = _exit_prompts(args)
    out = Path(args.out)
    check_output_paths(out=out)
    base = _exit_base_options(args)
    pipe = build_pipeline(args)
    records = _collect(args, pipe, prompts, args.seeds, base, False, "oracle rollouts")
    result = calibrate(records, base.exit_eps, args.min_precision, args.rule)
    bar = _bar(args, len(prompts) * len(args.seeds), "generate with the thresholds", "video")
    try:
        measured = measure_mean_steps(pipe, prompts, args.seeds, base, args.role, tuple(result["thresholds"]),
                                      progress=lambda done, total: bar.update(1))
    finally:
        bar.close()
    red, stab = result["thresholds"]
    from sdvg.evaluation.exit_calibration import role_mode

    flags = (f"--mode {role_mode(args.role)} --early-exit {args.role} --exit-verifier stability "
             f"--exit-thresholds {red!r},{stab!r}")
    result = {"role": args.role, **result, "measured_mean_steps": measured["mean_steps"],
              "measured_per_video": measured["per_video"], "flags": flags, "seeds": args.seeds,
              "prompt_count": len(prompts), **source,
              "options": base.replace(mode=role_mode(args.role), early_exit=args.role).as_dict(),
              "provenance": pipe.provenance()}
    write_text_atomic(out, strict_json(result, indent=2))
    _progress(args, f"k_bar {measured['mean_steps']:.3f} measured with thresholds {red:.4g},{stab:.4g} "
                    f"(oracle at eps {base.exit_eps:g}: {result['oracle_mean_steps']:.3f}); report in {out}")
    print(flags)
    return 0


def cmd_train_exit_head(args) -> int:
    """Train the exit head on the hidden states and oracle gaps of recorded rollouts; report its AUROC on
    held-out rollouts beside the stability verifier's (docs/early-exit.md, "Training the head")."""
    from dataclasses import asdict

    from sdvg.evaluation import exit_calibration as ec
    from sdvg.generation.types import strict_json

    if set(args.seeds) & set(args.heldout_seeds):
        raise ValueError(f"--heldout-seeds {args.heldout_seeds} share seeds with --seeds {args.seeds}; held-out "
                         "rollouts must use seeds not used in training")
    every, source = _exit_prompts(args, extra=args.heldout_prompts)
    train_prompts, heldout_prompts = every[:args.num_prompts], every[args.num_prompts:]
    out = Path(args.out)
    paths = {n: out / f for n, f in (("records", "records.safetensors"), ("heldout", "heldout.safetensors"),
                                     ("checkpoint", "checkpoint.safetensors"), ("head", "head.safetensors"),
                                     ("report", "train.json"))}
    if paths["checkpoint"].exists() and not args.resume:
        raise ValueError(f"{out} holds a training checkpoint; pass --resume to continue it or another --out")
    config = ec.TrainConfig(args.steps, args.batch_size, args.lr, args.train_seed, args.checkpoint_every)
    base = _exit_base_options(args)
    pipe = build_pipeline(args)
    prov = pipe.provenance()
    generator = {"role": args.role, "preset": args.preset, "preset_fingerprint": prov["preset_fingerprint"],
                 "checkpoint": prov["checkpoints"].get(args.role)}
    out.mkdir(parents=True, exist_ok=True)

    def records_for(name: str, prompts, seeds):
        meta = {"prompts": prompts, "seeds": seeds, "options": base.as_dict(), "generator": generator}
        if args.resume and paths[name].is_file():
            records, saved = ec.load_records(paths[name])
            if saved == json.loads(json.dumps(meta)):
                return records
            _progress(args, f"{paths[name]} was recorded for other prompts, seeds or options: recording again")
        records = _collect(args, pipe, prompts, seeds, base, True, f"{name} rollouts")
        ec.save_records(paths[name], records, meta)
        return records

    train_records = records_for("records", train_prompts, args.seeds)
    heldout = records_for("heldout", heldout_prompts, args.heldout_seeds)
    dim = int(train_records.hidden.shape[-1])
    resumed_from = None
    if args.resume and paths["checkpoint"].is_file():
        state, _ = ec.load_checkpoint(paths["checkpoint"], config)
        resumed_from = state.step
    else:
        state = ec.new_state(dim, config)
    initial_loss = ec.dataset_loss(ec.new_state(dim, config).head, train_records)
    bar = _bar(args, config.steps, "train exit head", "step", initial=state.step)

    def progress(step, loss):
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")

    try:
        ec.train(state, train_records, config, progress,
                 checkpoint=lambda st: ec.save_checkpoint(paths["checkpoint"], st, config, {"generator": generator}))
    finally:
        bar.close()
    final_loss = ec.dataset_loss(state.head, train_records)
    state.head.save(paths["head"], extra={"training_prompts": len(train_prompts), "training_seeds": args.seeds,
                                          "steps": state.step, "final_loss": final_loss, "eps": base.exit_eps,
                                          "generator": generator})
    report = {"head": str(paths["head"]), "config": asdict(config), "role": args.role, "eps": base.exit_eps,
              "generator": generator, "parameters": state.head.num_parameters, "steps_done": state.step,
              "resumed_from": resumed_from, "initial_loss": initial_loss, "final_loss": final_loss,
              "loss_first_batches": state.losses[:10], "loss_last_batches": state.losses[-10:],
              "train": {"prompts": len(train_prompts), "seeds": args.seeds, "rows": len(train_records)},
              "heldout": {"prompts": len(heldout_prompts), "seeds": args.heldout_seeds, "rows": len(heldout),
                          **ec.evaluate_head(state.head, heldout, base.exit_eps)},
              **source, "options": base.as_dict()}
    write_text_atomic(paths["report"], strict_json(report, indent=2))
    for st in report["heldout"]["steps"]:
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        _progress(args, f"held-out k={st['k']}: AUROC head {fmt(st['head_auroc'])}, stability "
                        f"{fmt(st['stability_auroc'])} ({st['converged_share']:.1%} converged at eps {base.exit_eps:g})")
    _progress(args, f"loss {initial_loss:.4f} -> {final_loss:.4f}; head in {paths['head']}, report in "
                    f"{paths['report']}")
    from sdvg.evaluation.exit_calibration import role_mode

    print(f"--mode {role_mode(args.role)} --early-exit {args.role} --exit-verifier head --exit-head {paths['head']} "
          f"--exit-eps {base.exit_eps!r}")
    return 0


def _add_exit_calibration_args(sp, name: str) -> None:
    add_generation_args(sp, exclude=EXIT_CALIBRATION_EXCLUDE)
    sp.add_argument("--role", choices=("target", "drafter"), default="target",
                    help="whose denoising loop is recorded (run alone: mode target or draft)")
    if name == "calibrate-exit":
        sp.add_argument("--prompt", action="append", help="a prompt (repeatable; or --prompts-file)")
    sp.add_argument("--prompts-file", help=f"one prompt per line (default: {DEFAULT_PROMPTS})")
    sp.add_argument("--offset", type=_count(0), default=0, help="skip the first N prompts of the file (e.g. those "
                                                                  "a head was trained on)")
    sp.add_argument("--num-prompts", type=_count(1), default=4, help="prompts of the file to record (default: 4)")
    sp.add_argument("--seeds", type=_seeds, default="0", help="comma list of seeds, one video per prompt and seed")
    sp.add_argument("--quiet", action="store_true", help="no progress bars")


def _progress(args, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def build_parser(config: dict | None = None) -> argparse.ArgumentParser:
    """The command line; `config` (from --config) sets the generation options' defaults, so flags
    given on the command line still win."""
    parser = argparse.ArgumentParser(prog="sdvg", description="speculative decoding for video diffusion")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate videos (MP4 written as blocks arrive)")
    add_generation_args(g)
    g.add_argument("--prompt", help="one text prompt (or --prompts-file)")
    g.add_argument("--prompt-schedule", metavar="FILE", help="a JSON/YAML list of {block, prompt, interp_blocks} (docs/live.md)")
    g.add_argument("--prompts-file", help="one prompt per line (e.g. sdvg/data/MovieGenVideoBench.txt)")
    g.add_argument("--offset", type=_count(0), default=0, help="skip the first N prompts of --prompts-file")
    g.add_argument("--limit", type=_count(0), default=0, help="at most N prompts (0 = all)")
    g.add_argument("--out", default="video.mp4", help="the MP4 (with --prompts-file: <stem>_<line>.mp4 per prompt)")
    g.add_argument("--stats", help="statistics (docs/stats.md): JSON, or JSON Lines with --prompts-file; "
                                   "default: --out with .json / .jsonl")
    g.add_argument("--fps", type=float, default=DEFAULT_FPS,
                   help=f"frames per second of the MP4 (default: {DEFAULT_FPS}, Wan2.1's)")
    g.add_argument("--crf", type=_count(0, 51), default=DEFAULT_CRF,
                   help=f"libx264 quality, 0 (lossless) to 51 (default: {DEFAULT_CRF})")
    g.add_argument("--resume", action="store_true", help="skip prompts already in the stats JSONL")
    g.add_argument("--timeline", help="PNG of every stage call on the drafter / VAE+reward / target lanes "
                                      "(one per prompt with --prompts-file)")
    g.add_argument("--exit-map", help="PNG heat map of the denoising steps each token of each emitted block took "
                                      "(with --early-exit; with --prompts-file: <stem>_<line>.png per prompt)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("config", help="print the resolved generation options (--config file, then flags)")
    add_option_flags(c)
    c.set_defaults(func=cmd_config)
    for p in (g, c):
        _add_config(p, config)
    m = sub.add_parser("memory", help="resident memory per device (weights, KV caches per context mode, prompt K/V, "
                                      "VAE, ImageReward, umT5), computed before allocating")
    m.add_argument("--preset", default="wan2.1")
    m.add_argument("--device", "--drafter-device", dest="device", default="cuda:0",
                   help="drafter, VAE and reward device (a label here)")
    m.add_argument("--target-device", default="cuda:1", help="target device (a label; the same as --device for one "
                                                             "device)")
    m.add_argument("--text-encoder-device", help="where umT5 stays (default: --device; cpu = offloaded)")
    m.add_argument("--budget-gib", type=_real(0), help="memory of each device in GiB (a 48 GB card: 44.7)")
    m.add_argument("--json", action="store_true", help="machine-readable output")
    add_option_flags(m, only=MEMORY_OPTIONS)
    m.set_defaults(func=cmd_memory)
    for name, fn, helptext in (("sweep", cmd_sweep, "sweep tau over a prompt set; report tables, Pareto plot"),
                               ("calibrate", cmd_calibrate, "pick tau for an acceptance rate or a quality goal")):
        sp = sub.add_parser(name, help=helptext)
        add_generation_args(sp, exclude=("mode", "tau"))  # the sweep sets both per run
        sp.add_argument("--prompts-file", help=f"default: {DEFAULT_PROMPTS}")
        sp.add_argument("--limit", type=_count(0), default=8, help="first N prompts (0 = all)")
        sp.add_argument("--taus", type=_taus, default="-2.5,-1.5,-0.7,0.0,0.5",
                        help="comma list of tau values (write --taus=-0.7,... with '=' for negative values), or "
                             "'paper': -0.7,-1.0,-1.25,-1.5,-1.75,-2.0,-2.5 (the paper publishes only -0.7, -1.0, "
                             "-1.5 and -2.5 of its seven values; -1.25, -1.75, -2.0 fill the gaps)"
                             + ("" if name == "sweep" else "; used with --quality-drop / --retention"))
        sp.add_argument("--evaluator", default="imagereward",
                        help="comma list of: imagereward (the router's own model), drift (MUSIQ spread over 2-s "
                             "segments; pyiqa), vbench[:dim+dim] (the vbench package), visionreward[:<folder>] "
                             "(VisionReward-Video), python:<module>:<name> (a callable (prompt, frames uint8 "
                             "[F,H,W,3]) -> float or dict; attribute positive = True makes retention a ratio). "
                             "The first metric is the quality; see docs/evaluation.md")
        sp.add_argument("--repeats", type=_count(1), default=1,
                        help="timed runs per (prompt, method); min and median wall time are recorded (default: 1)")
        sp.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="one untimed run per method before the timed ones (default: on)")
        sp.add_argument("--out", default=f"results/{name}",
                        help="output folder; a rerun resumes into it when its configuration (sweep.json) matches")
        sp.add_argument("--quiet", action="store_true", help="no per-run progress lines")
        if name == "sweep":
            sp.add_argument("--report-only", action="store_true", help="merge shards and write the reports only")
        else:
            sp.add_argument("--acceptance", type=_real(0, 1), help="wanted acceptance rate of blocks 1..B-1, in [0, 1]")
            sp.add_argument("--quality-drop", type=_real(0), metavar="D",
                            help="quality one accepts to lose vs target-only: the fastest swept tau with "
                                 "q - q_target >= -D (or, for a positive evaluator, q / q_target >= 1 - D)")
            sp.add_argument("--retention", type=_real(), metavar="R",
                            help="least retention in the evaluator's own form: a difference q - q_target "
                                 "(e.g. --retention=-0.01) or, for a positive evaluator, a ratio (e.g. 0.98)")
        sp.set_defaults(func=fn)
        _add_config(sp, {k: v for k, v in (config or {}).items() if k not in ("mode", "tau")})
    ce = sub.add_parser("calibrate-exit", help="pick the stability verifier's thresholds for an oracle eps "
                                                "(docs/early-exit.md)")
    _add_exit_calibration_args(ce, "calibrate-exit")
    ce.add_argument("--min-precision", type=_real(0, 1), default=0.95,
                    help="rule precision: the largest threshold whose precision (share of exiting tokens with "
                         "rel_k < eps) is at least this (default: 0.95)")
    ce.add_argument("--rule", choices=("precision", "f1"), default="precision",
                    help="precision (default; --min-precision) or f1 (the threshold of the largest F1)")
    ce.add_argument("--out", default="results/exit-calibration.json", help="the JSON report")
    ce.set_defaults(func=cmd_calibrate_exit)
    te = sub.add_parser("train-exit-head", help="train the learned exit verifier on oracle rollouts "
                                                 "(docs/early-exit.md)")
    _add_exit_calibration_args(te, "train-exit-head")
    te.add_argument("--heldout-prompts", type=_count(1), default=1,
                    help="prompts after the training ones, recorded with --heldout-seeds for the report (default: 1)")
    te.add_argument("--heldout-seeds", type=_seeds, default="1", help="seeds of the held-out rollouts (not in --seeds)")
    te.add_argument("--steps", type=_count(1), default=300, help="optimizer steps in all (default: 300)")
    te.add_argument("--batch-size", type=_count(1), default=4, help="record rows per step (default: 4)")
    te.add_argument("--lr", type=_real(0), default=1e-3, help="Adam's learning rate (default: 1e-3)")
    te.add_argument("--train-seed", type=_count(0), default=0, help="the head's initial weights and batch draws")
    te.add_argument("--checkpoint-every", type=_count(1), default=100, help="steps between checkpoints")
    te.add_argument("--out", default="results/exit-head", help="folder: head.safetensors, train.json, the "
                                                               "checkpoint and the recorded rollouts")
    te.add_argument("--resume", action="store_true", help="continue the checkpoint in --out (and reuse its "
                                                          "recorded rollouts when they match)")
    te.set_defaults(func=cmd_train_exit_head)
    for sp in (ce, te):
        _add_config(sp, {k: v for k, v in (config or {}).items() if k not in EXIT_CALIBRATION_EXCLUDE})
    return parser


def _add_config(p: argparse.ArgumentParser, config: dict | None) -> None:
    p.add_argument("--config", help="YAML or JSON file of generation options (keys: the option names); "
                                    "flags given here override it")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS),
                   help="a named protocol: paper = the SDVG paper's loop (drafter on its own drafts, block 0 from "
                        "the target, worst-frame score, 9 blocks, seed 42); a --config file and flags override it")
    if config:
        p.set_defaults(**config)


def _config_values(argv: list[str]) -> dict:
    """The option defaults of `--protocol NAME`, then of `--config FILE` on top (read before the full
    parse; errors exit 2 naming the file)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--protocol")
    known, _ = pre.parse_known_args(argv)
    values = dict(PROTOCOLS.get(known.protocol, {}))  # an unknown name is refused by the full parse
    if not known.config:
        return values
    from sdvg.options import OptionError, load_options_file

    try:
        return {**values, **load_options_file(known.config)}
    except OptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _announce_protocol(args, preset, opts) -> None:
    """Say what --protocol set (and the resolution it keeps)."""
    if getattr(args, "protocol", None) and not getattr(args, "quiet", False):
        from sdvg.options import describe_protocol

        for line in describe_protocol(args.protocol, opts, preset.video.height, preset.video.width,
                                      preset.random_weights):
            print(line, file=sys.stderr)


def cmd_config(args) -> int:
    """Print the resolved generation options (config file, then flags) as YAML."""
    import yaml

    print(yaml.safe_dump(options_from_args(args).as_dict(), sort_keys=False), end="")
    return 0


# Exit statuses (README): 0 done; 2 bad arguments or input files (found before or while loading: an
# option, a path, a prompts file, a checkpoint, a config); 1 a runtime failure (a device, the disk, the
# encoder); 128 + the signal when interrupted: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP.
EXIT_BAD_INPUT, EXIT_RUNTIME = 2, 1


def main(argv=None) -> int:
    from sdvg.io.interrupts import exit_code_of, signals_interrupt
    from sdvg.config import MemoryBudgetError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_config_values(argv)).parse_args(argv)
    try:
        with signals_interrupt():  # before the first block too (loading): exit 128 + signal, no traceback
            return args.func(args)
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc.args[0] if exc.args else 'SIGINT'})", file=sys.stderr)
        return exit_code_of(exc)
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, MemoryBudgetError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # a budget refusal comes before any allocation: the arguments
        return EXIT_BAD_INPUT
    except (RuntimeError, OSError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
