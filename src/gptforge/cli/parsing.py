"""The command line's argument parsing: a parser whose usage errors are one line, and the
`--params`/`-S` options every command takes."""

from __future__ import annotations

import argparse
import os
from typing import Callable

from gptforge.errors import BadInput


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2 through BadInput.

    `describe`: a function that returns the description, called only when the help is shown
    (the benchmark's grid lives in a module that imports torch)."""

    def __init__(self, *args, describe: Callable[[], str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.describe = describe

    def format_help(self) -> str:
        if self.describe is not None:
            self.description, self.describe = self.describe(), None
        return super().format_help()

    def error(self, message: str):
        raise BadInput(f"{self.prog}: {message} (see --help)")


# gptforge.config.load.DEFAULT_PARAMS, spelled out so that --help does not load the config module
# (pydantic); tests/test_startup.py checks that the two agree.


DEFAULT_PARAMS_HELP = "params.yaml"


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--params",
        default=None,
        metavar="FILE",
        help=f"params file (default: {DEFAULT_PARAMS_HELP} if present, else the built-in defaults)",
    )
    p.add_argument(
        "-S",
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a param with DVC's dotted keys, value parsed as YAML; repeatable",
    )


def params_file(args) -> str | None:
    """An explicit --params must exist; without one, ./params.yaml is used when present."""
    from gptforge.config.load import DEFAULT_PARAMS

    if args.params is not None:
        return args.params
    return DEFAULT_PARAMS if os.path.exists(DEFAULT_PARAMS) else None
