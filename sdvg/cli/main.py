"""The parser of every command and the dispatch: parse, run the command's `run(args, load_pipeline)`,
turn its errors into the exit statuses docs/cli.md promises."""
from __future__ import annotations

import argparse
import logging
import sys

from sdvg.cli import calibrate, calibrate_exit, config, download, generate, memory, serve, sweep, train_exit_head
from sdvg.cli.args import config_values
from sdvg.cli.pipelines import Loader, build_pipeline
from sdvg.names import did_you_mean

# In the order `sdvg --help` lists them.
COMMANDS = (generate, config, memory, download, sweep, calibrate, calibrate_exit, train_exit_head, serve)

# Exit statuses (docs/cli.md): 0 done; 2 bad arguments or input files (found before or while loading: an
# option, a path, a prompts file, a checkpoint, a config); 1 a runtime failure (a device, the disk, the
# encoder); 128 + the signal when interrupted: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP.
EXIT_BAD_INPUT, EXIT_RUNTIME = 2, 1


class CommandLineParser(argparse.ArgumentParser):
    """argparse as a person meets it: a flag no command knows is refused by the command it was given to,
    with the closest flags offered; a misspelt choice (a command, --mode, ...) with the closest choices; a
    long usage is cut to one line that points at --help. Every command's parser is one of these."""

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            where = self
            if self._subparsers is not None and getattr(parsed, "command", None):
                where = self._subparsers._group_actions[0].choices[parsed.command]
            flag = extras[0].split("=", 1)[0]
            known = [o for a in where._actions for o in a.option_strings if o.startswith("--")]
            hint = did_you_mean(flag, known) if flag.startswith("-") else ""
            where.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            names = [str(c) for c in action.choices]
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{did_you_mean(str(value), names)} "
                                                 f"(choose from {', '.join(names)})")

    def error(self, message):
        usage = self.format_usage()
        if usage.count("\n") > 1:
            usage = f"usage: {self.prog} [options] ...  (`{self.prog} --help` lists them)\n"
        self.exit(2, f"{usage}{self.prog}: error: {message}\n")


def version_line() -> str:
    """`sdvg --version`: sdvg's version, the Python and the installed torch (read from its metadata: torch
    is not imported)."""
    import platform
    from importlib import metadata

    from sdvg import __version__

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    return f"sdvg {__version__} (Python {platform.python_version()}, torch {torch})"


class VersionAction(argparse.Action):
    """--version: print `version_line()` and exit 0 (computed only when asked)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="print sdvg's version, the Python and the installed torch, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser(config: dict | None = None) -> argparse.ArgumentParser:
    """The command line; `config` (from --protocol / --config) sets the generation options' defaults, so
    flags given on the command line still win."""
    parser = CommandLineParser(prog="sdvg", description="speculative decoding for video diffusion")
    parser.add_argument("--version", action=VersionAction)
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
    from sdvg.io.interrupts import Interrupted, exit_code_of, signals_interrupt
    from sdvg.io.locks import lock_command_outputs
    from sdvg.io.outputs import check_output_folders
    from sdvg.io.prompts import with_prompts_file_resolved

    command_line = list(sys.argv) if argv is None else ["sdvg", *argv]  # the statistics' run.argv
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(config_values(argv)).parse_args(argv)
    args.command_line = command_line
    configure_logging(args.log_level)
    received: list[int] = []  # the signals that came (signals_interrupt)
    try:
        try:
            check_output_folders(args)  # a missing folder without --create-dirs: refused before the lock makes it
            # before the first block too (loading): exit 128 + signal, no traceback; every output locked first
            with signals_interrupt(received), lock_command_outputs(args):
                return args.func(with_prompts_file_resolved(args), load_pipeline or build_pipeline)
        except Exception:
            if received:  # a signal that C code turned into another error (an import's ImportError): interrupted
                raise Interrupted(received[0]) from None
            raise
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc.args[0] if exc.args else 'SIGINT'})", file=sys.stderr)
        return exit_code_of(exc)
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, MemoryBudgetError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # a budget refusal comes before any allocation: the arguments
        return EXIT_BAD_INPUT
    except (RuntimeError, OSError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT if is_input_error(exc) else EXIT_RUNTIME
