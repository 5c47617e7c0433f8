"""`sdvg calibrate-exit`: the stability verifier's thresholds for an oracle eps, from rollouts on
held-out prompts, with the k_bar they give; prints the flags that use them (the algorithm:
`sdvg.evaluation.calibration.calibrate_exit_thresholds`)."""
from __future__ import annotations

from pathlib import Path

from sdvg.io.outputs import write_text_atomic

from sdvg.cli.args import real, say
from sdvg.cli.exit_args import add_exit_calibration_args, add_exit_config, bar_phase, base_options
from sdvg.cli.prompts import exit_prompts


def add_parser(sub, config: dict | None) -> None:
    ce = add_exit_calibration_args(sub, "calibrate-exit", "pick the stability verifier's thresholds for an oracle "
                                                          "eps (docs/early-exit.md)")
    ce.add_argument("--min-precision", type=real(0, 1), default=0.95,
                    help="rule precision: the largest threshold whose precision (share of exiting tokens with "
                         "rel_k < eps) is at least this (default: 0.95)")
    ce.add_argument("--rule", choices=("precision", "f1"), default="precision",
                    help="precision (default; --min-precision) or f1 (the threshold of the largest F1)")
    ce.add_argument("--out", default="results/exit-calibration.json", help="the JSON report")
    ce.set_defaults(func=run)
    add_exit_config(ce, config)


def run(args, load_pipeline) -> int:
    """Oracle rollouts -> (tau_red, tau_stab) for --exit-eps, the per-step report, and the k_bar those
    thresholds give when generating (docs/early-exit.md, "Calibrating the thresholds")."""
    from sdvg.evaluation.calibration import calibrate_exit_thresholds
    from sdvg.generation.types import strict_json
    from sdvg.io.outputs import check_output_paths

    prompts, source = exit_prompts(args)
    out = Path(args.out)
    check_output_paths(out=out)
    base = base_options(args)
    result = calibrate_exit_thresholds(load_pipeline(args), prompts, args.seeds, base, args.role, args.min_precision,
                                       args.rule, source=source, phase=bar_phase(args))
    write_text_atomic(out, strict_json(result, indent=2))
    red, stab = result["thresholds"]
    say(args, f"k_bar {result['measured_mean_steps']:.3f} measured with thresholds {red:.4g},{stab:.4g} "
              f"(oracle at eps {base.exit_eps:g}: {result['oracle_mean_steps']:.3f}); report in {out}")
    print(result["flags"])
    return 0
