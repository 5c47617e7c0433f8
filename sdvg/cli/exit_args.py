"""What `sdvg calibrate-exit` and `sdvg train-exit-head` share: their flags, the options of the
rollouts (checked before any model loads) and their progress bars."""
from __future__ import annotations

from contextlib import contextmanager

from sdvg.options import options_from_args

from sdvg.cli.args import add_config, add_generation_args, bar, check_preset, count, seeds
from sdvg.cli.prompts import DEFAULT_PROMPTS

# Options the commands set per rollout (mode, tau, seed, the early-exit verifier): no flag for them.
EXIT_CALIBRATION_EXCLUDE = ("mode", "tau", "seed", "early_exit", "exit_verifier", "exit_thresholds", "exit_head",
                            "exit_pattern_steps")


def add_exit_calibration_args(sub, name: str, helptext: str):
    sp = sub.add_parser(name, help=helptext)
    add_generation_args(sp, exclude=EXIT_CALIBRATION_EXCLUDE)
    sp.add_argument("--role", choices=("target", "drafter"), default="target",
                    help="whose denoising loop is recorded (run alone: mode target or draft)")
    if name == "calibrate-exit":
        sp.add_argument("--prompt", action="append", help="a prompt (repeatable; or --prompts-file)")
    sp.add_argument("--prompts-file", help=f"one prompt per line (default: {DEFAULT_PROMPTS})")
    sp.add_argument("--offset", type=count(0), default=0, help="skip the first N prompts of the file (e.g. those "
                                                                 "a head was trained on)")
    sp.add_argument("--num-prompts", type=count(1), default=4, help="prompts of the file to record (default: 4)")
    sp.add_argument("--seeds", type=seeds, default="0", help="comma list of seeds, one video per prompt and seed")
    sp.add_argument("--quiet", action="store_true", help="no progress bars")
    return sp


def add_exit_config(sp, config: dict | None) -> None:
    """--config / --protocol, without the options the commands set per rollout."""
    add_config(sp, {k: v for k, v in (config or {}).items() if k not in EXIT_CALIBRATION_EXCLUDE})


def base_options(args):
    """The generation options of the rollouts; the single-role mode's rules checked before any model loads."""
    from sdvg.config import get_preset
    from sdvg.evaluation.exit_calibration import role_options

    base = options_from_args(args)
    check_preset(args.preset)
    role_options(base, args.role, 0).resolved(get_preset(args.preset))
    return base


def bar_phase(args):
    """The `phase` of `sdvg.evaluation.calibration`: a tqdm bar per phase, off under --quiet."""
    @contextmanager
    def phase(desc: str, total: int, unit: str, initial: int = 0):
        b = bar(args, total, desc, unit, initial=initial)
        try:
            yield b
        finally:
            b.close()
    return phase
