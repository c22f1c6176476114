"""Config dataclass fields that carry their own help text, so one definition gives the Python
API, the CLI flags (entrypoints/cli_args.py) and the server's options alike."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable


def option(default, help_text: str, **extra):
    """A config dataclass field with the help (and argparse extras, e.g. choices) that
    `add_dataclass_args` turns into its command-line flag."""
    return dataclasses.field(default=default, metadata={"help": help_text, **extra})


def json_option_text(value: str | dict | None, parse: Callable) -> str | None:
    """A JSON-valued option (a dict from Python, text from the command line) as the text a
    config keeps (it crosses processes), checked by `parse` first; None when not given."""
    if value is None or value == "":
        return None
    parse(value)
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
