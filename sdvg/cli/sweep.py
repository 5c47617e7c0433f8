"""`sdvg sweep`: tau swept over a prompt set (resumable, sharded under torchrun), then the report tables
and the Pareto plot; the flags and folder checks it shares with `sdvg calibrate`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdvg.options import BACKENDS, options_from_args

from sdvg.cli.args import add_config, add_generation_args, bar, check_preset, count, say, taus
from sdvg.cli.pipelines import announce_protocol, place_for_torchrun
from sdvg.cli.prompts import DEFAULT_PROMPTS, sweep_prompts


def add_parser(sub, config: dict | None) -> None:
    sp = add_sweep_args(sub, "sweep", "sweep tau over a prompt set; report tables, Pareto plot", config)
    sp.add_argument("--report-only", action="store_true", help="merge shards and write the reports only")
    sp.set_defaults(func=run)
    add_sweep_config(sp, config)


def add_sweep_args(sub, name: str, helptext: str, config: dict | None) -> argparse.ArgumentParser:
    """The flags sweep and calibrate share (the sweep sets mode and tau per run)."""
    sp = sub.add_parser(name, help=helptext)
    add_generation_args(sp, exclude=("mode", "tau"))
    sp.add_argument("--prompts-file", help=f"default: {DEFAULT_PROMPTS}")
    sp.add_argument("--limit", type=count(0), default=8, help="first N prompts (0 = all)")
    sp.add_argument("--taus", type=taus, default="-2.5,-1.5,-0.7,0.0,0.5",
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
    sp.add_argument("--repeats", type=count(1), default=1,
                    help="timed runs per (prompt, method); min and median wall time are recorded (default: 1)")
    sp.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one untimed run per method before the timed ones (default: on)")
    sp.add_argument("--out", default=f"results/{name}",
                    help="output folder; a rerun resumes into it when its configuration (sweep.json) matches")
    sp.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    return sp


def add_sweep_config(sp, config: dict | None) -> None:
    """--config / --protocol, without the mode and tau the sweep sets per run."""
    add_config(sp, {k: v for k, v in (config or {}).items() if k not in ("mode", "tau")})


def setup(args, opts):
    """Everything a sweep checks before any model loads: the prompts, the options, the folder's
    configuration (its manifest and records). Returns (prompts, resolved options)."""
    import sdvg
    from sdvg.config import config_hash, get_preset
    from sdvg.evaluation.evaluators import check_evaluator
    from sdvg.evaluation.sweep import build_manifest, prepare_folder

    check_preset(args.preset)
    check_evaluator(args.evaluator)  # names, packages, weights: before the folder or any model
    prompts, source = sweep_prompts(args)
    preset = get_preset(args.preset)
    opts = opts.resolved(preset, BACKENDS[0])
    announce_protocol(args, preset, opts)
    flags = {k: getattr(args, k) for k in ("drafter", "target", "vae", "reward", "reward_tokenizer", "text_encoder",
                                           "engines", "device", "target_device")}
    manifest = build_manifest(opts, preset=args.preset, preset_fingerprint=config_hash(preset), checkpoint_flags=flags,
                              evaluator=args.evaluator, repeats=args.repeats, warmup=args.warmup,
                              sdvg_version=sdvg.__version__, **source)
    prepare_folder(Path(args.out), manifest, prompts)
    return prompts, opts


def run_missing(args, load_pipeline, prompts, opts, tau_values, draft: bool, label: str) -> tuple[int, int]:
    """Load the pipeline (once the folder is checked), then run the sweep's missing (prompt, method)
    pairs of this process's shard; returns (rank, world)."""
    from sdvg.evaluation.evaluators import load_evaluator
    from sdvg.evaluation.sweep import check_checkpoints, dist_env, missing_pairs, run_sweep

    out = Path(args.out)
    rank, world, _ = dist_env()
    pending = missing_pairs(out, prompts, tau_values, rank, world, draft)
    if not pending:
        say(args, f"{label}every (prompt, method) pair of this configuration is in {out} already")
        return rank, world
    rank, world = place_for_torchrun(args)
    pipe = load_pipeline(args)
    check_checkpoints(out, pipe.provenance())
    evaluator = load_evaluator(args.evaluator, pipe)

    videos = bar(args, sum(len(variants) for _, _, variants in pending), f"{label}sweep".strip(), "video")

    def progress(r):  # one line per (prompt, method) above the bar, which counts them with an ETA
        acc = "n/a" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
        line = (f"{label}[{r['prompt_index']}] {r['mode']}" + (f" tau={r['tau']:g}" if r["mode"] == "sdvg" else "")
                + f": acceptance {acc}, {r['wall_s']:.2f} s (min {r['wall_s_min']:.2f}), quality {r['quality']:.4f}")
        if not args.quiet:
            videos.write(line, file=sys.stderr)
        videos.update(1)

    try:
        run_sweep(pipe, prompts, tau_values, out, evaluator, opts, rank=rank, world=world, progress=progress,
                  repeats=args.repeats, warmup=args.warmup, draft=draft, evaluator_name=args.evaluator)
    finally:
        videos.close()
    return rank, world


def unpublished(tau_values: list[float]) -> list[float]:
    """Under `--taus paper`: its values that the paper does not publish (-1.25, -1.75, -2.0); else []."""
    from sdvg.evaluation.sweep import PAPER_TAUS, PUBLISHED_PAPER_TAUS

    return [t for t in tau_values if t not in PUBLISHED_PAPER_TAUS] if list(tau_values) == list(PAPER_TAUS) else []


def run(args, load_pipeline) -> int:
    from sdvg.evaluation.report import write_reports
    from sdvg.evaluation.sweep import read_records, summarise

    out = Path(args.out)
    if not args.report_only:
        prompts, opts = setup(args, options_from_args(args))
        if unpublished(args.taus):
            say(args, f"note: taus {', '.join(f'{t:g}' for t in unpublished(args.taus))} are not published "
                      "values (the paper names only -0.7, -1.0, -1.5 and -2.5 of its seven)")
        rank, world = run_missing(args, load_pipeline, prompts, opts, args.taus, draft=True, label="")
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
