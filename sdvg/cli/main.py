"""The parser of every command and the dispatch: parse, run the command's `run(args, load_pipeline)`,
turn its errors into the exit statuses the README promises."""
from __future__ import annotations

import argparse
import sys

from sdvg.cli import calibrate, calibrate_exit, config, generate, memory, serve, sweep, train_exit_head
from sdvg.cli.args import config_values
from sdvg.cli.pipelines import Loader, build_pipeline

# In the order `sdvg --help` lists them.
COMMANDS = (generate, config, memory, sweep, calibrate, calibrate_exit, train_exit_head, serve)

# Exit statuses (README): 0 done; 2 bad arguments or input files (found before or while loading: an
# option, a path, a prompts file, a checkpoint, a config); 1 a runtime failure (a device, the disk, the
# encoder); 128 + the signal when interrupted: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP.
EXIT_BAD_INPUT, EXIT_RUNTIME = 2, 1


def build_parser(config: dict | None = None) -> argparse.ArgumentParser:
    """The command line; `config` (from --protocol / --config) sets the generation options' defaults, so
    flags given on the command line still win."""
    parser = argparse.ArgumentParser(prog="sdvg", description="speculative decoding for video diffusion")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub, config)
    return parser


def main(argv=None, load_pipeline: Loader | None = None) -> int:
    """Run one command line (default: sys.argv). `load_pipeline(args)` builds the pipeline of the
    commands that load one (default: from the preset, checkpoint and device flags)."""
    from sdvg.config import MemoryBudgetError
    from sdvg.io.exit_status import is_input_error
    from sdvg.io.interrupts import exit_code_of, signals_interrupt
    from sdvg.io.locks import lock_command_outputs
    from sdvg.io.prompts import with_prompts_file_resolved

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(config_values(argv)).parse_args(argv)
    try:
        # before the first block too (loading): exit 128 + signal, no traceback; every output locked before loading
        with signals_interrupt(), lock_command_outputs(args):
            return args.func(with_prompts_file_resolved(args), load_pipeline or build_pipeline)
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc.args[0] if exc.args else 'SIGINT'})", file=sys.stderr)
        return exit_code_of(exc)
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, MemoryBudgetError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # a budget refusal comes before any allocation: the arguments
        return EXIT_BAD_INPUT
    except (RuntimeError, OSError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT if is_input_error(exc) else EXIT_RUNTIME
