"""The parser of every command and the dispatch: parse, run the command's `run(args, load_pipeline)`,
turn its errors into the exit statuses the README promises."""
from __future__ import annotations

import argparse
import logging
import sys

from sdvg.cli import calibrate, calibrate_exit, config, download, generate, memory, serve, sweep, train_exit_head
from sdvg.cli.args import config_values
from sdvg.cli.pipelines import Loader, build_pipeline

# In the order `sdvg --help` lists them.
COMMANDS = (generate, config, memory, download, sweep, calibrate, calibrate_exit, train_exit_head, serve)

# Exit statuses (README): 0 done; 2 bad arguments or input files (found before or while loading: an
# option, a path, a prompts file, a checkpoint, a config); 1 a runtime failure (a device, the disk, the
# encoder); 128 + the signal when interrupted: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP.
EXIT_BAD_INPUT, EXIT_RUNTIME = 2, 1


def build_parser(config: dict | None = None) -> argparse.ArgumentParser:
    """The command line; `config` (from --protocol / --config) sets the generation options' defaults, so
    flags given on the command line still win."""
    parser = argparse.ArgumentParser(prog="sdvg", description="speculative decoding for video diffusion")
    parser.add_argument(*LOG_LEVEL_FLAG, **LOG_LEVEL_ARGS, default="warning")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub, config)
    for command_parser in sub.choices.values():  # also after the command: `sdvg generate --log-level info`
        command_parser.add_argument(*LOG_LEVEL_FLAG, **LOG_LEVEL_ARGS, default=argparse.SUPPRESS)
    return parser


LOG_LEVEL_FLAG = ("--log-level",)
LOG_LEVEL_ARGS = dict(choices=("debug", "info", "warning", "error", "critical"), type=str.lower,
                      help="records of the `sdvg` logger shown on stderr from this level (default: warning; "
                           "info: each component's load and the engine cache's decisions; `serve`: uvicorn's too)")


def configure_logging(level: str) -> None:
    """The `sdvg` logger's records on stderr from `level` (the command line's choice; a library user
    configures logging as they like)."""
    logger = logging.getLogger("sdvg")
    logger.setLevel(level.upper())
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):  # once per process
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (a later `main` call, or a test's capture,
    may have replaced the stream the first call saw)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ sets it; the property always reads sys.stderr
        pass


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
    configure_logging(args.log_level)
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
