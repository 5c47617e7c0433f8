"""Command line: `sdvg generate`, `sdvg config`, `sdvg memory`, `sdvg download`, `sdvg sweep`, `sdvg calibrate`,
`sdvg calibrate-exit`, `sdvg train-exit-head`, `sdvg serve`, one module per command (parsing and dispatch only).

The generation flags are derived from `sdvg.options` (one declaration); the algorithms live in
`sdvg.evaluation` and `sdvg.pipeline`. No module here imports torch until a command runs, so
`sdvg --help` is fast."""
from sdvg.cli.args import add_generation_args, add_model_args
from sdvg.cli.exit_args import EXIT_CALIBRATION_EXCLUDE
from sdvg.cli.main import EXIT_BAD_INPUT, EXIT_RUNTIME, build_parser, main
from sdvg.cli.pipelines import build_pipeline
from sdvg.cli.prompts import DEFAULT_PROMPTS, read_prompts
from sdvg.cli.video import run_one

__all__ = ["main", "build_parser", "build_pipeline", "run_one", "read_prompts", "DEFAULT_PROMPTS", "add_model_args",
           "add_generation_args", "EXIT_CALIBRATION_EXCLUDE", "EXIT_BAD_INPUT", "EXIT_RUNTIME"]
