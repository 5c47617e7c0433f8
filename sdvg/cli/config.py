"""`sdvg config`: print the resolved generation options (--protocol, then a --config file, then flags)
as YAML."""
from __future__ import annotations

from sdvg.options import add_option_flags, options_from_args

from sdvg.cli.args import add_config


def add_parser(sub, config: dict | None) -> None:
    c = sub.add_parser("config", help="print the resolved generation options (--config file, then flags)")
    add_option_flags(c)
    c.set_defaults(func=run)
    add_config(c, config)


def run(args, load_pipeline=None) -> int:
    """Print the resolved generation options (config file, then flags) as YAML; loads nothing."""
    import yaml

    print(yaml.safe_dump(options_from_args(args).as_dict(), sort_keys=False), end="")
    return 0
