"""`sdvg calibrate`: pick tau for a wanted acceptance rate (--acceptance) or a quality goal
(--quality-drop / --retention, over a sweep); the algorithms are `sdvg.evaluation.calibration`'s."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from sdvg.io.outputs import write_text_atomic
from sdvg.options import options_from_args

from sdvg.cli import sweep
from sdvg.cli.exit_args import bar_phase
from sdvg.cli.args import real, say
from sdvg.cli.pipelines import place_for_torchrun
from sdvg.cli.prompts import sweep_prompts


def add_parser(sub, config: dict | None) -> None:
    sp = sweep.add_sweep_args(sub, "calibrate", "pick tau for an acceptance rate or a quality goal", config)
    sp.add_argument("--acceptance", type=real(0, 1), help="wanted acceptance rate of blocks 1..B-1, in [0, 1]")
    sp.add_argument("--quality-drop", type=real(0), metavar="D",
                    help="quality one accepts to lose vs target-only: the fastest swept tau with "
                         "q - q_target >= -D (or, for a positive evaluator, q / q_target >= 1 - D)")
    sp.add_argument("--retention", type=real(), metavar="R",
                    help="least retention in the evaluator's own form: a difference q - q_target "
                         "(e.g. --retention=-0.01) or, for a positive evaluator, a ratio (e.g. 0.98)")
    sp.set_defaults(func=run)
    sweep.add_sweep_config(sp, config)


CONFIG_FILE = "config.json"  # beside calibration.json: a file `--config` accepts


def calibrated_config(args, opts, tau: float) -> dict:
    """The calibrated run as a `--config` file: the model flags given (preset always), then every
    generation option that differs from its default, and tau (non-finite values as the strings the
    flags take: "inf", "-inf")."""
    import math

    from sdvg.cli.args import MODEL_CONFIG_KEYS
    from sdvg.options import GenerationOptions

    config = {"preset": args.preset}
    for key in MODEL_CONFIG_KEYS:
        value = getattr(args, key, None)
        if key != "preset" and value not in (None, False):
            config[key] = value
    defaults = GenerationOptions().as_dict()
    chosen = opts.replace(tau=tau).as_dict()
    for name, value in chosen.items():
        if name == "tau" or value != defaults[name]:
            config[name] = value if not (isinstance(value, float) and not math.isfinite(value)) else str(value)
    return config


def run(args, load_pipeline) -> int:
    from sdvg.evaluation.calibration import calibrate_for_acceptance, calibrate_for_quality
    from sdvg.evaluation.sweep import read_records, summarise
    from sdvg.generation.types import strict_json

    goals = [g for g in ("acceptance", "retention", "quality_drop") if getattr(args, g) is not None]
    if len(goals) != 1:
        raise ValueError("give exactly one of --acceptance A, --quality-drop D or --retention R")
    out = Path(args.out)
    if args.acceptance is not None:
        opts = options_from_args(args, mode="sdvg")
        if opts.router != "reward":
            raise ValueError(f"--acceptance calibrates tau, which only the reward router reads (not {opts.router!r})")
        prompts, _ = sweep_prompts(args)
        out.mkdir(parents=True, exist_ok=True)
        place_for_torchrun(args)
        result = calibrate_for_acceptance(load_pipeline(args), prompts, opts, args.acceptance,
                                          say=lambda line: say(args, line), phase=bar_phase(args))
    else:
        prompts, opts = sweep.setup(args, options_from_args(args, mode="sdvg"))
        sweep.run_missing(args, load_pipeline, prompts, opts, args.taus, draft=False, label="calibrate: ")
        result = calibrate_for_quality(summarise(read_records(out)), retention=args.retention,
                                       quality_drop=args.quality_drop, unpublished_taus=sweep.unpublished(args.taus))
    write_text_atomic(out / "calibration.json", strict_json(result, indent=2))
    config = calibrated_config(args, opts, result["tau"])
    write_text_atomic(out / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    say(args, f"{out / CONFIG_FILE}: the calibrated tau with this run's model flags and options; "
              f"`sdvg generate --config {out / CONFIG_FILE} --prompt ...` runs with them")
    print(strict_json(result, indent=2))
    if not args.quiet and "note" in result:
        print(result["note"], file=sys.stderr)
    return 0
