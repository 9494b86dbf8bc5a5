"""`gptforge config show`: the resolved configuration (params file + overrides) as YAML."""

from __future__ import annotations

import sys

from gptforge.cli.parsing import Parser, config_args, params_file


def add_commands(sub) -> None:
    """`config show`."""
    config = sub.add_parser("config", help="inspect the resolved configuration")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", parser_class=Parser)
    config_sub.required = True
    show = config_sub.add_parser("show", help="print the resolved config (params file + overrides) as YAML")
    config_args(show)
    show.set_defaults(func=cmd_config_show)


def cmd_config_show(args) -> int:
    from gptforge.config.load import dump_yaml, load_config
    cfg = load_config(params_file(args), args.set)
    sys.stdout.write(dump_yaml(cfg))
    return 0
