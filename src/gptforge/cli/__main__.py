"""`python -m gptforge.cli`: the `gptforge` command."""

from gptforge.cli import entry

entry()
