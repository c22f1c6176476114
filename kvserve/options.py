"""Config dataclass fields that carry their own help text, so one definition gives the Python
API, the CLI flags (entrypoints/cli_args.py) and the server's options alike."""

from __future__ import annotations

import dataclasses


def option(default, help_text: str, **extra):
    """A config dataclass field with the help (and argparse extras, e.g. choices) that
    `add_dataclass_args` turns into its command-line flag."""
    return dataclasses.field(default=default, metadata={"help": help_text, **extra})
